"""Rule S10: the privacy ledger -- epsilon never decreases as training goes on.

A model's epsilon is the composition of what it released (:mod:`lipdp.core.ledger`), not of
what its current configuration would release. The reference here is independent of
lipdp's accounting: the test knows the configurations it trained with, derives each
step's effective noise multiplier by hand and composes the segments with
``dp_accounting``'s own PLD accountant.
"""

import math
from dataclasses import replace

import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant

from lipdp.accounting import get_eps_delta
from lipdp.accounting.mechanisms import Laplace, SubsampledGaussian
from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.ledger import CAPACITY, KINDS, PrivacyLedger, placement, release_row, step_row
from lipdp.core.report import privacy_report
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.pipeline import poisson_batches
from tests.ledger_cases import expected_after, ledger_cases, same_bits
from tests.marks import representatives
from tests.resume_scenarios import (
    CHANGES,
    EPOCHS,
    FIRST,
    INTERRUPTED_AFTER,
    Interrupt,
    composed,
    ran,
    segment,
)

D, K, N, DELTA = 6, 3, 64, 1e-5
FAMILIES = ("clipless", "dp-sgd")


def _metadata(batch_size):
    return DatasetMetadata(
        input_shape=(D,),
        nb_classes=K,
        nb_samples_train=N,
        batch_size=batch_size,
        sampling="poisson",
    )


def _build(family, sigma, batch_size=8):
    """Three weighted layers, per-layer noise: one Gaussian per variable (clipless, no
    biases) or per layer (DP-SGD, per-layer clipping)."""
    params = DPParameters("per-layer", sigma, DELTA)
    if family == "clipless":
        model = DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0),
                L.DP_SpectralDense(8),
                L.DP_GroupSort(2),
                L.DP_SpectralDense(8),
                L.DP_GroupSort(2),
                L.DP_SpectralDense(K),
            ],
            dp_parameters=params,
            dataset_metadata=_metadata(batch_size),
        )
    else:
        model = DPSGD_Sequential(
            [
                tf.keras.layers.Dense(8, activation="tanh", input_shape=(D,)),
                tf.keras.layers.Dense(8, activation="tanh"),
                tf.keras.layers.Dense(K),
            ],
            dp_parameters=params,
            clipping=Clipping("per-layer", 1.0),
            dataset_metadata=_metadata(batch_size),
        )
    _compile(model)
    return model


def _compile(model):
    loss = (
        losses.DP_TauCategoricalCrossentropy(4.0)
        if isinstance(model, DP_Sequential)
        else tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    )
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.05))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, N)]
    return x, y


def _fit(model, epochs=1):
    meta = model.dataset_metadata
    batches = poisson_batches(*_data(), meta.sampling_rate, meta.nb_steps_per_epochs, seed=1)
    history = model.fit(
        batches, epochs=epochs, verbose=0, callbacks=[DP_Accountant(accountant="pld")]
    )
    return history.history["epsilon"]


def _gaussians(model):
    """Gaussian mechanisms of one step under per-layer noise, counted by hand: one per
    trainable variable (clipless) or per layer with trainable variables (DP-SGD)."""
    if isinstance(model, DP_Sequential):
        return len(model.trainable_variables)
    return sum(1 for layer in model.dp_layers if layer.trainable_variables)


class _ReferenceEpsilon:
    """The composition of the segments ``(sigma, gaussians, q, steps)`` seen so far;
    per-layer noise of ``gaussians`` equal multipliers ``sigma`` is one Gaussian of
    ``sigma / sqrt(gaussians)``. Each segment is composed once, in order (the same
    result as composing the whole list afresh, without re-discretising every prefix)."""

    def __init__(self):
        self.accountant = PLDAccountant(value_discretization_interval=1e-4)

    def add(self, sigma, gaussians, q, steps):
        event = dp_event.PoissonSampledDpEvent(
            q, dp_event.GaussianDpEvent(sigma / math.sqrt(gaussians))
        )
        self.accountant.compose(event, steps)
        return self.accountant.get_epsilon(DELTA)


@pytest.mark.parametrize(
    "family",
    # The clipless run takes ~40 s (seven traced steps, projections): make test-slow.
    [pytest.param("clipless", marks=pytest.mark.slow), "dp-sgd"],
)
def test_epsilon_never_decreases_through_changes_reloads_and_rebuilds(family, tmp_path):
    """Three epochs, layers frozen, unfrozen with a new batch size, saved and reloaded,
    then the weights and the ledger loaded into a model rebuilt with another sigma: the
    logged epsilon never decreases and always equals the composition of the segments."""
    model = _build(family, 2.0)
    segments, logged, reference = [], [], _ReferenceEpsilon()

    def run(model, epochs=1):
        meta = model.dataset_metadata
        logged.extend(_fit(model, epochs))
        sigma = model.dp_parameters.noise_multiplier
        segments.append(
            (sigma, _gaussians(model), meta.sampling_rate, epochs * meta.nb_steps_per_epochs)
        )
        assert logged[-1] == pytest.approx(reference.add(*segments[-1]), rel=1e-6)

    run(model, epochs=3)
    weighted = [layer for layer in model.dp_layers if layer.trainable_variables]
    for layer in weighted[:2]:  # fine-tuning the last layer only
        layer.trainable = False
    _compile(model)
    run(model)
    for layer in model.dp_layers:
        layer.trainable = True
    model.dataset_metadata = _metadata(16)
    _compile(model)
    run(model)
    path = tmp_path / "model.keras"
    model.save(path)
    model = tf.keras.models.load_model(path)
    run(model)
    weights = str(tmp_path / "model.weights.h5")  # the weights format of Keras 2.13+ and 3
    model.save_weights(weights)
    rebuilt = _build(family, 3.0, batch_size=16)
    rebuilt.load_weights(weights)
    run(rebuilt)
    assert all(b >= a for a, b in zip(logged, logged[1:])), logged
    # The freeze: fewer Gaussians per step (a larger effective sigma), yet no decrease.
    assert logged[3] > logged[2]
    report = privacy_report(rebuilt, accountant="pld")
    assert report.epsilon == pytest.approx(logged[-1], rel=1e-12)
    assert len(report.released) == 4  # 3 layers, 1 layer, b = 16, sigma = 3
    assert int(rebuilt.noisy_steps.numpy()) == sum(steps for *_, steps in segments)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_records_the_mechanism_it_was_traced_with(family):
    """The ledger holds what ran, on every path: train_on_batch and a custom loop that
    calls train_step in its own tf.function."""
    model = _build(family, 2.0)
    x, y = _data()
    model.train_on_batch(x[:8], y[:8])
    step = tf.function(model.train_step)
    step((tf.constant(x[:8]), tf.constant(y[:8])))
    step((tf.constant(x[8:16]), tf.constant(y[8:16])))
    (entry,) = model.privacy_ledger.entries()
    assert entry.count == 3 and entry.gaussians == _gaussians(model)
    assert entry.mechanism.sampling_rate == 8 / N
    by_hand = 2.0 / math.sqrt(_gaussians(model))
    assert entry.mechanism.noise_multiplier == pytest.approx(by_hand, rel=1e-15)
    # The same float as the plan's step: the two compose as one mechanism.
    assert entry.mechanism == model.privacy_plan().releases[0].mechanism


def test_epsilon_of_a_fresh_run_is_the_plan_before_training():
    """Nothing changed: the ledger's epsilon is, to the last bit, the plan made before
    training (rule S11), and planning more epochs adds only the remaining steps."""
    model = _build("dp-sgd", 2.0)
    before = [get_eps_delta(model, e)[0] for e in (1, 2, 3)]
    _fit(model, 2)
    assert get_eps_delta(model, 2)[0] == before[1]
    assert get_eps_delta(model, 3)[0] == before[2]
    assert get_eps_delta(model, 1)[0] == before[1]  # never below what was spent
    assert get_eps_delta(model, 0)[0] == before[1]


def test_non_private_steps_make_epsilon_infinite_for_good():
    model = _build("dp-sgd", 2.0)
    model.dp_parameters = DPParameters("per-layer", 0.0, DELTA, non_private=True)
    x, y = _data()
    model.train_on_batch(x[:8], y[:8])
    model.dp_parameters = DPParameters("per-layer", 2.0, DELTA)
    assert get_eps_delta(model, 1)[0] == math.inf


def test_a_full_ledger_merges_into_a_dominating_row():
    """Past capacity, new mechanisms go to their kind's overflow row, which keeps the
    smallest sigma and the largest rate seen there (an over-estimate)."""
    ledger = PrivacyLedger(*PrivacyLedger.create_variables())
    regular = CAPACITY - len(KINDS)
    for k in range(regular):
        ledger.record(step_row(1.0 + k, 8, 64, True, 1))
    ledger.record(step_row(0.5, 8, 128, True, 1), count=5)
    ledger.record(step_row(3.0, 16, 64, True, 1), count=2)
    ledger.record(step_row(1.0, 8, 64, True, 1), count=4)  # has its own row: added there
    ledger.record(release_row(Laplace(0.2)))
    entries = ledger.entries()
    assert len(entries) == regular + 2
    assert entries[0].count == 5
    overflow = entries[-2]
    assert overflow.merged and overflow.count == 7
    assert overflow.mechanism == SubsampledGaussian(0.5, 16 / 64)
    assert entries[-1].mechanism == Laplace(0.2) and not entries[-1].merged


def test_placement_is_the_rule_record_applies():
    """``placement`` (numpy, the JAX step's ledger) puts every row where ``record`` (in
    TensorFlow) puts it and writes the same values: own rows, empty rows, overflow merges."""
    ledger = PrivacyLedger(*PrivacyLedger.create_variables())
    rows = [step_row(1.0 + k, 8, 64, True, 1) for k in range(CAPACITY - len(KINDS))]
    rows += [step_row(0.5, 8, 128, True, 1), step_row(3.0, 16, 64, False, 2, True)]
    rows += [step_row(2.0, 8, 64, True, 1), release_row(Laplace(0.2)), release_row(Laplace(0.9))]
    for row in rows:
        table = ledger.table.numpy()
        index, written = placement(table, row)
        counts = ledger.counts.numpy()
        ledger.record(row)
        changed = np.flatnonzero(ledger.counts.numpy() != counts)
        assert changed.tolist() == [index]
        np.testing.assert_array_equal(ledger.table.numpy()[index], written)


def test_record_placement_and_the_jax_step_place_a_run_alike():
    """The three implementations of the placement rule -- ``record`` (TensorFlow, float64),
    ``placement`` (numpy) and the JAX step's ``recorded`` (int32 words, eager here; under
    ``jit`` in tests/clipped/jax/test_ledger_words.py) -- put a run in the same row and write the
    same bits there, on empty, random (with holes), full and overflowing tables of every
    kind (tests/ledger_cases.py). TensorFlow's CPU kernels flush denormal float64 values to
    zero (no ledger holds one: ``q = b / N`` is far above, and a sigma that small is a
    non-private step), so it is compared on tables without them; numpy and JAX on both."""
    jnp = pytest.importorskip("jax.numpy")
    from lipdp.clipped.jax.ledger import Float64Words, recorded

    ledger = PrivacyLedger(*PrivacyLedger.create_variables())
    normal = [(case, True) for case in ledger_cases(seed=2, denormals=False)]
    for (name, table, counts, row), with_tf in normal + [(c, False) for c in ledger_cases(3)]:
        index, written = placement(table, row)
        want_table, want_counts = expected_after(table, counts, row, index, written)
        words, runs = recorded(
            jnp.asarray(Float64Words.words(table)), jnp.asarray(counts, jnp.int32), row
        )
        got = np.ascontiguousarray(np.asarray(words)).view(np.float64)
        assert same_bits(got, want_table), name
        np.testing.assert_array_equal(np.asarray(runs), want_counts, err_msg=name)
        if with_tf:
            ledger.table.assign(table)
            ledger.counts.assign(counts)
            ledger.record(row)
            assert same_bits(ledger.table.numpy(), want_table), name
            np.testing.assert_array_equal(ledger.counts.numpy(), want_counts, err_msg=name)


def test_dynamic_clipping_releases_are_recorded_as_they_happen():
    from lipdp.clipless.dynamic import LaplaceAdaptiveLossGradientClipping

    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    callback = LaplaceAdaptiveLossGradientClipping(ds, patience=1, epsilon=0.3)
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0),
            L.DP_SpectralDense(K),
            L.DP_ClipGradient(1.0, mode="dynamic"),
        ],
        dp_parameters=DPParameters("global", 2.0, DELTA, dynamic_clipping=callback),
        dataset_metadata=_metadata(8),
    )
    _compile(model)
    meta = model.dataset_metadata
    batches = poisson_batches(x, y, meta.sampling_rate, meta.nb_steps_per_epochs, seed=1)
    # The accountant before the callback: it still reports this epoch's release.
    history = model.fit(batches, epochs=2, verbose=0, callbacks=[DP_Accountant(), callback])
    labels = {e.label: e.count for e in model.privacy_ledger.entries()}
    assert labels == {"noisy gradient steps": 16, "dynamic clipping (laplace)": 2}
    assert history.history["epsilon"][-1] == get_eps_delta(model, 2)[0]
    fresh_plan = replace(model.privacy_plan(), spent=(), spent_counts=(), steps_done=None)
    assert history.history["epsilon"][-1] == fresh_plan.epsilon(2)


def test_a_model_with_every_layer_frozen_is_refused_with_the_fix():
    model = _build("dp-sgd", 2.0)
    model.trainable = False
    _compile(model)
    x, y = _data()
    with pytest.raises(ValueError, match="no trainable variables"):
        model.train_on_batch(x[:8], y[:8])


# --------------------------------------------------- resumes into another configuration
# The scenarios of tests/clipped/jax/test_resume.py, on TensorFlow: a restored ledger (Keras'
# BackupAndRestore, load_weights, set_weights from a callback between two epochs) is never
# re-priced by the steps that follow. The reference epsilon is composed from the segments
# the test ran, written by hand, with lipdp's RDP accountant.


class _AtEpoch1(tf.keras.callbacks.Callback):
    """Calls ``action(model)`` at the beginning of the second epoch."""

    def __init__(self, action):
        super().__init__()
        self.action = action

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.action(self.model)


def _configured(sigma, batch_size, n, seed=0):
    tf.keras.utils.set_random_seed(seed)
    metadata = DatasetMetadata(
        input_shape=(D,), nb_classes=K, nb_samples_train=n, batch_size=batch_size,
        sampling="poisson",
    )  # fmt: skip
    model = DPSGD_Sequential(
        [tf.keras.layers.Dense(8, activation="tanh", input_shape=(D,)), tf.keras.layers.Dense(K)],
        dp_parameters=DPParameters("global", sigma, DELTA),
        dataset_metadata=metadata,
    )
    _compile(model)
    return model


def _run(model, epochs, callbacks=()):
    meta = model.dataset_metadata
    rng = np.random.default_rng(meta.nb_samples_train)
    x = rng.normal(size=(meta.nb_samples_train, D)).astype("float32")
    y = np.eye(K, dtype="float32")[rng.integers(0, K, meta.nb_samples_train)]
    batches = poisson_batches(x, y, meta.sampling_rate, meta.nb_steps_per_epochs, seed=1)
    return model.fit(batches, epochs=epochs, verbose=0, callbacks=list(callbacks))


@pytest.mark.parametrize("change", representatives(CHANGES, default={"sigma"}))
def test_backup_and_restore_into_another_configuration_keeps_the_past_prices(tmp_path, change):
    """Two epochs at sigma 1 (b 8, N 32), interrupted; resumed by BackupAndRestore into a
    model of another sigma, b or N: the ledger lists both segments with their counts and
    the logged epsilon is their composition."""
    backup = str(tmp_path / "backup")
    first = _configured(**FIRST)
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(first, EPOCHS, [tf.keras.callbacks.BackupAndRestore(backup), Interrupt(2)])
    done = INTERRUPTED_AFTER * 4
    config = CHANGES[change]
    resumed = _configured(**config, seed=1)
    history = _run(resumed, EPOCHS, [tf.keras.callbacks.BackupAndRestore(backup), DP_Accountant()])
    steps = (EPOCHS - INTERRUPTED_AFTER) * resumed.dataset_metadata.nb_steps_per_epochs
    expected = [segment(FIRST, done), segment(config, steps)]
    assert ran(resumed) == expected
    assert int(resumed.noisy_steps.numpy()) == done + steps
    assert history.history["epsilon"][-1] == composed(expected, DELTA)


def test_loading_an_older_checkpoint_between_and_during_fits_keeps_the_past_prices(tmp_path):
    """A checkpoint of a model trained at sigma 1 is loaded into a model that has trained
    at sigma 2 since: between two fits, and from a callback between two epochs of a fit.
    Then weights set from a callback. Every step keeps its own price."""
    old = _configured(**FIRST)
    _run(old, 1)
    checkpoint = str(tmp_path / "old.weights.h5")
    old.save_weights(checkpoint)
    at_sigma_1 = segment(FIRST, 4)
    config = CHANGES["sigma"]

    model = _configured(**config, seed=1)
    _run(model, 1)
    model.load_weights(checkpoint)  # between fits
    _run(model, 1)
    assert ran(model) == [at_sigma_1, segment(config, 8)]

    other = _configured(**config, seed=2)
    _run(other, 1)
    history = _run(other, 2, [_AtEpoch1(lambda m: m.load_weights(checkpoint)), DP_Accountant()])
    expected = [at_sigma_1, segment(config, 12)]
    assert ran(other) == expected
    assert history.history["epsilon"][-1] == composed(expected, DELTA)

    weights = old.get_weights()
    third = _configured(**config, seed=3)
    _run(third, 2, [_AtEpoch1(lambda m: m.set_weights(weights))])
    assert ran(third) == [at_sigma_1, segment(config, 8)]
