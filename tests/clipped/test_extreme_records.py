"""Per-example norms that cannot underflow or overflow (issue 26, rule S13).

Finite records far from unit scale: every ghost rule, the vectorised fallback and the
Jacobian method give each row's gradient norm as a float64 reference does (one row at a
time, the layer rebuilt in float64), for inputs and cotangents of magnitude 1e-30 to
1e30; the clipped sums release ``C_i g_i`` of norm at most ``R`` for such rows; and the
attacker's remove-one check on the issue's record (a bias-free Dense, inputs of 1e-19, a
regression label of 9e18, MSE) stays within the declared sensitivity in every clipping
mode, with both methods."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.clipped.per_example import ghost_rule, per_example_gradients
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.marks import thorough
from tests.remove_one import TOLERANCE, remove_one_ratios

L = tf.keras.layers
EXPONENTS = (-30, -15, 0, 15, 30)
#: (input exponent, cotangent exponent) of each row: every pair.
SCALES = [(p, q) for p in EXPONENTS for q in EXPONENTS]


class DenseSubclass(L.Dense):
    """A Dense the ghost rules do not recognise (a subclass may change ``call``). (No
    leading underscore: Keras 3 refuses a default name starting with ``_`` as a root name
    scope.)"""


# name -> (layer builder, input shape or "ids", expected ghost rule)
LAYERS = {
    "dense": (lambda: L.Dense(3, input_shape=(4,)), (4,), "dense"),
    "dense-sequence-gram": (lambda: L.Dense(5, input_shape=(2, 4)), (2, 4), "dense"),
    "dense-sequence-materialised": (lambda: L.Dense(2, input_shape=(6, 2)), (6, 2), "dense"),
    "conv2d-gram": (
        lambda: L.Conv2D(8, 2, padding="valid", input_shape=(3, 3, 4)),
        (3, 3, 4),
        "conv2d",
    ),
    "conv2d-materialised": (
        lambda: L.Conv2D(2, 3, padding="same", strides=2, input_shape=(5, 5, 1)),
        (5, 5, 1),
        "conv2d",
    ),
    "embedding": (lambda: L.Embedding(5, 3, input_shape=(4,)), "ids", "embedding"),
    "fallback-dense-subclass": (lambda: DenseSubclass(3, input_shape=(4,)), (4,), "vectorized"),
    "fallback-conv1d": (lambda: L.Conv1D(3, 2, input_shape=(4, 2)), (4, 2), "vectorized"),
    "fallback-grouped-conv2d": (
        lambda: L.Conv2D(4, 2, groups=2, input_shape=(3, 3, 2)),
        (3, 3, 2),
        "vectorized",
    ),
}


def _one_layer_model(name, method="ghost"):
    build, _, _ = LAYERS[name]
    model = DPSGD_Sequential(
        [build()],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", 1.0),
        dataset_metadata=DatasetMetadata(
            input_shape=(1,), nb_classes=1, nb_samples_train=100, batch_size=len(SCALES)
        ),
        gradient_method=method,
    )
    model.compile(loss="mse", optimizer="sgd")
    return model


def _scaled_batch(name, model, scales, rng):
    """Inputs and output cotangents whose rows are of magnitude ``10^p`` and ``10^q``."""
    shape = LAYERS[name][1]
    rows = len(scales)
    if shape == "ids":
        x = rng.integers(0, 5, size=(rows, 4)).astype("int32")
        x[:, :2] = x[:, :1]  # repeated ids in a row
    else:
        x = rng.normal(size=(rows, *shape)) * np.array([10.0**p for p, _ in scales]).reshape(
            -1, *[1] * len(shape)
        )
    out_shape = model.layers_forward_order()[0].compute_output_shape((rows, *x.shape[1:]))
    g = rng.normal(size=tuple(out_shape))
    g *= np.array([10.0**q for _, q in scales]).reshape(-1, *[1] * (g.ndim - 1))
    return x.astype(x.dtype if shape == "ids" else "float32"), g.astype("float32")


def _linear_loss(cotangents):
    """Per-row losses ``<z_i, G_i>``: their gradient w.r.t. the output is ``G``."""
    flat = tf.reshape(cotangents, [cotangents.shape[0], -1])
    return lambda y_pred: tf.reduce_sum(tf.reshape(y_pred, tf.shape(flat)) * flat, axis=1)


def _float64_rows(layer, x, g):
    """Reference: each row's gradient of ``<layer(x_i), g_i>``, the layer rebuilt in
    float64 with the same weights, one tape per row: ``[[per-variable arrays]]``."""
    config = {**layer.get_config(), "dtype": "float64"}
    config.pop("batch_input_shape", None)
    twin = type(layer).from_config(config)
    twin.build((None, *x.shape[1:]))
    twin.set_weights([w.astype("float64") for w in layer.get_weights()])
    rows = []
    for xi, gi in zip(x, g):
        xi = xi[None] if x.dtype.kind == "i" else xi[None].astype("float64")
        with tf.GradientTape() as tape:
            out = twin(tf.constant(xi))
            loss = tf.reduce_sum(out * gi.astype("float64"))
        grads = tape.gradient(loss, twin.trainable_variables)
        rows.append([tf.convert_to_tensor(t).numpy() for t in grads])
    return rows


def _gradient_exponents(name):
    """Each row's gradient magnitude, ``10^(p + q)`` (``10^q`` for ids)."""
    return np.array([q if LAYERS[name][1] == "ids" else p + q for p, q in SCALES])


def _assert_clipped_sums(facts, layer, expected):
    """The engine's clipped sums at ``R = 1`` (factor ``1 / max(||g_i||, 1)``, 0 for a
    non-finite norm) equal the float64 reference ``expected``, variable by variable."""
    norms32 = tf.sqrt(facts.sq_norms[0])
    keep = tf.math.is_finite(norms32)
    c = tf.where(keep, 1.0 / tf.maximum(norms32, 1.0), tf.zeros_like(norms32))
    sums = facts.clipped_sums([c], keep)
    for v, e in zip(layer.trainable_variables, expected):
        np.testing.assert_allclose(sums[variable_key(v)].numpy(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(LAYERS))
def test_norms_equal_a_float64_reference_from_1e_minus_30_to_1e30(name, rng):
    """Every ghost rule and the fallback: exact for every pair of scales (gradients from
    1e-60 to 1e60); the Jacobian method where the gradient is a float32 number."""
    model = _one_layer_model(name)
    layer = model.layers_forward_order()[0]
    assert ghost_rule(layer) == LAYERS[name][2]
    x, g = _scaled_batch(name, model, SCALES, rng)
    reference = np.array([sum(np.sum(t**2) for t in row) for row in _float64_rows(layer, x, g)])
    ours = per_example_gradients(model, tf.constant(x), _linear_loss(g), "ghost")
    np.testing.assert_allclose(ours.sq_norms[0].numpy(), reference, rtol=1e-4)
    assert reference.min() < 1e-50 and reference.max() > 1e50  # squares beyond float32
    inside = np.abs(_gradient_exponents(name)) <= 30  # normal float32 gradient entries
    jacobian = per_example_gradients(model, tf.constant(x), _linear_loss(g), "jacobian")
    np.testing.assert_allclose(jacobian.sq_norms[0].numpy()[inside], reference[inside], rtol=1e-4)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("method", ["ghost", "jacobian"])
def test_clipped_sums_release_at_most_r_per_row_at_every_scale(name, method, rng):
    """Flat clipping at R = 1: the clipped sum equals sum_i min(1, R / ||g_i||) g_i of
    the float64 reference, dominated by the clipped rows (norm R each) whatever their
    scale; the Jacobian method drops (factor 0) the rows whose gradient overflows
    float32."""
    model = _one_layer_model(name, method)
    layer = model.layers_forward_order()[0]
    x, g = _scaled_batch(name, model, SCALES, rng)
    rows = _float64_rows(layer, x, g)
    norms = np.array([np.sqrt(sum(np.sum(t**2) for t in row)) for row in rows])
    factors = np.minimum(1.0, 1.0 / norms)
    if method == "jacobian":
        factors[_gradient_exponents(name) > 38] = 0.0  # inf in float32: factor 0 (S9)
    expected = [sum(f * row[j] for f, row in zip(factors, rows)) for j in range(len(rows[0]))]
    facts = per_example_gradients(model, tf.constant(x), _linear_loss(g), method)
    _assert_clipped_sums(facts, layer, expected)
    assert max(np.max(np.abs(e)) for e in expected) > 0.5  # clipped rows count R each


def _extreme_record_model(clipping, method):
    """The issue's model: a bias-free Dense regression, MSE, Poisson metadata."""
    model = DPSGD_Sequential(
        [L.Dense(1, use_bias=False, input_shape=(5,))],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=clipping,
        dataset_metadata=DatasetMetadata(
            input_shape=(5,), nb_classes=1, nb_samples_train=64, batch_size=8, sampling="poisson"
        ),
        gradient_method=method,
    )
    model.compile(loss="mse", optimizer=tf.keras.optimizers.SGD(0.1))
    return model


def _extreme_record_cases():
    """Every mode with ghost norms (whose underflow this guards against) by default; the
    Jacobian method under flat clipping by default, under the other modes thorough."""
    modes = [
        Clipping("flat", 1.0),
        Clipping("per-layer", 1.0),
        Clipping("automatic", 1.0),
        Clipping("global", 1.0, threshold=2.0),
    ]
    return [
        pytest.param(
            clipping,
            method,
            id=f"{clipping.mode}-{method}",
            marks=[thorough] if method == "jacobian" and clipping.mode != "flat" else [],
        )
        for method in ("ghost", "jacobian")
        for clipping in modes
    ]


@pytest.mark.parametrize("clipping, method", _extreme_record_cases())
def test_remove_one_on_the_extreme_record_stays_within_the_sensitivity(clipping, method, rng):
    """Inputs of 1e-19 (squares denormal: flushed to zero by the CPU) and a label of
    9e18: the row's gradient has norm ~4, the old ghost norm read 0 and the step released
    4x (flat, per-layer, global) and 400x (automatic) the sensitivity. The record's
    contribution is now clipped to R (ratio ~1), or dropped under global clipping (its
    norm is above Z = 2: the old ghost norm kept it, ratio 2): never above."""
    model = _extreme_record_model(clipping, method)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    x[3], y[3] = 1e-19, 9e18
    ratios = remove_one_ratios(model, x, y, rows=[0, 3])
    assert ratios.max() <= 1 + TOLERANCE
    if clipping.mode == "global":
        assert ratios[1].max() < 1e-6  # above Z: dropped
    else:
        assert ratios[1].max() > 0.99  # clipped at R, not read as 0


def test_a_saturated_activation_keeps_the_row_with_its_float32_gradient(rng):
    """An input of 3e38 overflows its pre-activation to inf, but tanh saturates: the
    row's float32 gradient is finite (0 for the first kernel). Ghost norms read it as
    the Jacobian method does (they used to read inf x 0 = NaN and drop the row)."""
    layers = [L.Dense(7, activation="tanh", input_shape=(5,)), L.Dense(3)]
    x = rng.normal(size=(6, 5)).astype("float32")
    x[2] = 3e38
    y = np.eye(3, dtype="float32")[rng.integers(0, 3, 6)]
    results = []
    for method in ("ghost", "jacobian"):
        tf.keras.utils.set_random_seed(3)
        model = DPSGD_Sequential(
            [type(layer).from_config(layer.get_config()) for layer in layers],
            dp_parameters=DPParameters("global", 1.0, 1e-5),
            gradient_method=method,
        )
        model.compile(loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
        losses = lambda y_pred, model=model: model.per_example_losses(y, y_pred)  # noqa: E731
        facts = per_example_gradients(model, tf.constant(x), losses, method)
        results.append(np.stack([sq.numpy() for sq in facts.sq_norms], axis=1))
    assert np.all(np.isfinite(results[0])) and results[0][2, 0] == 0.0
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)


#: Cotangent exponents whose rows all have ``max |G_i|`` inside ``scale.MODERATE``: the
#: batch is not divided (``U = G``, ``s = 1``), with inputs from 1e-30 to 1e30.
MODERATE_SCALES = [(p, q) for p in EXPONENTS for q in (-6, -3, 0, 1)]


def test_unit_rows_keeps_a_moderate_batch_and_divides_any_other():
    """``unit_rows``: a batch whose every row maximum is in [2^-24, 2^8] comes back as
    is with scales 1; one row outside (large, tiny or infinite) and the whole batch is
    divided by its row maxima, as before; zero rows keep scale 1 either way."""
    from lipdp.clipped.per_example.scale import MODERATE, unit_rows

    low, high = MODERATE
    g = np.array([[low, -0.5 * low], [-high, 1.0], [0.0, 0.0], [0.25, -3.0]], dtype="float32")
    u, s = unit_rows(tf.constant(g))
    np.testing.assert_array_equal(u.numpy(), g)
    np.testing.assert_array_equal(s.numpy(), np.ones(4, "float32"))
    for outside in (2.0 * high, 0.5 * low, np.inf):
        h = g.copy()
        h[3] = [0.5 * outside, -outside]  # the row's maximum outside
        u, s = unit_rows(tf.constant(h))
        maxima = np.abs(h).max(axis=1)
        maxima[2] = 1.0  # a zero row
        np.testing.assert_array_equal(s.numpy(), maxima.astype("float32"))
        with np.errstate(invalid="ignore"):
            expected = h * (1.0 / maxima.astype("float32"))[:, None]
        np.testing.assert_array_equal(u.numpy(), expected)
        assert np.abs(u.numpy()[:3]).max() <= 1.0


@pytest.mark.parametrize("name", list(LAYERS))
def test_undivided_moderate_cotangents_equal_a_float64_reference(name, rng):
    """The batch ``unit_rows`` leaves undivided (every cotangent row maximum between
    1e-6 and 30, inputs from 1e-30 to 1e30): every rule's norms equal the float64
    reference, and the clipped sums release ``sum_i min(1, R / ||g_i||) g_i``."""
    from lipdp.clipped.per_example.scale import unit_rows

    model = _one_layer_model(name)
    layer = model.layers_forward_order()[0]
    x, g = _scaled_batch(name, model, MODERATE_SCALES, rng)
    assert np.all(unit_rows(tf.constant(g))[1].numpy() == 1.0)  # the undivided path
    rows = _float64_rows(layer, x, g)
    reference = np.array([sum(np.sum(t**2) for t in row) for row in rows])
    facts = per_example_gradients(model, tf.constant(x), _linear_loss(g), "ghost")
    np.testing.assert_allclose(facts.sq_norms[0].numpy(), reference, rtol=1e-4)
    if LAYERS[name][1] != "ids":  # squares beyond float32 (inputs up to 1e30)
        assert reference.max() > 1e55
    factors = np.minimum(1.0, 1.0 / np.sqrt(reference))
    expected = [sum(f * row[j] for f, row in zip(factors, rows)) for j in range(len(rows[0]))]
    _assert_clipped_sums(facts, layer, expected)


def test_square_sums_equal_float64_squares_on_adversarial_rows(rng):
    """``square_sums`` (a float64 dot product of each row with itself) against numpy's
    float64 squares: rows of 1e-30 and 1e30, float32's largest and its denormals, a
    zero row, a NaN and an infinity (propagated), over two tensors of other shapes; and
    the former squares-then-sum formula on every row."""
    from lipdp.clipped.per_example.scale import square_sums

    a = rng.normal(size=(7, 3, 5)).astype("float32")
    b = rng.normal(size=(7, 4)).astype("float32")
    a[0] *= 1e-30
    b[0] *= 1e-30
    a[1] *= 1e30
    a[2] = np.finfo(np.float32).max
    a[3] = np.finfo(np.float32).smallest_subnormal
    b[3] = 0.0
    a[4], b[4] = 0.0, 0.0
    a[5, 0, 0] = np.nan
    b[6, 1] = np.inf
    expected = (a.astype("float64") ** 2).reshape(7, -1).sum(1) + (b.astype("float64") ** 2).sum(1)
    ours = square_sums([tf.constant(a), tf.constant(b)]).numpy()
    assert ours.dtype == np.float64
    normal = [0, 1, 2, 4]
    np.testing.assert_allclose(ours[normal], expected[normal], rtol=1e-14, atol=0)
    assert np.isnan(ours[5]) and ours[6] == np.inf
    # TensorFlow's CPU kernels read float32 denormals as 0 (row 3): as the squares of the
    # casts did before; the rows' sums agree with that formula on every row.
    former = sum(
        tf.reduce_sum(tf.reshape(tf.square(tf.cast(t, tf.float64)), [7, -1]), 1) for t in (a, b)
    ).numpy()
    np.testing.assert_allclose(ours, former, rtol=1e-14, atol=0)
