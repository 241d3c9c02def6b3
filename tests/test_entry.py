"""``lipdp.make_private``: one call, the right family, sigma calibrated for the target.

The calibration is checked against ``dp_accounting`` directly (its RDP accountant in the
default run, its PLD accountant for the minimality of sigma in ``make test-slow``), and
the ``epsilon`` of the model's ledger after the planned epochs is the target from below."""

import math

import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

import lipdp
from lipdp.accounting import calibrate_noise_multiplier
from lipdp.clipless import layers as DL
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential
from lipdp.clipped.model import DPSGD_Sequential
from lipdp.core.report import privacy_report

L = tf.keras.layers
D, K, N, B, EPOCHS, DELTA, TARGET = 6, 3, 64, 16, 2, 1e-5, 3.0
STEPS = EPOCHS * (N // B)


def _data(rng):
    x = rng.normal(size=(N, D)).astype("float32")
    return x, np.eye(K, dtype="float32")[rng.integers(0, K, N)]


def _pld_epsilon(sigma, q, steps, gaussians=1):
    """``gaussians`` equal per-layer Gaussians of multiplier ``sigma``: one of
    ``sigma / sqrt(gaussians)``."""
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    noise = dp_event.GaussianDpEvent(sigma / math.sqrt(gaussians))
    accountant.compose(dp_event.PoissonSampledDpEvent(q, noise), steps)
    return accountant.get_epsilon(DELTA)


def _make(layers, accountant="rdp", **options):
    """The calibration tests use the PLD accountant (the one ``dp_accounting`` checks
    exactly); the others the faster RDP one."""
    return lipdp.make_private(
        layers, epsilon=TARGET, delta=DELTA, epochs=EPOCHS, batch_size=B, dataset_size=N,
        accountant=accountant, **options,
    )  # fmt: skip


def _clipped_layers():
    return [L.Dense(8, activation="relu", input_shape=(D,)), L.Dense(K)]


def _clipless_layers():
    return [
        L.InputLayer((D,)),
        DL.DP_SpectralDense(8, use_bias=False),
        DL.DP_GroupSort(2),
        DL.DP_SpectralDense(K, use_bias=False),
    ]


def _rdp_epsilon(sigma, q, steps):
    """``dp_accounting``'s RDP (exact fractional orders: at most lipdp's autodp-based
    RDP, so a calibration meeting the target there meets it here)."""
    accountant = RdpAccountant()
    noise = dp_event.GaussianDpEvent(sigma)
    accountant.compose(dp_event.PoissonSampledDpEvent(q, noise), steps)
    return accountant.get_epsilon(DELTA)


def test_clipped_model_meets_the_target_and_its_ledger_says_so(rng):
    model = _make(_clipped_layers())
    assert isinstance(model, DPSGD_Sequential)
    assert model.clipping.mode == "flat" and model.clipping.clip_norm == 1.0
    sigma, meta = model.dp_parameters.noise_multiplier, model.dataset_metadata
    assert meta.sampling_rate == B / N and meta.sampling == "poisson"
    assert _rdp_epsilon(sigma, B / N, STEPS) <= TARGET
    # The model's plan is the one computed from the numbers alone.
    assert sigma == calibrate_noise_multiplier(TARGET, EPOCHS, B, N, DELTA)
    model.compile(optimizer="sgd", loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
    model.fit(lipdp.private_batches(model, *_data(rng), seed=0), epochs=EPOCHS, verbose=0)
    assert int(model.noisy_steps.numpy()) == STEPS
    spent = privacy_report(model).epsilon  # from the ledger
    assert TARGET - 0.05 < spent <= TARGET


def test_clipless_layers_get_a_bounded_input_and_per_layer_noise_is_calibrated(rng):
    model = _make(_clipless_layers(), input_bound=2.0, noise="per-layer")
    assert isinstance(model, DP_Sequential)
    assert isinstance(model.dp_layers[0], DL.DP_BoundedInput)
    assert model.dp_layers[0].upper_bound == 2.0
    # Two kernels, two Gaussians of multiplier sigma: one of sigma / sqrt(2).
    single = calibrate_noise_multiplier(TARGET, EPOCHS, B, N, DELTA)
    assert model.dp_parameters.noise_multiplier / math.sqrt(2) == pytest.approx(single, abs=2e-3)
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(tau=4.0))
    model.fit(lipdp.private_batches(model, *_data(rng)), epochs=1, verbose=0)
    assert int(model.noisy_steps.numpy()) == N // B


@pytest.mark.slow  # ~20 s each: PLD calibration by bisection
@pytest.mark.parametrize("family", ["clipped", "clipless"])
def test_sigma_is_the_smallest_meeting_the_target_by_dp_accounting_pld(family):
    """Against ``dp_accounting``'s PLD accountant directly: ``epsilon(sigma) <= target <
    epsilon(sigma - 2 tol)``."""
    if family == "clipped":
        model, gaussians = _make(_clipped_layers(), "pld"), 1
    else:
        model = _make(_clipless_layers(), "pld", input_bound=2.0, noise="per-layer")
        gaussians = 2
    sigma = model.dp_parameters.noise_multiplier
    assert _pld_epsilon(sigma, B / N, STEPS, gaussians) <= TARGET + 1e-9
    assert _pld_epsilon(sigma - 2e-3, B / N, STEPS, gaussians) > TARGET


def test_a_keras_model_is_nested_as_one_layer_and_a_sequential_keeps_its_input(rng):
    inputs = tf.keras.Input((D,))
    outputs = L.Dense(K)(L.Dense(4, activation="tanh")(inputs))
    functional = tf.keras.Model(inputs, outputs, name="user_model")
    model = _make(functional)
    assert model.dp_layers[-1] is functional
    sequential = tf.keras.Sequential([tf.keras.Input((D,)), L.Dense(4), L.Dense(K)])
    assert _make(sequential).dataset_metadata.input_shape == (D,)
    assert _make(sequential).dataset_metadata.nb_classes == K


@pytest.mark.parametrize(
    "layers, options, message",
    [
        ([L.Dense(K)], {}, "has no input shape: give it input_shape"),
        ([DL.DP_BoundedInput(input_shape=(D,), upper_bound=1.0), L.Dense(K)], {},
         "mix lipdp DP layers and ordinary Keras layers"),
        ([L.InputLayer((D,)), DL.DP_SpectralDense(K)], {}, "pass input_bound="),
        ([L.InputLayer((D,)), DL.DP_SpectralDense(K)], {"input_bound": 1.0, "clip_norm": 2.0},
         "clip_norm and clipping are for method='clipped'"),
        ([L.Dense(K, input_shape=(D,))], {"input_bound": 1.0}, "input_bound is for"),
        ([L.Dense(K, input_shape=(D,))], {"method": "lipschitz"}, "method"),
    ],
    ids=["no-input-shape", "mixed", "no-input-bound", "clip-norm-clipless", "bound-clipped",
         "unknown-method"],
)  # fmt: skip
def test_bad_calls_are_refused_with_one_line(layers, options, message):
    with pytest.raises(ValueError, match=message) as error:
        _make(layers, **options)
    assert "\n" not in str(error.value)


def test_batches_of_another_data_set_size_are_refused(rng):
    model = _make([L.Dense(K, input_shape=(D,))])
    x, y = _data(rng)
    with pytest.raises(ValueError, match="made private for dataset_size=64"):
        lipdp.private_batches(model, x[:32], y[:32])
