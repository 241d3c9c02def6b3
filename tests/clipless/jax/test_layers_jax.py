"""E2's clipless layers on Keras 3's JAX backend: convolutions, pooling, normalisation,
shapes, bias, residual blocks, scattering, DP_Lambda (issue 38 item 5, plan steps 6 and 8).

Compared with independent computations:

* TensorFlow, in a subprocess (:mod:`tests.clipless.jax.layers_tensorflow_side`): every
  chain of :mod:`tests.clipless.jax.layer_cases` given the JAX weights -- outputs and
  vector-Jacobian products (input and weights), eagerly and under ``jax.jit`` in a
  ``keras.StatelessScope``, to 1e-6; the bound pass's sensitivities of the catalogue cases
  (``tests/cases.py``), the TensorFlow model's weights copied;
* ``jax.vmap(jax.grad)`` per-row gradients for the max-pooling tie test;
* numpy: the exact singular values of the projected convolutions (the map materialised
  and checked against ``keras.ops.conv`` on the canonical basis), the ball projection.
"""

import json
import math

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from lipdp.clipless import audit
from lipdp.clipless import layers as L
from lipdp.clipless.bounds import bound_pass
from lipdp.clipless.layers.bias import l2_ball_projection
from lipdp.clipless.layers.convolution import patch_overlap
from tests.clipless.jax import layer_cases
from tests.clipless.jax.tensorflow_run import run_tensorflow_side
from tests.marks import thorough

ROWS = 3


def _tensorflow(tmp_path, spec, **arrays):
    """TensorFlow's numbers (:mod:`tests.clipless.jax.layers_tensorflow_side`, subprocess)."""
    source, target = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(source, spec=json.dumps(spec), **arrays)
    run_tensorflow_side("layers_tensorflow_side", str(source), str(target), timeout=600)
    return dict(np.load(target))


def _chain(name, seed=0):
    """The JAX model of chain ``name`` (weights: the initial kernels, biases drawn inside
    their ball), a batch ``x`` and a cotangent ``g`` of its output."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    _, shape = layer_cases.LAYER_CHAINS[name]
    x = rng.normal(size=(ROWS, *shape)).astype("float32")
    model = layer_cases.build(name, x)
    for variable in model.trainable_variables:
        if len(variable.shape) == 1:  # a bias: inside its ball, not zero
            variable.assign(0.1 * rng.normal(size=variable.shape).astype("float32"))
    g = rng.normal(size=model(x).shape).astype("float32")
    return model, x, g


def _jax_numbers(model, x, g):
    """``(y, vjps)`` eagerly and under ``jax.jit`` (in a StatelessScope): the output and the
    VJPs of ``g`` w.r.t. the input and every trainable weight, through ``stateless_call``."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def forward(params, inputs):
        return model.stateless_call(params, non_trainable, inputs)[0]

    def numbers(params, inputs, cotangent):
        y, vjp = jax.vjp(lambda inputs, params: forward(params, inputs), inputs, params)
        d_inputs, d_params = vjp(cotangent)
        return y, [d_inputs, *d_params]

    eager = numbers(trainable, jnp.asarray(x), jnp.asarray(g))
    with keras.StatelessScope():
        jitted = jax.jit(numbers)(trainable, jnp.asarray(x), jnp.asarray(g))
    return {"eager": eager, "jit": jitted, "call": model(x)}


CHAINS_DEFAULT = [
    "QuickSpectralConv2D(same,k5,stride2)",
    "GroupNormalization",
    "ScatteringTransform(zeros,J2)",
    "ResidualConv(1-lip-add)",
    "Lambda",
]
CATALOGUE_DEFAULT = [
    "ScatteringTransform(zeros,J2)+GN",
    "AddBias(after conv and dense)",
    "ResidualConvBlock",
]


def _chains_jax_side(names):
    """``({name: (model, JAX numbers)}, arrays for the TensorFlow side)``."""
    jax_side, arrays = {}, {}
    for name in names:
        model, x, g = _chain(name)
        jax_side[name] = (model, _jax_numbers(model, x, g))
        arrays[f"{name}/x"], arrays[f"{name}/g"] = x, g
        for index, variable in enumerate(model.weights):
            arrays[f"{name}/w{index}"] = np.asarray(variable.value)
    return jax_side, arrays


@pytest.fixture(scope="module")
def default_sets(tmp_path_factory):
    """The default chains on JAX, and TensorFlow's numbers for them and for the default
    catalogue cases (one subprocess: TensorFlow starts once)."""
    jax_side, arrays = _chains_jax_side(CHAINS_DEFAULT)
    spec = {"chains": CHAINS_DEFAULT, "catalogue": CATALOGUE_DEFAULT}
    return jax_side, _tensorflow(tmp_path_factory.mktemp("default"), spec, **arrays)


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(CHAINS_DEFAULT, id="default"),
        pytest.param(
            [n for n in layer_cases.LAYER_CHAINS if n not in CHAINS_DEFAULT], id="rest",
            marks=thorough,
        ),
    ],
)  # fmt: skip
def test_outputs_and_vjps_equal_tensorflow(request, tmp_path, names):
    """Each chain on JAX (its own weights) and on TensorFlow (the same weights, one
    subprocess): outputs and VJPs w.r.t. the input and every weight, to 1e-6, from the
    eager call, the eager ``jax.vjp`` and the jitted one."""
    if names is CHAINS_DEFAULT:
        jax_side, tf_side = request.getfixturevalue("default_sets")
    else:
        jax_side, arrays = _chains_jax_side(names)
        tf_side = _tensorflow(tmp_path, {"chains": names}, **arrays)
    close = {"rtol": 1e-6, "atol": 1e-6}
    for name in names:
        model, numbers = jax_side[name]
        expected = tf_side[f"{name}/y"]
        np.testing.assert_allclose(np.asarray(numbers["call"]), expected, **close, err_msg=name)
        for mode in ("eager", "jit"):
            y, vjps = numbers[mode]
            np.testing.assert_allclose(np.asarray(y), expected, **close, err_msg=f"{name} {mode}")
            assert len(vjps) == 1 + len(model.trainable_variables)
            for index, vjp in enumerate(vjps):
                np.testing.assert_allclose(
                    np.asarray(vjp), tf_side[f"{name}/vjp{index}"], **close,
                    err_msg=f"{name} {mode} vjp {index}",
                )  # fmt: skip


# ------------------------------------------------------------------- catalogue bounds


def _catalogue_names():
    from tests import cases  # noqa: PLC0415 - its TensorFlow model is imported lazily

    return list({**cases.LAYER_CASES, **cases.COMPOSITION_CASES})


def _catalogue_layers(name):
    """``(layers, input_shape, loss, upper_bound, batch)`` of catalogue case ``name``,
    read from ``tests/cases.py`` with its model builder replaced by a recorder."""
    from tests import cases

    def record(dp_layers, input_shape, loss=None, upper_bound=3.0, batch=cases.BATCH, **_):
        return dp_layers, input_shape, loss, upper_bound, batch

    saved, cases.build = cases.build, record
    try:
        recorded = {**cases.LAYER_CASES, **cases.COMPOSITION_CASES}[name]()
    finally:
        cases.build = saved
    return recorded


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(CATALOGUE_DEFAULT, id="default"),
        pytest.param("rest", id="rest", marks=thorough),
    ],
)
def test_catalogue_sensitivities_equal_tensorflow(request, tmp_path, names):
    """The bound pass on the catalogue case's layers built under JAX, TensorFlow's weights
    copied, gives TensorFlow's sensitivities (rel. 1e-6), every variable, forward order."""
    from lipdp.clipless import losses

    if names == "rest":
        names = [n for n in _catalogue_names() if n not in CATALOGUE_DEFAULT]
        tf_side = _tensorflow(tmp_path, {"catalogue": names})
    else:
        tf_side = request.getfixturevalue("default_sets")[1]
    for name in names:
        layers, shape, loss, upper_bound, batch = _catalogue_layers(name)
        for layer in layers:
            if isinstance(layer, L.DP_Lambda):  # the case's tf.tanh: the same function in ops
                layer.function = lambda t: 0.5 * keras.ops.tanh(t)
        model = keras.Sequential(
            [L.DP_BoundedInput(input_shape=shape, upper_bound=upper_bound), *layers]
        )
        model(np.zeros((1, *shape), "float32"))
        weights = [k for k in tf_side if k.startswith(f"{name}/w")]
        assert len(weights) == len(model.weights), name
        for index, variable in enumerate(model.weights):  # TensorFlow's weights, copied
            variable.assign(tf_side[f"{name}/w{index}"])
        loss = loss or losses.DP_TauCategoricalCrossentropy(tau=16.0)
        deltas = [d for _, d in bound_pass(model.layers, loss.get_L()).sensitivities(batch)]
        expected = tf_side[f"{name}/deltas"]
        assert len(deltas) == len(expected) > 0, name
        np.testing.assert_allclose(deltas, expected, rtol=1e-6, atol=0, err_msg=name)


# ------------------------------------------------------------------------ ties, rows
def _row_gradients(layer, x, g):
    """``jax.vmap(jax.grad)``: row ``i``'s gradient of ``<g_i, layer(x_i)>`` (a batch of
    one), independent of the batched call."""

    def row_value(row, cotangent):
        return jnp.sum(layer(row[None])[0] * cotangent)

    return jax.vmap(jax.grad(row_value))(jnp.asarray(x), jnp.asarray(g))


def test_max_pooling_ties_keep_the_cotangent_norm():
    """A window of equal values (zeros, constants, two tied maxima): the cotangent reaches
    the input with norm at most ``||g||`` (JAX's reduce_window max routes it to one
    element, as TensorFlow's MaxPool does); per row by vmap(grad), batched, and jitted."""
    rng = np.random.default_rng(0)
    x = np.zeros((4, 4, 4, 2), "float32")
    x[1] = 1.5  # constant windows
    x[2] = np.kron(rng.normal(size=(2, 2, 2)), np.ones((2, 2, 1)))  # tied windows
    x[3] = rng.normal(size=(4, 4, 2))
    x[3, 0:2, 0:2, 0] = 2.0  # four tied maxima in one window
    layer = L.DP_MaxPool2D(2)
    g = rng.normal(size=(4, 2, 2, 2)).astype("float32")
    rows = np.asarray(_row_gradients(layer, x, g))
    _, vjp = jax.vjp(layer, jnp.asarray(x))
    (batched,) = vjp(jnp.asarray(g))
    with keras.StatelessScope():
        jitted = jax.jit(lambda x, g: jax.vjp(layer, x)[1](g)[0])(jnp.asarray(x), jnp.asarray(g))
    for grads in (rows, np.asarray(batched), np.asarray(jitted)):
        norms = np.sqrt(np.sum(np.square(grads), axis=(1, 2, 3)))
        bound = np.sqrt(np.sum(np.square(g), axis=(1, 2, 3)))
        assert np.all(norms <= bound * (1 + 1e-6)), (norms, bound)
        np.testing.assert_allclose(norms, bound, rtol=1e-6)  # one element per window: GNP


@pytest.mark.parametrize(
    "name",
    ["ResidualConv(1-lip-add)", pytest.param("ScatteringTransform(reflect,J1)", marks=thorough)],
)
def test_row_gradients_within_the_lipschitz_bound(name):
    """Per-row input gradients (vmap(grad)) of ``<g_i, f(x_i)>`` within ``Lip * ||g_i||``
    (the bound pass's constant of the chain), on rows with zeros and ties."""
    model, x, g = _chain(name)
    x[0] = 0.0
    bounded = L.DP_BoundedInput(input_shape=x.shape[1:], upper_bound=1.0)  # any bound
    bounds = bound_pass([bounded, *model.layers])
    lipschitz = float(bounds.lipschitz)
    rows = np.asarray(_row_gradients(model, x, g))
    norms = np.sqrt(np.sum(np.square(rows.reshape(len(x), -1)), axis=1))
    cotangents = np.sqrt(np.sum(np.square(g.reshape(len(x), -1)), axis=1))
    assert np.all(norms <= lipschitz * cotangents * (1 + 1e-6)), (norms, lipschitz * cotangents)


def test_lambda_sees_one_row():
    """DP_Lambda on JAX: the function runs on a batch of one per row (rule S2), eagerly and
    jitted -- a function reading the batch mean gives each row its own value."""
    layer = L.DP_Lambda(
        lambda t: t - keras.ops.mean(t, axis=0, keepdims=True) + keras.ops.tanh(t),
        lipschitz_constant=2.0, output_gain=2.0,
    )  # fmt: skip
    x = np.random.default_rng(0).normal(size=(5, 3)).astype("float32")
    alone = np.concatenate([np.tanh(x[i : i + 1]) for i in range(len(x))])  # t - mean(t) = 0
    np.testing.assert_allclose(np.asarray(layer(x)), alone, rtol=1e-6, atol=1e-7)
    with keras.StatelessScope():
        jitted = jax.jit(lambda t: layer(t))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(jitted), alone, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------ projections
@pytest.mark.parametrize(
    "kernel_shape, input_shape, strides, padding",
    [((3, 3, 2, 4), (5, 5, 2), (1, 1), "same"), ((5, 5, 2, 3), (7, 6, 2), (2, 2), "valid"),
     ((2, 4, 1, 2), (5, 7, 1), (2, 3), "same")],
)  # fmt: skip
def test_conv_matrix_is_the_convolution(kernel_shape, input_shape, strides, padding):
    """audit.conv_matrix (numpy placement) equals keras.ops.conv (XLA) on the basis."""
    kernel = np.random.default_rng(0).normal(size=kernel_shape).astype("float32")
    n_in = int(np.prod(input_shape))
    basis = np.eye(n_in, dtype="float32").reshape(n_in, *input_shape)
    conv = keras.ops.conv(basis, kernel, strides=strides, padding=padding)
    expected = np.asarray(conv).reshape(n_in, -1)
    matrix = audit.conv_matrix(kernel, input_shape, strides, padding)
    assert matrix.dtype == np.float64
    np.testing.assert_array_equal(matrix, expected)


@pytest.mark.parametrize("name", ["SpectralConv2D(same)", "QuickSpectralConv2D(same,k5,stride2)"])
def test_projected_convolutions_reach_the_constraint(name):
    """After ``project()`` on JAX, the exact operator norm (numpy SVD of the materialised
    map) of the effective kernel is at most 1 (1e-5 round-off); an orthogonal projection
    puts it at 1."""
    model, x, _ = _chain(name)
    (layer,) = model.layers
    layer.kernel.assign(3.0 * np.asarray(layer.kernel.value))  # far outside the ball
    layer.project()
    kernel = np.asarray(layer.effective_kernel(), dtype=np.float64)
    matrix = audit.conv_matrix(kernel, x.shape[1:], layer.strides, layer.padding)
    largest = np.linalg.svd(matrix, compute_uv=False)[0]
    assert largest <= 1.0 + 1e-5
    reshaped = np.linalg.svd(kernel.reshape(-1, kernel.shape[-1]), compute_uv=False)
    assert reshaped[0] * math.sqrt(patch_overlap(layer.kernel_size, layer.strides)) <= 1 + 1e-5


def test_bias_projection_reaches_the_ball():
    """DP_AddBias: ``project()`` and the pure ``projected_values`` (jitted) land in the
    ball and equal ``v * r / max(||v||, r)`` (numpy float64); a bias inside is unchanged."""
    layer = L.DP_AddBias(norm_max=0.5)
    layer.build((None, 4, 4, 3))
    outside = np.array([3.0, -4.0, 12.0], "float32")  # norm 13
    expected = outside.astype(np.float64) * 0.5 / 13.0
    with keras.StatelessScope():
        jitted = np.asarray(jax.jit(layer.projected_values)(jnp.asarray(outside)))
    layer.bias.assign(outside)
    layer.project()
    for projected in (np.asarray(layer.bias.value), jitted):
        np.testing.assert_allclose(projected, expected, rtol=1e-6)
        assert np.linalg.norm(projected.astype(np.float64)) <= 0.5 * (1 + 2**-23)
    inside = np.array([0.1, -0.2, 0.0], "float32")
    np.testing.assert_array_equal(np.asarray(l2_ball_projection(inside, 0.5)), inside)


def test_front_end_features_on_jax():
    """lipdp.clipless.features on JAX: the weightless front-end applied in jitted batches
    equals its eager call, and the public bound is the bound pass's (no call involved)."""
    from lipdp.clipless.features import apply_front_end, front_end_bound

    x = np.random.default_rng(0).normal(size=(5, 8, 8, 1)).astype("float32")
    scattering = L.DP_ScatteringTransform(J=2, L=3, padding="zeros")
    features = apply_front_end([scattering], x, batch_size=2)
    np.testing.assert_allclose(features, np.asarray(scattering(x)), rtol=1e-6, atol=1e-7)
    bounded = L.DP_BoundedInput(input_shape=(8, 8, 1), upper_bound=2.0)
    assert front_end_bound([bounded, scattering]) == pytest.approx(2.0 * scattering.lipschitz)


def test_group_sort_gradient_is_a_permutation_at_ties():
    # x = 0: every pair tied. A min/max GroupSort sends both cotangents of a pair to one
    # channel (norm sqrt(2) ||g|| for g = (1, 1)); the permutation keeps ||g||.
    # The layer's own call (ops.sort on the groups on JAX), eager and under jax.jit.
    x = jnp.zeros((1, 8))
    g = jnp.ones((1, 8))
    for n in (2, 4):
        layer = L.DP_GroupSort(n)
        layer.build((None, 8))
        for fn in (layer, jax.jit(layer.__call__)):
            _, pullback = jax.vjp(fn, x)
            norm = float(jnp.linalg.norm(pullback(g)[0]))
            assert norm == pytest.approx(float(jnp.linalg.norm(g)))
