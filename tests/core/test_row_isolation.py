"""Row isolation (``row_isolation=True``, lipdp.core.isolation; issue 37, item 4b): every
layer lipdp does not own, its activation and the loss run on one row at a time, forward and
backward, and state kept between rows is refused.

* exact: on ordinary models the isolated step releases the batched step's update (same
  noise), and its per-example norms are a naive loop's (one GradientTape per row), a
  layer's own custom gradient included;
* sound by construction: the six couplings of the red team (tests/couplings.py) leak
  without isolation with the probe off (remove-one ratio above 1) and stay within the
  declared sensitivity with it, the probe still off; a running statistic, a write to a
  ``tf.Variable``, a ``tf.py_function`` and an ``add_loss`` of the data are refused; the
  clipless family isolates ``DP_Lambda``;
* an option of both families and of ``make_private`` (the clipless family's default),
  saved with the model and stated in the privacy report.
"""

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.clipless import layers as DL
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.clipped.per_example import per_example_gradients
from lipdp.core import noise
from lipdp.core.isolation import isolated_call
from lipdp.core.parameters import DPParameters
from lipdp.core.report import privacy_report
from lipdp.foundation import compat
from lipdp.foundation.metadata import DatasetMetadata
from tests import couplings
from tests.marks import representatives
from tests.remove_one import TOLERANCE, released_gradient, remove_one_ratios

K = tf.keras.layers
BATCH, CLASSES = 8, 3


@pytest.fixture
def same_noise():
    """Reproducible noise, so that two models' steps draw the same numbers."""
    noise.use_reproducible_noise(37)
    yield
    noise.use_reproducible_noise(None)


# ------------------------------------------------------------------------ models
@tf.keras.utils.register_keras_serializable(package="tests.row_isolation")
class _HalvedCotangent(K.Layer):
    """Identity forward; its own ``tf.custom_gradient`` halves the cotangent (the gradient
    of a pfor-converted graph taken from outside would drop it)."""

    def call(self, inputs):
        @tf.custom_gradient
        def halve(x):
            return tf.identity(x), lambda dy: 0.5 * dy

        return halve(inputs)


def _mlp():
    return [
        compat.input_layer((6,)),
        K.Dense(8, activation="tanh"),
        _HalvedCotangent(),
        K.Dense(8),
        K.ReLU(),
        K.Dense(CLASSES),
    ], (6,)


def _cnn():
    return [
        compat.input_layer((8, 8, 1)),
        K.Conv2D(4, 3, padding="same", activation="tanh"),
        K.MaxPool2D(2),
        K.Conv2D(6, 3, padding="same"),
        K.LayerNormalization(),  # a fallback layer: per-row VJPs
        K.Flatten(),
        K.Dense(CLASSES),
    ], (8, 8, 1)


def _masked():
    return [
        compat.input_layer((7,), dtype="int32"),
        K.Embedding(10, 4, mask_zero=True),
        K.GlobalAveragePooling1D(),  # reads the mask
        K.Dense(CLASSES),
    ], (7,)


def _einsum():
    """A batched matrix product: run as a loop over rows under isolation (oneDNN corrupts
    the heap on its vectorised form on this CPU: a squared norm of 5.6e39, or a crash)."""
    return [
        compat.input_layer((5, 3)),
        K.EinsumDense("btd,de->bte", (5, 2), bias_axes="e"),
        K.Flatten(),
        K.Dense(CLASSES),
    ], (5, 3)


NETS = {"mlp": _mlp, "cnn": _cnn, "masked-embedding": _masked, "einsum": _einsum}


def _clipped(net, isolated, method="ghost", clip=0.5, seed=3):
    tf.keras.utils.set_random_seed(seed)  # before the layers: Keras 3 seeds them when made
    layers, shape = NETS[net]()
    model = DPSGD_Sequential(
        layers,
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", clip),
        dataset_metadata=_metadata(shape),
        gradient_method=method,
        row_isolation=isolated,
    )
    model.compile(
        optimizer=tf.keras.optimizers.SGD(0.1),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _metadata(shape):
    return DatasetMetadata(
        input_shape=shape,
        nb_classes=CLASSES,
        nb_samples_train=16 * BATCH,
        batch_size=BATCH,
        sampling="poisson",
    )


def _data(net, rng, rows=BATCH):
    shape = NETS[net]()[1]
    if net == "masked-embedding":
        x = rng.integers(0, 10, size=(rows, *shape)).astype("int32")
        x[:, 4:] = 0  # masked positions
        x[0, 2:] = 0
    else:
        x = (2 * rng.normal(size=(rows, *shape))).astype("float32")
    return x, rng.integers(0, CLASSES, rows)


# -------------------------------------------------------------------- exactness
EXACT_CASES = [
    pytest.param(net, method, marks=mark)
    for net, method, mark in [
        ("mlp", "ghost", ()),
        ("mlp", "jacobian", pytest.mark.thorough),
        ("cnn", "ghost", pytest.mark.thorough),
        ("cnn", "jacobian", pytest.mark.thorough),
        ("masked-embedding", "ghost", pytest.mark.thorough),
    ]
]


@pytest.mark.parametrize(("net", "method"), EXACT_CASES)
def test_the_isolated_step_releases_the_batched_update(net, method, rng, same_noise):
    """Same weights, same batch, same noise: the released (noisy) gradients agree to
    float32 round-off."""
    x, y = _data(net, rng)
    batched = released_gradient(_clipped(net, False, method), x, y)
    isolated = released_gradient(_clipped(net, True, method), x, y)
    for a, b in zip(batched, isolated):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert max(np.abs(a).max() for a in batched) > 1e-2  # the step released something


def _sq(gradient) -> float:
    return float(np.sum(tf.convert_to_tensor(gradient).numpy().astype(np.float64) ** 2))


def _naive_sq_norms(model, x, y):
    """Per row: the squared norm of each weighted layer's gradient, from one GradientTape
    per row on the model's plain (batched) forward pass of that row alone."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    layers = model.weighted_layers()
    variables = [v for layer in layers for v in layer.trainable_variables]
    rows = []
    for xi, yi in zip(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model.forward(xi[None], training=True, isolate=False))
        grads = iter(tape.gradient(loss, variables, unconnected_gradients="zero"))
        rows.append([sum(_sq(next(grads)) for _ in layer.trainable_variables) for layer in layers])
    return np.array(rows)


@pytest.mark.parametrize("net", representatives(NETS, default={"mlp", "einsum"}))
def test_isolated_per_example_norms_equal_a_naive_loop(net, rng):
    """The mlp holds a layer with its own custom gradient (halved cotangent): the isolated
    backward pass keeps it (per-row VJPs inside the map); the einsum net's EinsumDense runs
    as a row loop (``lipdp.core.isolation.ROW_LOOP_OPS``)."""
    model = _clipped(net, True)
    x, y = _data(net, rng)
    facts = per_example_gradients(
        model, tf.constant(x), lambda p: model.per_example_losses(tf.constant(y), p)
    )
    ours = np.stack([s.numpy() for s in facts.sq_norms], axis=1)
    np.testing.assert_allclose(ours, _naive_sq_norms(model, x, y), rtol=1e-4, atol=1e-8)


def test_a_custom_gradient_is_kept_under_isolation_and_lost_by_a_plain_vectorized_map():
    """Why the isolated call differentiates each row inside the map: the gradient of a
    ``tf.vectorized_map`` taken from outside ignores a ``tf.custom_gradient`` in it."""
    layer = _HalvedCotangent()
    x = tf.random.normal((4, 3), seed=1)

    def gradient(call):
        with tf.GradientTape() as tape:
            tape.watch(x)
            total = tf.reduce_sum(call(x))
        return tape.gradient(total, x).numpy()

    isolated = gradient(lambda h: isolated_call(layer, h, what="halve"))
    plain = gradient(lambda h: tf.vectorized_map(lambda r: layer(r[None])[0], h))
    np.testing.assert_allclose(isolated, 0.5)
    np.testing.assert_allclose(plain, 1.0)  # the custom gradient dropped


# ------------------------------------------------------------ soundness: couplings
def _outlier_batch(seed=0):
    """``(x, labels)``: ``BATCH`` rows of N(0, 1) features, row 0 of norm about 150."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, 6))
    x[0] *= 60.0
    return x.astype("float32"), rng.integers(0, CLASSES, BATCH)


@pytest.mark.parametrize(
    "name",
    representatives(
        [n for n in couplings.CONSTRUCTIONS if n != "running-mean"],
        default={"large-batch", "max-logit-loss"},
    ),
)
def test_couplings_leak_without_isolation_and_stay_within_the_sensitivity_with_it(name):
    """The red team's couplings (tests/couplings.py), probe off in both runs: the batched
    step releases more than the sensitivity when a row is removed; the isolated step stays
    within it."""
    build = couplings.CONSTRUCTIONS[name]
    batched = build(1, row_isolation=False, independence_probe=False)
    assert remove_one_ratios(batched.model, batched.x, batched.y).max() > 1.4
    isolated = build(1, row_isolation=True, independence_probe=False)
    assert remove_one_ratios(isolated.model, isolated.x, isolated.y).max() <= 1 + TOLERANCE


def test_a_running_statistic_leaks_without_isolation_and_is_refused_with_it():
    """The running mean couples rows in the step (ratio above 1) and saves a statistic of
    the batch; isolated, its write is refused, naming the variable."""
    build = couplings.CONSTRUCTIONS["running-mean"]
    batched = build(1, row_isolation=False, independence_probe=False)
    assert remove_one_ratios(batched.model, batched.x, batched.y).max() > 1.4
    isolated = build(1, row_isolation=True, independence_probe=False)
    with pytest.raises(ValueError) as error:
        isolated.model.train_on_batch(isolated.x, isolated.y)
    _assert_refusal(error, "running_mean")  # Keras 3: a write; Keras 2: an op


def _assert_refusal(error, *fragments):
    line = str(error.value).strip().splitlines()[-1]
    for fragment in ("row_isolation", *fragments):
        assert fragment in line, line


_VARIABLE = tf.Variable(tf.zeros(6), trainable=False)


class _RawWrite(K.Layer):
    """Keeps its last input in a ``tf.Variable`` of its own (not a Keras weight)."""

    def call(self, inputs):
        _VARIABLE.assign(inputs[0])
        return inputs


class _PythonState(K.Layer):
    """A ``tf.py_function``: a row loop would carry its Python state from row to row."""

    def call(self, inputs):
        outputs = tf.py_function(lambda a: a, [inputs], inputs.dtype)
        outputs.set_shape(inputs.shape)
        return outputs


class _DataLoss(K.Layer):
    def call(self, inputs):
        self.add_loss(tf.reduce_mean(inputs))
        return inputs


@pytest.mark.parametrize(
    ("layer", "fragment"),
    [
        (_RawWrite, "AssignVariableOp"),
        (_PythonState, "PyFunc"),
        (_DataLoss, "loss"),
    ],
)
def test_state_and_side_channels_in_an_isolated_call_are_refused(layer, fragment):
    model = DPSGD_Sequential(
        [compat.input_layer((6,)), layer(name="odd"), K.Dense(CLASSES)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_metadata((6,)),
        row_isolation=True,
    )
    model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(True))
    x, y = _outlier_batch()
    with pytest.raises(ValueError) as error:
        model.train_on_batch(x, y)
    line = str(error.value).strip().splitlines()[-1]
    assert "'odd'" in line and fragment in line, line


def test_random_layers_draw_per_row_and_advance_once_per_step():
    """A Dropout under isolation in a traced step: rows get their own masks, the next step
    other masks."""
    dropout = K.Dropout(0.5)
    ones = tf.ones((6, 40))
    step = tf.function(
        lambda: isolated_call(lambda b: dropout(b, training=True), ones, what="d", layers=[dropout])
    )
    first, second = step().numpy(), step().numpy()
    assert len({row.tobytes() for row in first}) == len(first)  # every row its own mask
    assert not np.array_equal(first, second)
    assert 0.3 < np.mean(first == 0) < 0.7


# ------------------------------------------------------------------ clipless family
def _clipless(isolated, function=None):
    tf.keras.utils.set_random_seed(5)
    lambda_layer = DL.DP_Lambda(
        function or (lambda x: 0.5 * x), lipschitz_constant=1.0, output_gain=1.0
    )
    model = DP_Sequential(
        [
            DL.DP_BoundedInput(input_shape=(6,), upper_bound=4.0),
            lambda_layer,
            DL.DP_QuickSpectralDense(8),
            DL.DP_GroupSort(2),
            DL.DP_QuickSpectralDense(CLASSES),
            DL.DP_ClipGradient(0.5),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_metadata((6,)),
        independence_probe=False,
        row_isolation=isolated,
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(2.0), optimizer="sgd")
    return model


def test_clipless_isolation_is_exact_and_runs_lipdp_layers_on_the_batch(rng, same_noise):
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, BATCH)]
    model = _clipless(True)
    assert [model._runs_batched(layer) for layer in model.dp_layers] == [
        True,
        False,  # DP_Lambda: a user function
        True,
        True,
        True,
        True,
    ]
    for a, b in zip(released_gradient(_clipless(False), x, y), released_gradient(model, x, y)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_coupling_dp_lambda_leaks_without_isolation_and_not_with_it():
    """``DP_Lambda`` sorting every feature over the rows: on one row the identity, so its
    per-example claims (1-Lipschitz, gain 1) hold for each row alone, not for the batch."""
    x, labels = _outlier_batch()
    y = np.eye(CLASSES, dtype="float32")[labels]

    def coupled(h):
        return tf.sort(h, axis=0)

    leaked = remove_one_ratios(_clipless(False, coupled), x, y)
    assert leaked.max() > 1.4
    isolated = remove_one_ratios(_clipless(True, coupled), x, y)
    assert isolated.max() <= 1 + TOLERANCE


# ---------------------------------------------------------------------- the option
def test_the_option_is_saved_stated_and_taken_by_make_private():
    model = _clipped("mlp", True)
    assert DPSGD_Sequential.from_config(model.get_config()).row_isolation is True
    assert _clipped("mlp", False).get_config()["row_isolation"] is False
    notes = privacy_report(model, epochs=1).notes
    assert any(note.startswith("row isolation:") for note in notes)
    assert not any("probe skipped" in note for note in notes)
    private = lipdp.make_private(
        [compat.input_layer((6,)), K.Dense(CLASSES)],
        epsilon=3.0,
        delta=1e-5,
        epochs=1,
        batch_size=8,
        dataset_size=128,
        row_isolation=True,
    )
    assert private.row_isolation is True
    with pytest.raises(TypeError, match="row_isolation must be True or False"):
        _metadata_model(row_isolation="yes")
    # the defaults: on for the clipless family (about the batched step's cost), off for
    # clipped DP-SGD (benchmarks/row_isolation_cost.py)
    assert _metadata_model().row_isolation is False
    clipless = DP_Sequential(
        [DL.DP_BoundedInput(input_shape=(6,), upper_bound=1.0), DL.DP_QuickSpectralDense(3)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
    )
    assert clipless.row_isolation is True
    assert DP_Sequential.from_config(clipless.get_config()).row_isolation is True


def _metadata_model(**options):
    return DPSGD_Sequential(
        [compat.input_layer((6,)), K.Dense(CLASSES)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        **options,
    )
