"""lipdp.evaluation: certificates vs attacks, calibration, membership inference,
diagnostics and the ``lipdp evaluate`` command."""

import logging
import math

import numpy as np
import pytest
import tensorflow as tf
from scipy.stats import norm

from lipdp import datasets, losses, zoo
from lipdp import layers as L
from lipdp.audit import SensitivityViolation
from lipdp.cli import CNN_WIDTHS, INPUT_BOUNDS, main
from lipdp.evaluation import calibration, diagnostics, membership, robustness
from lipdp.model import DP_Sequential, DPParameters, compute_gradient_bounds
from lipdp.pipeline import DatasetMetadata


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def digits():
    return datasets.load_digits()


def _digits_cnn(data, sigma=1.0, batch_size=512):
    """The CNN of ``lipdp train`` on digits, on the whole batches of the training set."""
    n = len(data.x_train) - len(data.x_train) % batch_size
    metadata = DatasetMetadata(
        input_shape=data.x_train.shape[1:],
        nb_classes=data.nb_classes,
        nb_samples_train=n,
        nb_samples_test=len(data.x_test),
        class_names=data.class_names,
        batch_size=batch_size,
        max_norm=INPUT_BOUNDS["digits"],
    )
    params = DPParameters("global", sigma, 1e-5)
    model = zoo.build_model("pooled_cnn", metadata, params, widths=CNN_WIDTHS["digits"])
    x, y = data.x_train[:n], np.eye(data.nb_classes, dtype="float32")[data.y_train[:n]]
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=8.0),
        optimizer=tf.keras.optimizers.Adam(0.02),
        metrics=["accuracy"],
    )
    return model, x, y


@pytest.fixture(scope="module")
def trained(digits):
    """The CNN of ``lipdp train`` trained with DP (sigma = 1) for 15 epochs.

    Shared by several tests: they must not train it further.
    """
    tf.keras.utils.set_random_seed(0)
    model, x, y = _digits_cnn(digits)
    model.fit(x, y, batch_size=model.batch_size, epochs=15, verbose=0)
    return model, x, y


def _vector_model(dp_layers, input_dim=6, batch=8, upper_bound=3.0, loss=None, lr=0.0):
    meta = DatasetMetadata(
        input_shape=(input_dim,), nb_classes=5, nb_samples_train=4 * batch, batch_size=batch
    )
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(input_dim,), upper_bound=upper_bound), *dp_layers],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=meta,
    )
    model.compile(
        loss=loss or losses.DP_TauCategoricalCrossentropy(tau=8.0),
        optimizer=tf.keras.optimizers.SGD(lr),
    )
    return model


# --------------------------------------------------------------------- Lipschitz constant
def test_lipschitz_constant_of_the_shipped_cnn(trained):
    assert robustness.lipschitz_constant(trained[0]) == pytest.approx(1.0)


def _identity_dense(units):
    layer = L.DP_QuickSpectralDense(units)
    layer.build((None, units))
    layer.kernel.assign(tf.eye(units))
    return layer


@pytest.mark.parametrize(
    "policy, path_constant, expected",
    [("add", 1.0, 2.0), ("1-lip-add", 1.0, 1.0), ("add", 3.0, 4.0), ("1-lip-add", 3.0, 2.0)],
)
def test_lipschitz_constant_of_residual_blocks(policy, path_constant, expected):
    path = [_identity_dense(6)]
    if path_constant != 1.0:
        path.append(
            L.DP_Lambda(
                lambda t, c=path_constant: c * t,
                lipschitz_constant=path_constant,
                output_gain=path_constant,
            )
        )
    model = _vector_model([*L.make_residuals(policy, path), L.DP_QuickSpectralDense(5)])
    lip = robustness.lipschitz_constant(model)
    assert lip == pytest.approx(expected)
    # The skip path and the identity kernel make the block exactly (1 + c) or
    # (1 + c) / 2 times the identity: the constant is attained.
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32") * 0.1

    def block(t):
        for layer in model.dp_layers[1:-1]:
            t = layer(t)
        return t.numpy()

    x2 = x + 0.01
    ratio = np.linalg.norm(block(x2) - block(x), axis=1) / np.linalg.norm(x2 - x, axis=1)
    np.testing.assert_allclose(ratio, expected, rtol=1e-5)


def test_lipschitz_constant_of_nested_residual_blocks():
    # outer "add" around [inner "add" around an identity kernel]: x + (x + x) = 3x
    inner = [
        L.DP_SplitResidual(),
        L.DP_WrappedResidual(_identity_dense(6)),
        L.DP_MergeResidual("add"),
    ]
    model = _vector_model([*L.make_residuals("add", inner), L.DP_QuickSpectralDense(5)])
    assert robustness.lipschitz_constant(model) == pytest.approx(3.0)
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32") * 0.1
    h = x
    for layer in model.dp_layers[1:-1]:
        h = layer(h)
    np.testing.assert_allclose(h.numpy(), 3 * x, rtol=1e-5, atol=1e-6)


def test_clip_gradient_counts_as_identity_and_blocks_compose():
    model = _vector_model(
        [
            *L.make_residuals("add", [L.DP_QuickSpectralDense(6)]),
            L.DP_ClipGradient(0.01),
            *L.make_residuals("add", [L.DP_QuickSpectralDense(6), L.DP_ClipGradient(0.5)]),
            L.DP_QuickSpectralDense(5),
            L.DP_ClipGradient(0.1),
        ]
    )
    assert robustness.lipschitz_constant(model) == pytest.approx(4.0)


# -------------------------------------------------------------------------- certificates
def test_certified_radius_and_accuracy_hand_values():
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 0.5, 0.4], [2.0, 0.0, 2.5]])
    np.testing.assert_allclose(
        robustness.certified_radius(logits, 1.0),
        [math.sqrt(2), 0.1 / math.sqrt(2), 0.5 / 1.4142135623730951],
    )
    np.testing.assert_allclose(robustness.certified_radius(logits, 2.0)[0], math.sqrt(2) / 2)
    # single logit: decision f > 0, radius |f| / L
    np.testing.assert_allclose(
        robustness.certified_radius(np.array([[-1.5], [0.2]]), 0.5), [3, 0.4]
    )
    # labels: 0 (correct, r = 1.414), 2 (wrong), 2 (correct, r = 0.354)
    acc = robustness.certified_accuracy_from_logits(
        logits, [0, 2, 2], [0, 0.3, 0.36, 1.4, 1.5], 1.0
    )
    np.testing.assert_allclose(acc, [2 / 3, 2 / 3, 1 / 3, 1 / 3, 0])
    onehot = np.eye(3)[[0, 2, 2]]
    np.testing.assert_allclose(
        robustness.certified_accuracy_from_logits(logits, onehot, [0, 0.36], 1.0), [2 / 3, 1 / 3]
    )


def test_no_pgd_attack_succeeds_inside_the_certified_radius(trained, digits):
    model = trained[0]
    lip = robustness.lipschitz_constant(model)
    logits = robustness.predict_logits(model, digits.x_test)
    correct = logits.argmax(axis=1) == digits.y_test
    assert correct.mean() > 0.8
    x, y = digits.x_test[correct], digits.y_test[correct]
    radius = robustness.certified_radius(logits[correct], lip)
    assert np.median(radius) > 0.05
    _, margin = robustness.pgd_l2_attack(model, x, y, 0.999 * radius, steps=30, restarts=3)
    assert np.all(margin < 0), f"adversarial example inside a certificate: {margin.max()}"
    # The same attack is not toothless: at three times the certified radius it
    # changes many decisions.
    x_adv, margin = robustness.pgd_l2_attack(model, x, y, 3 * radius, steps=20, restarts=1)
    assert np.mean(margin > 0) > 0.2
    moved = np.linalg.norm((x_adv - x).reshape(len(x), -1), axis=1)
    assert np.all(moved <= 3 * radius * (1 + 1e-5) + 1e-6)
    flipped = robustness.predict_logits(model, x_adv).argmax(axis=1) != y
    np.testing.assert_array_equal(flipped, margin > 0)


def test_lipschitz_constant_bounds_empirical_ratios(trained, digits):
    model = trained[0]
    lip = robustness.lipschitz_constant(model)
    rng = np.random.default_rng(0)
    a = digits.x_test[:128]
    b = a + rng.normal(size=a.shape).astype("float32") * 0.3
    f = robustness.predict_logits
    ratios = np.linalg.norm(f(model, a) - f(model, b), axis=1) / np.linalg.norm(
        (a - b).reshape(len(a), -1), axis=1
    )
    searched = robustness.empirical_lipschitz(model, digits.x_test[:32], steps=40)
    assert ratios.max() <= lip * (1 + 1e-5)
    assert searched.max() <= lip * (1 + 1e-5)
    assert searched.max() > ratios.max()  # the ascent does push the ratio up


def test_certified_accuracy_is_decreasing_and_starts_at_accuracy(trained, digits):
    model = trained[0]
    radii = np.linspace(0, 2, 9)
    acc = robustness.certified_accuracy(model, digits.x_test, digits.y_test, radii)
    _, clean = model.evaluate(digits.x_test, np.eye(10)[digits.y_test], verbose=0)
    assert acc[0] == pytest.approx(clean, abs=1e-6)
    assert np.all(np.diff(acc) <= 0)


def test_scaled_auc_and_certifiable_auroc_hand_values():
    y = np.array([[1.0], [1.0], [0.0], [0.0]])
    s = np.array([[0.3], [0.1], [0.2], [-0.1]])

    def value(metric):
        metric.update_state(y, s)
        return float(metric.result())

    # 3 of the 4 (positive, negative) pairs are ordered correctly.
    assert value(robustness.ScaledAUC(scale=20.0, num_thresholds=2000)) == pytest.approx(
        0.75, abs=2e-3
    )
    auroc = robustness.CertifiableAUROC
    assert value(auroc(0.0, scale=20.0, num_thresholds=2000)) == pytest.approx(0.75, abs=2e-3)
    # worst-case scores at radius 0.05: positives 0.25, 0.05; negatives 0.25, -0.05:
    # one tie (1/2), two correct pairs, one wrong: 2.5 / 4.
    assert value(auroc(0.05, scale=20.0, num_thresholds=2000)) == pytest.approx(0.625, abs=2e-3)
    # a Lipschitz constant of 2 doubles the shift: positives 0.2, 0.0; negatives 0.3,
    # 0.0: one correct pair, one tie -> 1.5 / 4
    got = value(auroc(0.05, lipschitz=2.0, scale=20.0, num_thresholds=2000))
    assert got == pytest.approx(0.375, abs=2e-3)
    assert value(auroc(1.0, scale=20.0)) == pytest.approx(0.0, abs=1e-3)
    metric = auroc(0.05, lipschitz=2.0, scale=3.0)
    clone = auroc.from_config(metric.get_config())
    assert (clone.radius, clone.lipschitz, clone.scale) == (0.05, 2.0, 3.0)
    with pytest.raises(ValueError):
        robustness.ScaledAUC(scale=1.0, from_logits=False)


# --------------------------------------------------------------------------- calibration
PROBS = np.array(
    [
        [0.9, 0.05, 0.05],  # label 0: confidence 0.9, correct
        [0.2, 0.7, 0.1],  # label 0: confidence 0.7, wrong
        [0.4, 0.35, 0.25],  # label 0: confidence 0.4, correct
        [0.3, 0.3, 0.4],  # label 1: confidence 0.4, wrong
    ]
)
LABELS = np.array([0, 0, 0, 1])


def test_calibration_errors_hand_values():
    # 2 bins: (0, .5] holds examples 3, 4 (confidence .4, accuracy .5: gap .1);
    # (.5, 1] holds 1, 2 (confidence .8, accuracy .5: gap .3).
    assert calibration.expected_calibration_error(PROBS, LABELS, 2) == pytest.approx(0.2)
    assert calibration.maximum_calibration_error(PROBS, LABELS, 2) == pytest.approx(0.3)
    # 10 bins: .4 -> (.3, .4] (gap .1, 2 examples), .7 -> (.6, .7] (gap .7), .9 -> (.8, .9]
    # (gap .1): ECE = (2 * .1 + .7 + .1) / 4, MCE = .7
    assert calibration.expected_calibration_error(PROBS, LABELS, 10) == pytest.approx(0.25)
    assert calibration.maximum_calibration_error(PROBS, np.eye(3)[LABELS], 10) == pytest.approx(0.7)
    nll = -(math.log(0.9) + math.log(0.2) + math.log(0.4) + math.log(0.3)) / 4
    assert calibration.negative_log_likelihood(PROBS, LABELS) == pytest.approx(nll)
    report = calibration.calibration_report(PROBS, LABELS, 2)
    assert report.as_dict() == pytest.approx({"accuracy": 0.5, "ece": 0.2, "mce": 0.3, "nll": nll})


def test_reliability_diagram_data_and_bin_edges():
    diagram = calibration.reliability_diagram(PROBS, LABELS, 4)
    np.testing.assert_allclose(diagram.edges, [0, 0.25, 0.5, 0.75, 1])
    np.testing.assert_array_equal(diagram.counts, [0, 2, 1, 1])
    np.testing.assert_allclose(diagram.confidence, [np.nan, 0.4, 0.7, 0.9])
    np.testing.assert_allclose(diagram.accuracy, [np.nan, 0.5, 0.0, 1.0])
    # bins are ((m-1)/M, m/M]: a confidence on an edge goes to the lower bin
    edge = np.array([[0.5, 0.5], [0.75, 0.25], [1.0, 0.0]])
    np.testing.assert_array_equal(
        calibration.reliability_diagram(edge, [0, 0, 0], 4).counts, [0, 1, 1, 1]
    )
    # perfectly calibrated toy: 4 predictions at .75 with 3 correct
    calibrated = np.array([[0.75, 0.25]] * 4)
    assert calibration.expected_calibration_error(calibrated, [0, 0, 0, 1], 10) == pytest.approx(
        0.0
    )


def test_reliability_plot_saves_a_png(tmp_path):
    figure = calibration.plot_reliability_diagram(PROBS, LABELS, n_bins=4, title="toy")
    path = tmp_path / "reliability.png"
    figure.savefig(path)
    assert path.stat().st_size > 1000
    assert figure.axes[0].get_title() == "toy: ECE 0.250, MCE 0.700"


# --------------------------------------------------------------------- membership inference
def test_auroc_and_advantage_hand_values():
    assert membership.roc_auc([1, 3], [2, 0]) == pytest.approx(0.75)
    assert membership.attacker_advantage([1, 3], [2, 0]) == pytest.approx(0.5)
    # ties count 1/2
    assert membership.roc_auc([1, 1], [1, 0]) == pytest.approx(0.75)
    assert membership.attacker_advantage([1, 1], [1, 0]) == pytest.approx(0.5)
    result = membership.loss_threshold_attack([0.1, 0.2], [0.3, 0.4])
    assert (result.auroc, result.advantage) == (1.0, 1.0)
    assert membership.dp_advantage_bound(0.0) == 0.0
    assert membership.dp_advantage_bound(math.log(3.0)) == pytest.approx(0.5)


def test_attacks_on_synthetic_scores_with_known_separation():
    rng = np.random.default_rng(0)
    n = 20000
    members, nonmembers = rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n)
    # N(1, 1) vs N(0, 1): AUROC = Phi(1 / sqrt(2)), best advantage 2 Phi(1/2) - 1
    auroc, advantage = norm.cdf(1 / math.sqrt(2)), 2 * norm.cdf(0.5) - 1
    result = membership.loss_threshold_attack(-members, -nonmembers)
    assert result.auroc == pytest.approx(auroc, abs=0.01)
    assert result.advantage == pytest.approx(advantage, abs=0.02)
    lr = membership.logistic_regression_attack(members[:, None], nonmembers[:, None])
    assert lr.auroc == pytest.approx(auroc, abs=0.015)
    assert lr.n_members == n // 2
    # random scores and features: no signal
    noise = membership.loss_threshold_attack(rng.random(2000), rng.random(2000))
    assert abs(noise.auroc - 0.5) < 0.04
    random_features = membership.logistic_regression_attack(
        rng.normal(size=(2000, 4)), rng.normal(size=(2000, 4))
    )
    assert abs(random_features.auroc - 0.5) < 0.05


def test_membership_inference_detects_an_overfit_model_not_the_dp_one(digits, trained):
    tf.keras.utils.set_random_seed(0)
    x_in, y_in = digits.x_train[:50], digits.y_train[:50]
    baseline = tf.keras.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(8, 8, 1)),
            tf.keras.layers.Dense(256, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    baseline.compile(
        optimizer=tf.keras.optimizers.Adam(0.01),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    logged = []
    metrics = membership.PrivacyMetrics(
        (x_in, y_in, digits.x_test, digits.y_test), log_fn=logged.append, by_class=False
    )
    baseline.fit(x_in, y_in, batch_size=50, epochs=200, verbose=0, callbacks=[metrics])
    overfit = logged[0]["mia_auc_entire_dataset"]
    assert overfit > 0.7, metrics.attack_results.format()
    assert metrics.attack_results.result("logistic regression").auroc > 0.6
    model, x, y = trained
    dp = membership.membership_inference(model, x, y, digits.x_test, digits.y_test).summary()
    assert dp["mia_auc_entire_dataset"] < overfit - 0.1


# ---------------------------------------------------------------------------- diagnostics
def test_per_example_gradients_match_one_example_at_a_time(digits):
    tf.keras.utils.set_random_seed(0)
    model, x, y = _digits_cnn(digits)
    model.build((None, 8, 8, 1))
    grads = diagnostics.per_example_gradients(model, x[:4], y[:4])
    for i in range(4):
        with tf.GradientTape() as tape:
            loss = model.loss.call(tf.constant(y[i : i + 1]), model(x[i : i + 1], training=True))
        for g, ref in zip(grads, tape.gradient(loss, model.trainable_variables)):
            np.testing.assert_allclose(g[i].numpy(), ref.numpy(), rtol=1e-4, atol=1e-6)


def test_signal_to_noise_callbacks(digits, tmp_path):
    tf.keras.utils.set_random_seed(0)
    model, x, y = _digits_cnn(digits, sigma=2.0)
    logged = []
    average = diagnostics.SignaltoNoiseAverage((x[:32], y[:32]), log_fn=logged.append)
    histogram = diagnostics.SignaltoNoiseHistogram((x[:32], y[:32]))
    history = model.fit(x, y, batch_size=512, epochs=2, verbose=0, callbacks=[average, histogram])
    for key in ("gradient_to_bound_mean", "gradient_to_bound_max", "signal_to_noise"):
        assert len(history.history[key]) == 2
    assert 0 < max(history.history["gradient_to_bound_max"]) <= 1 + 1e-5
    stats = average.history[-1]
    deltas = compute_gradient_bounds(model)
    total = math.sqrt(sum(float(d) ** 2 for d in deltas.values()))
    for s in stats:
        assert s.name in deltas
        assert s.noise_std == pytest.approx(2.0 * total)
        assert s.expected_noise_norm == pytest.approx(2.0 * total * math.sqrt(s.dim))
        assert s.signal_to_noise == pytest.approx(s.mean_gradient_norm / s.expected_noise_norm)
        assert len(s.ratios) == 32 and 0 < s.max_ratio <= 1 + 1e-5
    assert f"{stats[0].name}/signal_to_noise" in logged[-1]
    for name, figure in [("avg", average.plot()), ("hist", histogram.plot())]:
        figure.savefig(tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_per_layer_noise_in_signal_to_noise():
    model = _vector_model([L.DP_QuickSpectralDense(5, nm_coef=2.0)])
    model.dp_parameters = DPParameters("per-layer", 1.5, 1e-5)
    x = np.ones((8, 6), "float32")
    y = np.eye(5, dtype="float32")[np.arange(8) % 5]
    (stat,) = diagnostics.gradient_statistics(model, x, y)
    (delta,) = compute_gradient_bounds(model).values()
    assert stat.noise_std == pytest.approx(1.5 * 2.0 * float(delta))


def test_sensitivity_audit_passes_on_shipped_layers(digits):
    tf.keras.utils.set_random_seed(0)
    model, x, y = _digits_cnn(digits)
    audit = diagnostics.SensitivityAudit((x[:32], y[:32]), raise_on_violation=True)
    history = model.fit(x, y, batch_size=512, epochs=2, verbose=0, callbacks=[audit])
    assert history.history["audit_violations"] == [0, 0]
    report = audit.reports[-1]
    assert report.ok and 0 < report.max_gradient_ratio <= 1
    assert len(report.operator_norms) == 2 and report.max_operator_norm_ratio <= 1 + 1e-5


class HalfBoundDense(L.DP_QuickSpectralDense):
    """Deliberately broken: declares half of the true parameter bound."""

    def backpropagate_params(self, input_bound, gradient_bound):
        return 0.5 * super().backpropagate_params(input_bound, gradient_bound)


def _tight_batch(model, n=8, dim=6, upper_bound=3.0):
    """Inputs beyond the bound (clipped to norm exactly B) labelled with their least
    likely class: ||dL/dW|| = B ||softmax - y|| >= B sqrt(4/5), i.e. > 0.63 x the true
    bound B sqrt(2), > 1.26 x the broken one."""
    x = np.random.default_rng(0).normal(size=(n, dim)).astype("float32")
    x *= 2 * upper_bound / np.linalg.norm(x, axis=1, keepdims=True)
    y = np.eye(5, dtype="float32")[np.argmin(model(x).numpy(), axis=1)]
    return x, y


def test_sensitivity_audit_catches_a_broken_bound(caplog):
    model = _vector_model([HalfBoundDense(5)])
    x, y = _tight_batch(model)
    audit = diagnostics.SensitivityAudit((x, y))
    with caplog.at_level(logging.WARNING, logger="lipdp.evaluation.diagnostics"):
        history = model.fit(
            np.tile(x, (4, 1)), np.tile(y, (4, 1)), batch_size=8, verbose=0, callbacks=[audit]
        )
    assert history.history["audit_violations"] == [1]
    report = audit.reports[0]
    (name,) = [n for n, r in report.gradient_ratios.items() if r > 1]
    assert name.startswith("half_bound_dense")
    assert report.max_gradient_ratio > 1.2
    assert "violation" in caplog.text
    strict = diagnostics.SensitivityAudit((x, y), raise_on_violation=True)
    with pytest.raises(SensitivityViolation, match="half_bound_dense"):
        model.fit(
            np.tile(x, (4, 1)), np.tile(y, (4, 1)), batch_size=8, verbose=0, callbacks=[strict]
        )
    # the correct layer on the same tight batch: no violation
    sound = _vector_model([L.DP_QuickSpectralDense(5)])
    x, y = _tight_batch(sound)
    audit = diagnostics.SensitivityAudit((x, y), raise_on_violation=True)
    audit.set_model(sound)
    report = audit.run()
    assert report.ok and 0.6 < report.max_gradient_ratio <= 1 + 1e-5


def test_sensitivity_audit_catches_a_kernel_outside_its_constraint(digits):
    tf.keras.utils.set_random_seed(0)
    model, x, y = _digits_cnn(digits)
    model.build((None, 8, 8, 1))
    dense = model.dp_layers[-1]
    dense.kernel.assign(2.0 * dense.kernel)  # bypasses the projection
    audit = diagnostics.SensitivityAudit((x[:16], y[:16]))
    audit.set_model(model)
    logs = {}
    audit.on_epoch_end(0, logs)
    assert logs["audit_violations"] >= 1
    assert logs["audit_operator_norm_ratio"] == pytest.approx(2.0, rel=1e-4)
    strict = diagnostics.SensitivityAudit((x[:16], y[:16]), raise_on_violation=True)
    strict.set_model(model)
    with pytest.raises(SensitivityViolation) as error:
        strict.on_epoch_end(0, {})
    assert [r.name for r in error.value.records] == [dense.name]


# ---------------------------------------------------------------------------------- CLI
def test_cli_evaluate_trains_saves_and_loads(tmp_path, capsys):
    path = tmp_path / "model.keras"
    argv = ["evaluate", "--epochs", "2", "--quiet", "--radii", "0", "0.1", "--bins", "10"]
    assert main([*argv, "--save", str(path)]) == 0
    trained_output = capsys.readouterr().out
    for text in ("epsilon", "test accuracy", "certified accuracy", "ECE", "AUROC"):
        assert text in trained_output
    assert main(["evaluate", "--model", str(path), "--radii", "0", "0.1", "--bins", "10"]) == 0
    loaded_output = capsys.readouterr().out
    tail = trained_output[trained_output.index("test accuracy") :]
    assert loaded_output[loaded_output.index("test accuracy") :] == tail
