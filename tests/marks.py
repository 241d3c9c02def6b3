"""The tiers of the suite, and how a parametrised test picks its representatives.

* default (``make test``; about 5 minutes on 2 near-idle cores on Keras 3, CONTRIBUTING.md):
  every capability once -- one representative configuration per check, every refusal,
  every fast unit test;
* ``thorough`` (``make test-thorough``; CI runs it on Keras 2 only, ``make
  test-keras2-all``, to stay within 40 minutes): the other
  configurations of a default check (more layers, pipelines, losses, families) and the
  single tests that take tens of seconds (several processes, long ledgers);
* ``slow`` (``make test-slow``): training to accuracy and long adversarial searches.

A test moves to ``thorough`` when a default test already runs the same code path: the
tier keeps the suite's coverage in CI while a developer's loop stays short.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

thorough = pytest.mark.thorough


def representatives(names: Iterable, default: Iterable, smoke: Iterable = ()) -> list:
    """``names`` as parameters: those outside ``default`` marked ``thorough``, those in
    ``smoke`` marked ``smoke`` (the run on the current TensorFlow, whatever the tier).

    ``default`` and ``smoke`` must name existing cases: a renamed case would otherwise
    silently leave the default run."""
    names, default, smoke = list(names), set(default), set(smoke)
    unknown = (default | smoke) - set(names)
    if unknown:
        raise ValueError(f"cases {sorted(unknown)} are not among the parameters")
    params = []
    for name in names:
        marks = ([] if name in default else [thorough]) + (
            [pytest.mark.smoke] if name in smoke else []
        )
        params.append(pytest.param(name, marks=marks) if marks else name)
    return params


#: Tests of the thorough tier named in one place (``tests/conftest.py`` marks them at
#: collection): a whole test function (``file::test``) or one of its cases
#: (``file::test[id]``), grouped by file under a comment naming what runs by default there
#: (the same code paths); ``tests/test_marks.py`` checks that every entry still names a test
#: and that none is listed twice.
THOROUGH_TESTS = {
    # test_fit_on_arrays_on_every_backend.py: by default, the Binomial sizes of the shared base's
    # Poisson draws (PrivateModelBase.private_batches) on the clipped family.
    "tests/backends/test_fit_on_arrays_on_every_backend.py::test_fit_draws_poisson_batches_of_binomial_sizes_afresh_every_epoch[clipless]",
    # test_budget.py: by default, the RDP calibration.
    "tests/accounting/test_budget.py::test_calibrate_with_pld",
    # test_plan_invariant.py: by default, global and multiplicity-3 before/after fit, and
    # get_max_epochs on Poisson batches.
    "tests/accounting/test_plan_invariant.py::test_epsilon_before_fit_equals_epsilon_after[laplace-clipping]",
    "tests/accounting/test_plan_invariant.py::test_epsilon_before_fit_equals_epsilon_after[per-layer]",
    "tests/accounting/test_plan_invariant.py::test_epsilon_before_fit_equals_epsilon_after[poisson]",
    "tests/accounting/test_plan_invariant.py::test_epsilon_before_fit_equals_epsilon_after[quantile-clipping]",
    "tests/accounting/test_plan_invariant.py::test_get_max_epochs_agrees_with_the_budget_stop[global]",
    "tests/accounting/test_plan_invariant.py::test_get_max_epochs_agrees_with_the_budget_stop[laplace-clipping]",
    # test_rdp.py: by default, one cross-check with dp-accounting stays.
    "tests/accounting/test_rdp.py::test_cross_check_with_dp_accounting_rdp[0.8-0.1]",
    "tests/accounting/test_rdp.py::test_cross_check_with_dp_accounting_rdp[2.0-0.001]",
    "tests/accounting/test_rdp.py::test_cross_check_with_dp_accounting_rdp[5.0-0.1]",
    # test_tuning_cost.py: by default, the private random search stays.
    "tests/accounting/test_tuning_cost.py::test_model_report_and_calibration_include_the_search",
    "tests/accounting/test_tuning_cost.py::test_optuna_random_search_asks_optuna_and_declares_the_search",
    "tests/accounting/test_tuning_cost.py::test_private_random_search_refuses_runs_of_another_mechanism",
    # test_cli.py: by default, `lipdp train --save` and the loading of its model, the refusals and
    # the help stay.
    "tests/cli/test_cli.py::test_cli_evaluate_trains_saves_and_loads",
    "tests/cli/test_cli.py::test_cli_gradient_clip_bounds_the_logit_gradient",
    "tests/cli/test_cli.py::test_cli_train_runs_and_reports",
    "tests/cli/test_cli.py::test_cli_trains_adversarially_in_both_families",
    "tests/cli/test_cli.py::test_cli_trains_clipped_dp_sgd",
    "tests/cli/test_cli.py::test_cli_trains_dp_sgd_with_bam_and_per_layer_clipping",
    "tests/cli/test_cli.py::test_cli_trains_lip_dp_sgd_on_breast_cancer",
    "tests/cli/test_cli.py::test_cli_trains_scattering_models_in_both_families",
    "tests/cli/test_cli.py::test_cli_trains_with_sgd_and_momentum",
    "tests/cli/test_cli.py::test_no_native_start_up_lines_in_a_real_process",
    # test_dynamic.py: by default, one callback changing the clip (laplace-mean), the subsample rate
    # and the ledger's record stay.
    "tests/clipless/test_dynamic.py::test_callbacks_change_clip_value_within_limits[laplace-quantile]",
    "tests/clipless/test_dynamic.py::test_callbacks_change_clip_value_within_limits[quantiles]",
    "tests/clipless/test_dynamic.py::test_patience_schedules_updates",
    "tests/clipless/test_dynamic.py::test_rounds_follow_the_model_epochs_across_fit_calls",
    "tests/clipless/test_dynamic.py::test_two_dynamic_layers_are_updated_and_logged",
    # test_losses.py: by default, the adversarial search on the softmax, logistic, hinge-KR, cosine
    # and absolute-error losses stays (every configuration's bound is checked on random data by
    # default).
    "tests/clipless/test_losses.py::test_bound_adversarial[bce-soft]",
    "tests/clipless/test_losses.py::test_bound_adversarial[bce-tau3.0]",
    "tests/clipless/test_losses.py::test_bound_adversarial[hinge-m0.3-anyK]",
    "tests/clipless/test_losses.py::test_bound_adversarial[hinge-m0.3-nb]",
    "tests/clipless/test_losses.py::test_bound_adversarial[hinge-m1.0-anyK]",
    "tests/clipless/test_losses.py::test_bound_adversarial[hinge-m1.0-nb]",
    "tests/clipless/test_losses.py::test_bound_adversarial[hkr-a0.5-m2.0-anyK]",
    "tests/clipless/test_losses.py::test_bound_adversarial[hkr-a0.5-m2.0-nb]",
    "tests/clipless/test_losses.py::test_bound_adversarial[hkr-a10.0-m1.0-nb]",
    "tests/clipless/test_losses.py::test_bound_adversarial[kcos-K0.01]",
    "tests/clipless/test_losses.py::test_bound_adversarial[kcos-K0.5]",
    "tests/clipless/test_losses.py::test_bound_adversarial[kcos-K1.0]",
    "tests/clipless/test_losses.py::test_bound_adversarial[kcos-K100.0]",
    "tests/clipless/test_losses.py::test_bound_adversarial[kr-anyK]",
    "tests/clipless/test_losses.py::test_bound_adversarial[kr-nb]",
    "tests/clipless/test_losses.py::test_bound_adversarial[tau_cce-smoothed]",
    "tests/clipless/test_losses.py::test_bound_adversarial[tau_cce-tau0.1]",
    "tests/clipless/test_losses.py::test_bound_adversarial[tau_cce-tau30.0]",
    # test_model.py: by default, saving: four layers' round trips (CNN, residual block, gradient
    # clip, spectral dense); the global noise level.
    "tests/clipless/test_model.py::test_every_layer_survives_save_and_load[AddBias(after conv and dense)]",
    "tests/clipless/test_model.py::test_every_layer_survives_save_and_load[LayerCentering]",
    "tests/clipless/test_model.py::test_every_layer_survives_save_and_load[MaxPool2D]",
    "tests/clipless/test_model.py::test_every_layer_survives_save_and_load[Permute+Reshape]",
    "tests/clipless/test_model.py::test_every_layer_survives_save_and_load[QuickFrobeniusDense]",
    "tests/clipless/test_model.py::test_every_layer_survives_save_and_load[ReLU(leaky)]",
    "tests/clipless/test_model.py::test_every_layer_survives_save_and_load[ScaledGlobalL2NormPooling2D]",
    "tests/clipless/test_model.py::test_noise_std_matches_sigma_times_sensitivity[per-layer]",
    "tests/clipless/test_model.py::test_save_and_load_round_trip",
    # test_projections.py: by default, the spectral projection after hostile steps.
    "tests/clipless/test_projections.py::test_projection_lands_in_feasible_set_after_hostile_steps[frobenius]",
    "tests/clipless/test_projections.py::test_projection_lands_in_feasible_set_after_hostile_steps[orthogonal]",
    # test_scattering.py: by default, one Lipschitz search, kymatio's filters and a model trained
    # with the layer.
    "tests/clipless/test_scattering.py::test_certified_constants_of_the_standard_configuration",
    "tests/clipless/test_scattering.py::test_lipschitz_constant_holds_under_adversarial_pairs_and_jacobians[shape1-options1-0.6]",
    "tests/clipless/test_scattering.py::test_output_norm_bound_holds_and_zero_maps_to_zero",
    "tests/clipless/test_scattering.py::test_scattering_net_saves_and_reloads_with_its_bounds",
    "tests/clipless/test_scattering.py::test_the_clipped_family_takes_the_layer",
    # test_extreme_records.py: by default, flat, automatic and global clipping with ghost norms, the
    # Jacobian method under flat; the grouped convolution (per-row loop, each call an XLA
    # compilation on CPU: 4-6 s a case) through its released clipped sums at every scale,
    # its norms against the naive loop in test_per_example.py.
    "tests/clipped/test_extreme_records.py::test_norms_equal_a_float64_reference_from_1e_minus_30_to_1e30[fallback-grouped-conv2d]",
    "tests/clipped/test_extreme_records.py::test_undivided_moderate_cotangents_equal_a_float64_reference[fallback-grouped-conv2d]",
    "tests/clipped/test_extreme_records.py::test_clipped_sums_release_at_most_r_per_row_at_every_scale[jacobian-fallback-grouped-conv2d]",
    "tests/clipped/test_extreme_records.py::test_remove_one_on_the_extreme_record_stays_within_the_sensitivity[flat-jacobian]",
    "tests/clipped/test_extreme_records.py::test_remove_one_on_the_extreme_record_stays_within_the_sensitivity[per-layer-ghost]",
    # test_model.py: by default, the attack under flat and global clipping; BAM in
    # test_per_example.py; saving in test_privacy_state.py.
    "tests/clipped/test_model.py::test_one_row_moves_the_sum_by_at_most_the_clip_norm_under_attack[bam]",
    "tests/clipped/test_model.py::test_trains_on_poisson_batches_and_saves_its_privacy_state",
    # test_per_example.py: by default, remove-one on the functional chain (per-layer); BAM on one
    # nested chain's siblings.
    "tests/clipped/test_per_example.py::test_bam_ascent_is_per_example[nested-functional-chain]",
    "tests/clipped/test_per_example.py::test_remove_one_on_nested_models_stays_within_the_sensitivity[nested-sequential-cnn-frozen-block-flat]",
    # test_adversarial.py: by default, the flat-clipping attack, the ghost naive loop, the attack's
    # teeth and the noise/epsilon check.
    "tests/core/test_adversarial.py::test_certified_accuracy_never_exceeds_pgd_accuracy",
    "tests/core/test_adversarial.py::test_clipless_adversarial_training_learns_and_reloads",
    "tests/core/test_adversarial.py::test_clipped_adversarial_sum_equals_a_naive_loop[jacobian]",
    "tests/core/test_adversarial.py::test_one_row_of_clipped_adversarial_training_moves_the_sum_by_at_most_r[clipping1]",
    # test_batch_independence.py: by default, the leaks that were, the probe on fit and
    # train_on_batch, group normalisation and the fixer; nested models in test_per_example.py.
    "tests/core/test_batch_independence.py::test_fixed_resnet_backbone_passes_trains_and_stays_within_its_sensitivity",
    "tests/core/test_batch_independence.py::test_per_example_constructions_pass_and_stay_within_their_sensitivity[layer-normalization]",
    "tests/core/test_batch_independence.py::test_per_example_constructions_pass_and_stay_within_their_sensitivity[nested-models]",
    "tests/core/test_batch_independence.py::test_the_probe_refuses_a_batch_mean_layer_on_every_path[custom-loop]",
    "tests/core/test_batch_independence.py::test_the_probe_runs_once_per_step_under_a_mirrored_strategy",
    # test_compat.py: by default, keras imported first (one process each).
    "tests/core/test_compat.py::test_importing_keras_before_or_after_lipdp_trains_a_keras_model[lipdp first]",
    # test_distribute.py: by default, the partitioned Poisson pipeline of each family, the noise of
    # two replicas (clipless), the same fixed noise (DP-SGD), the replicas of DP-SGD, dynamic
    # clipping (Laplace) and the refusals; micro-batches on replicas once per family and once per
    # pipeline (the uneven split of 3 rows with them); the two-process test also runs in the
    # smoke run.
    "tests/core/test_distribute.py::test_dynamic_clipping_under_mirrored_updates_every_copy_once[quantile]",
    "tests/core/test_distribute.py::test_micro_batches_on_replicas_equal_whole_batches_on_one_device[arrays-adversarial-clipless]",
    "tests/core/test_distribute.py::test_micro_batches_on_replicas_equal_whole_batches_on_one_device[poisson-random-sizes-dp-sgd]",
    "tests/core/test_distribute.py::test_train_on_batch_under_mirrored_takes_batches_smaller_than_the_replicas[3]",
    "tests/core/test_distribute.py::test_noiseless_mirrored_steps_equal_single_device_steps[clipless-arrays-adversarial]",
    "tests/core/test_distribute.py::test_noiseless_mirrored_steps_equal_single_device_steps[dp-sgd-arrays-adversarial]",
    "tests/core/test_distribute.py::test_noiseless_mirrored_steps_equal_single_device_steps[dp-sgd-arrays]",
    "tests/core/test_distribute.py::test_noiseless_mirrored_steps_equal_single_device_steps[dp-sgd-poisson-random-sizes]",
    "tests/core/test_distribute.py::test_noiseless_mirrored_steps_equal_single_device_steps[dp-sgd-poisson]",
    "tests/core/test_distribute.py::test_released_noise_has_the_standard_deviation_of_one_step[clipless-1]",
    "tests/core/test_distribute.py::test_released_update_is_the_single_device_update_with_the_same_noise[clipless]",
    "tests/core/test_distribute.py::test_released_noise_has_the_standard_deviation_of_one_step[dp-sgd-1]",
    "tests/core/test_distribute.py::test_released_noise_has_the_standard_deviation_of_one_step[dp-sgd-2]",
    "tests/core/test_distribute.py::test_replicas_stay_identical_and_epsilon_counts_global_steps[clipless]",
    "tests/core/test_distribute.py::test_two_workers_match_one_device_and_draw_the_noise_once[clipless]",
    # test_invalid_inputs.py: by default, the embedding's out-of-range ids and the refusal on
    # arrays; the labels' pipeline twin.
    "tests/core/test_invalid_inputs.py::test_pipelines_count_invalid_inputs_once_per_row",
    "tests/core/test_invalid_inputs.py::test_several_inputs_are_matched_as_the_first_layer_matches_them",
    "tests/core/test_invalid_inputs.py::test_the_step_releases_the_gradient_without_out_of_range_ids[category-encoding-ghost-int32]",
    # test_invalid_labels.py: by default, ghost norms with integer labels, the clipless step, the
    # pipelines and the refusal (clipless).
    "tests/core/test_invalid_labels.py::test_clipped_step_releases_the_gradient_without_out_of_range_rows[jacobian-float]",
    "tests/core/test_invalid_labels.py::test_fit_on_arrays_refuses_out_of_range_labels_naming_the_rows[clipped]",
    # test_noise_source.py: by default, XLA steps: test_xla.py.
    "tests/core/test_noise_source.py::test_noise_under_xla_has_the_calibrated_std",
    # test_non_finite_records.py: by default, one NaN example in input and label at once.
    "tests/core/test_non_finite_records.py::test_one_nan_example_moves_the_update_by_at_most_its_bound[input]",
    "tests/core/test_non_finite_records.py::test_one_nan_example_moves_the_update_by_at_most_its_bound[label]",
    "tests/core/test_non_finite_records.py::test_pipelines_train_finite_weights_and_count_the_bad_rows",
    # test_privacy_ledger.py: by default, a step records its mechanism (DP-SGD), a fresh run equals
    # the plan, non-private steps; the 34-s chain of freezes, reloads and rebuilds is thorough.
    "tests/core/test_privacy_ledger.py::test_a_step_records_the_mechanism_it_was_traced_with[clipless]",
    "tests/core/test_privacy_ledger.py::test_epsilon_never_decreases_through_changes_reloads_and_rebuilds",
    # test_privacy_state.py: by default, the .keras round trip.
    "tests/core/test_privacy_state.py::test_weights_checkpoint_and_a_fresh_optimizer_keep_the_count",
    # test_weight_penalties.py: by default, the refusals of data-dependent losses.
    "tests/core/test_weight_penalties.py::test_weight_penalty_is_added_to_the_released_gradient_outside_the_sensitivity",
    # test_xla.py: by default, the DP-SGD step under XLA (16 s for the clipless one); the host's
    # check of the batch size (the shared step's) on DP-SGD.
    "tests/core/test_xla.py::test_xla_step_gives_the_default_result[clipless]",
    "tests/core/test_xla.py::test_xla_fixed_size_steps_check_the_rows_on_the_host[clipless]",
    # test_images.py: by default, test_sources.py reads Debian's Fashion-MNIST; test_poisson.py the
    # Poisson pipeline.
    "tests/data/test_images.py::test_fashion_mnist_from_debian",
    "tests/data/test_images.py::test_poisson_image_pipeline_trains_the_accounted_mechanism",
    # test_diagnostics.py: by default, the sensitivity audits.
    "tests/evaluation/test_diagnostics.py::test_signal_to_noise_callbacks",
    # test_robustness.py: by default, the certified Lipschitz ratios.
    "tests/evaluation/test_robustness.py::test_no_pgd_attack_succeeds_inside_the_certified_radius",
    # test_attacks_couplings_records_ledger.py: by default, the bounded input, a frozen layer
    # (clipless), restoring a checkpoint, the plan after freezing (DP-SGD), the per-row loss
    # and every refusal.
    "tests/test_attacks_couplings_records_ledger.py::test_a_custom_loop_holding_an_old_step_records_what_it_runs",
    "tests/test_attacks_couplings_records_ledger.py::test_a_new_model_on_a_privately_trained_backbone_inherits_its_ledger",
    "tests/test_attacks_couplings_records_ledger.py::test_adversarial_class_labels_never_fail_a_step",
    "tests/test_attacks_couplings_records_ledger.py::test_an_out_of_range_token_id_does_not_fail_the_step[jacobian]",
    "tests/test_attacks_couplings_records_ledger.py::test_clipless_losses_bound_rows_with_labels_outside_their_domain",
    "tests/test_attacks_couplings_records_ledger.py::test_dropping_the_search_declaration_does_not_lower_epsilon",
    "tests/test_attacks_couplings_records_ledger.py::test_flags_changed_after_compile_are_refused_until_compile_runs_again",
    "tests/test_attacks_couplings_records_ledger.py::test_per_layer_noise_with_a_frozen_layer_stays_within_its_sensitivity[dp-sgd]",
    "tests/test_attacks_couplings_records_ledger.py::test_restoring_earlier_weights_does_not_rewind_the_ledger[early-stopping]",
    "tests/test_attacks_couplings_records_ledger.py::test_the_jacobian_method_clips_a_loss_reading_a_weight_with_each_row",
    "tests/test_attacks_couplings_records_ledger.py::test_the_plan_after_freezing_without_recompiling_is_what_fit_runs[clipless]",
    "tests/test_attacks_couplings_records_ledger.py::test_the_random_layer_alone_is_sound",
}  # fmt: skip


def is_thorough(nodeid: str) -> bool:
    """Whether ``nodeid`` (or its test function) is listed in :data:`THOROUGH_TESTS`."""
    return nodeid in THOROUGH_TESTS or nodeid.split("[", 1)[0] in THOROUGH_TESTS
