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
from lipdp.clipped.per_example import per_example_gradients
from lipdp.core.report import privacy_report
from lipdp.foundation.metadata import DatasetMetadata
from tests.marks import representatives
from tests.remove_one import TOLERANCE, released_gradient, remove_one_ratios

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


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"delta": 0.5},
            r"delta 0.5 >= 1/N = 0.0156 \(N = 64 training examples\).*allow_large_delta",
        ),
        ({"delta": 1 / N}, "delta 0.015625 >= 1/N"),
        ({"epsilon": 0.0}, "epsilon must be"),
    ],
    ids=["delta-half", "delta-one-over-n", "epsilon-zero"],
)
def test_a_guarantee_that_protects_no_one_is_refused_with_one_line(options, message):
    """delta >= 1/N is met by publishing one record at random (issue 40: delta = 0.5 was
    accepted); the messages name make_private's own arguments."""
    arguments = {"epsilon": TARGET, "delta": DELTA, **options}
    with pytest.raises(ValueError, match=message) as error:
        lipdp.make_private(
            _clipped_layers(), epochs=EPOCHS, batch_size=B, dataset_size=N, **arguments
        )
    assert "\n" not in str(error.value)


def test_a_large_delta_is_kept_when_forced_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        model = lipdp.make_private(
            _clipped_layers(), epsilon=TARGET, delta=0.5, epochs=EPOCHS, batch_size=B,
            dataset_size=N, allow_large_delta=True,
        )  # fmt: skip
    assert model.dp_parameters.delta == 0.5
    assert "delta = 0.5 >= 1/N" in caplog.text


def test_batches_of_another_data_set_size_are_refused(rng):
    model = _make([L.Dense(K, input_shape=(D,))])
    x, y = _data(rng)
    with pytest.raises(ValueError, match="made private for dataset_size=64"):
        lipdp.private_batches(model, x[:32], y[:32])


class _Subclassed(tf.keras.Model):
    """A model written by subclassing: it declares no input and learns its shape when built."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = L.Dense(5, activation="tanh")
        self.head = L.Dense(K)

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def _subclassed():
    model = _Subclassed(name="subclassed")
    model(np.zeros((1, D), "float32"))  # built by a first call, as a user's is
    return model


def _several_inputs():
    values, extra = tf.keras.Input((D - 2,), name="values"), tf.keras.Input((2,), name="extra")
    hidden = L.Dense(5, activation="tanh")(values)
    outputs = L.Dense(K)(L.Concatenate()([hidden, extra]))
    return tf.keras.Model([values, extra], outputs, name="several_inputs")


#: name -> (the user's model, its inputs from the (N, D) records).
USER_MODELS = {
    "subclassed": (_subclassed, lambda x: x),
    "several-inputs": (_several_inputs, lambda x: (x[:, : D - 2], x[:, D - 2 :])),
}


def _naive_sq_norms(model, x, y):
    """One tape per row: ``[rows, weighted layers]`` squared norms (float64)."""
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    result = []
    for i in range(len(y)):
        row = tf.nest.map_structure(lambda a, i=i: a[i : i + 1], x)
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(y[i : i + 1], model(row, training=True))
        norms = []
        for layer in model.weighted_layers():
            grads = tape.gradient(loss, layer.trainable_variables)
            norms.append(sum(np.sum(g.numpy().astype("float64") ** 2) for g in grads))
        result.append(norms)
    return np.array(result)


@pytest.mark.parametrize("kind", representatives(USER_MODELS, default={"several-inputs"}))
def test_a_subclassed_model_or_one_of_several_inputs_trains_exactly(kind, rng):
    """Nested as one layer (the fallback): per-example norms equal one tape per row; a
    real step moves by the clip norm when a row is removed (every row clipped); Poisson
    batches of its inputs train the planned steps."""
    build, inputs_of = USER_MODELS[kind]
    model = _make(build(), clip_norm=1e-3)
    model.compile(optimizer="sgd", loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
    metadata = model.dataset_metadata
    assert DatasetMetadata.from_config(metadata.to_config()) == metadata  # saved as it is
    records, y = _data(rng)
    x = inputs_of(records)
    batch_x, batch_y = tf.nest.map_structure(lambda a: a[:B], x), y[:B]
    facts = per_example_gradients(
        model,
        tf.nest.map_structure(tf.constant, batch_x),
        lambda y_pred: model.per_example_losses(batch_y, y_pred),
    )
    ours = np.stack([sq.numpy() for sq in facts.sq_norms], axis=1)
    np.testing.assert_allclose(ours, _naive_sq_norms(model, batch_x, batch_y), rtol=1e-4)
    ratios = remove_one_ratios(model, batch_x, batch_y, rows=[0, 5])
    assert 0.99 < ratios.min() and ratios.max() <= 1 + TOLERANCE
    model.fit(lipdp.private_batches(model, x, y), epochs=1, verbose=0)
    assert int(model.noisy_steps.numpy()) == N // B
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)  # the arrays, Poisson-sampled by fit
    assert int(model.noisy_steps.numpy()) == 2 * (N // B)


def test_a_non_finite_value_in_a_second_input_is_counted_and_contributes_nothing(rng):
    """Rule S9 reads every input: the row is counted and left out of the release."""
    model = _make(_several_inputs(), clip_norm=1e-3)
    model.compile(optimizer="sgd", loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
    records, y = _data(rng)
    values, extra = (a[:B].copy() for a in USER_MODELS["several-inputs"][1](records))
    extra[2, 0] = np.nan
    logs = model.train_on_batch((values, extra), y[:B], return_dict=True)
    assert logs["non_finite_examples"] == 1 and np.isfinite(logs["loss"])
    keep = np.arange(B) != 2
    released = released_gradient(model, (values, extra), y[:B])
    without = released_gradient(model, (values[keep], extra[keep]), y[:B][keep])
    for ours, expected in zip(released, without):
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-7)


def test_a_private_model_or_a_model_without_an_input_shape_is_refused_with_one_line():
    clipped = _make(_clipped_layers())
    clipless = _make(_clipless_layers(), input_bound=2.0)
    for private in (clipped, clipless):
        with pytest.raises(ValueError, match="is already private .*compile and fit it") as error:
            _make(private)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="has no input shape .*call it once on a batch") as error:
        _make(_Subclassed(name="never_called"))
    assert "\n" not in str(error.value)
