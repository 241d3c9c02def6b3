"""Logical batches computed in physical micro-batches (``physical_batch_size=P``, issue 39),
on every backend (tests/backends/conftest.py): the default suite runs them on TensorFlow,
``make test-jax`` on JAX.

* the step on micro-batches of ``P`` rows releases the gradient of the whole logical batch
  (noise-free: the sum in another order of additions; with identical noise: the same
  release), for ``P`` dividing the batch or not, ``P = 1``, ``P`` at or above the batch;
* one logical step is one noisy step in the ledger, billed as the step without ``P``;
* remove-one (rule S1) on the accumulated step: the release moves by at most ``Delta``,
  random and hostile records;
* Keras' ``gradient_accumulation_steps`` (noise per micro-batch) is refused;
* the option is in the configuration and checked."""

import dataclasses

import keras
import numpy as np
import pytest

from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation import compat
from tests.backends import harness as h
from tests.marks import representatives

LIMIT = 1.0 + ROUNDOFF_SLACK
FAMILIES = h.FAMILIES


def noiseless(model):
    """``model`` as a non-private reference run: its step releases the averaged gradient
    itself (times the learning rate 1), so that two steps compare without noise."""
    parameters = dataclasses.replace(model.dp_parameters, noise_multiplier=0.0, non_private=True)
    model.dp_parameters = parameters
    return model


def relative_gap(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("family", FAMILIES)
# By default 5 (full micro-batches and a ragged last one) and 64 (one pass); the other
# sizes run the same two paths (thorough).
@pytest.mark.parametrize("size", representatives([1, 5, 36, 37, 64], default={5, 64}))
def test_micro_batches_release_the_gradient_of_the_logical_batch(family, size):
    """37 rows: micro-batches of 1, 5 (7 full and one of 2), 36 (one of 1 left), 37 and
    64 (one pass)."""
    x, y = h.data(37, seed=4)
    whole = h.released(noiseless(h.without_projection(h.private(family))), x, y)
    model = noiseless(h.without_projection(h.private(family, physical_batch_size=size)))
    parts = h.released(model, x, y)
    assert np.linalg.norm(whole) > 1e-3
    assert relative_gap(whole, parts) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_8192_rows_in_micro_batches_of_512_release_what_the_whole_batch_does(family):
    """The issue's case: one logical step of 8192 rows, at once or 512 rows at a time,
    identical noise: the same release (1e-5 relative), the gradient alone included."""
    options = {"batch_size": 8192, "dataset_size": 2**16}
    x, y = h.data(8192, seed=5)
    for make in (noiseless, lambda model: model):  # the gradient, then the noisy release
        whole = h.released(make(h.without_projection(h.private(family, **options))), x, y)
        model = make(h.without_projection(h.private(family, physical_batch_size=512, **options)))
        assert relative_gap(whole, h.released(model, x, y)) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_a_logical_step_is_billed_once_as_without_micro_batches(family):
    x, y = h.data(21, seed=6)
    whole, parts = h.private(family), h.private(family, physical_batch_size=4)
    for model in (whole, parts):
        model.train_on_batch(x, y)
    assert int(parts.noisy_steps.numpy()) == 1
    for billed, expected in zip(parts.privacy_ledger.snapshot(), whole.privacy_ledger.snapshot()):
        np.testing.assert_array_equal(np.asarray(billed), np.asarray(expected))
    assert parts.privacy_plan().epsilon(2) == whole.privacy_plan().epsilon(2)


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_a_record_moves_the_accumulated_release_within_its_sensitivity(family):
    x, y = h.data(11, seed=7)
    ratios = h.remove_one_ratios(family, x, y, rows=(0, 4, 10), physical_batch_size=3)
    assert max(ratios) <= LIMIT, ratios
    assert min(ratios) > 1e-3, ratios


@pytest.mark.parametrize("family", FAMILIES)
def test_hostile_records_in_micro_batches_move_the_release_within_its_sensitivity(family):
    scales = [1.0, 3.0, 1e-30, 1e30, np.nan, np.inf, 0.0, 0.5]
    x, y = h.data(len(scales), seed=8, scales=scales)
    ratios = h.remove_one_ratios(family, x, y, rows=range(2, 7), physical_batch_size=3)
    assert max(ratios) <= LIMIT, ratios


@pytest.mark.parametrize("family", FAMILIES)
def test_keras_gradient_accumulation_is_refused_for_the_one_argument(family):
    if not compat.keras_3():
        pytest.skip("Keras 2's optimizers have no gradient_accumulation_steps")
    model = h.private(family)
    optimizer = keras.optimizers.SGD(1.0, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="physical_batch_size"):
        model.compile(optimizer=optimizer, loss=h.loss(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_physical_batch_size_is_configured_and_checked(family):
    model = h.private(family, physical_batch_size=5)
    config = model.get_config()
    assert config["physical_batch_size"] == 5
    assert type(model).from_config(config).physical_batch_size == 5
    model.physical_batch_size = None
    assert model.get_config()["physical_batch_size"] is None
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="physical_batch_size must be a positive integer"):
            model.physical_batch_size = bad


@pytest.mark.parametrize("family", FAMILIES)
def test_fit_on_poisson_batches_in_micro_batches_trains_as_the_whole_batches(family):
    """``fit`` on the same Poisson batches (drawn from one seed), identical noise: the
    model computing 3 rows at a time ends where the one computing whole batches does,
    after the same number of noisy steps (the projections of the clipless family run, as
    in training)."""
    from lipdp import private_batches
    from lipdp.core import noise

    x, y = h.data(64, seed=9)
    trained = []
    for size in (None, 3):
        model = h.private(family, physical_batch_size=size)
        noise.use_reproducible_noise(11)
        try:
            model.fit(private_batches(model, x, y, seed=12), epochs=2, verbose=0)
        finally:
            noise.use_reproducible_noise(None)
        trained.append(model)
    whole, parts = trained
    assert int(parts.noisy_steps.numpy()) == int(whole.noisy_steps.numpy()) == 16
    assert relative_gap(h.weights(whole), h.weights(parts)) <= 1e-5
