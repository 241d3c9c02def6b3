"""Why lipdp does not reuse some deel-lip / lip-dp pieces as they are (rules S1-S3).

Each test measures the problem on the upstream component and checks that the lipdp
counterpart does not have it. Other findings are tested where the lipdp side lives:
the stride-1 convolution factor in ``test_projections.py``, the KR/HKR batch
coupling and the KCosine constant in ``test_losses.py``.
"""

import math

import deel.lip.layers as deel_lip_layers
import numpy as np
import pytest
import tensorflow as tf
from deel.lip.layers import SpectralDense

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation import compat
from lipdp.foundation.metadata import DatasetMetadata
from tests.soundness import measure


def _max_kernel_gradient(layer, n, trials=100):
    """max ||d <g, layer(x)> / d kernel|| over unit x and unit g (the bound is 1)."""
    worst = 0.0
    for _ in range(trials):
        x = tf.math.l2_normalize(tf.random.normal((1, n)), axis=-1)
        g = tf.math.l2_normalize(tf.random.normal((1, n)), axis=-1)
        with tf.GradientTape() as tape:
            objective = tf.reduce_sum(layer(x, training=True) * g)
        worst = max(worst, float(tf.norm(tape.gradient(objective, layer.kernel))))
    return worst


@pytest.mark.skipif(
    compat.keras_3(),
    reason="deel-lip 1.5.0's SpectralDense cannot be built on Keras 3: its build() calls "
    "kernel.read_value(), which Keras 3 variables do not have (AttributeError); lipdp's side "
    "runs on both Keras (test_lipdp_spectral_dense_gradient_is_bounded_rule_s3)",
)
def test_in_graph_reparametrisation_amplifies_gradients_rule_s3():
    """deel-lip's SpectralDense normalises the kernel inside the graph: the gradient
    w.r.t. the stored variable scales like 1 / sigma(kernel), unbounded when the stored
    kernel drifts away from norm 1. lipdp differentiates w.r.t. the kernel used."""
    n = 16
    upstream = SpectralDense(n, use_bias=False)
    upstream.build((None, n))
    upstream.kernel.assign(upstream.kernel * 0.1)
    amplified = _max_kernel_gradient(upstream, n)
    assert amplified > 5.0  # ~ 7.07 = 0.707 / 0.1


def test_lipdp_spectral_dense_gradient_is_bounded_rule_s3():
    """lipdp's counterpart of the finding above: the gradient w.r.t. the kernel the layer
    uses is bounded by ``X * G`` (here 1)."""
    n = 16
    ours = L.DP_SpectralDense(n)
    ours.build((None, n))
    assert _max_kernel_gradient(ours, n) <= 1.0 + 1e-6


def test_add_bias_counts_spatial_positions_rule_s1():
    """lip-dp's DP_AddBias declared ``X + norm_max`` and ``G``: after a convolution the
    bias is added at every position, so both are too small by sqrt(h * w)."""
    bias = L.DP_AddBias(norm_max=1.0)
    bias.build((None, 4, 4, 3))
    bias.bias.assign([1.0, 0.0, 0.0])
    x = tf.zeros((1, 4, 4, 3))
    out_norm = float(tf.norm(bias(x)))
    upstream_output_bound = 0.0 + 1.0  # X + norm_max with X = 0
    assert out_norm == pytest.approx(4.0) and out_norm > upstream_output_bound
    assert bias.propagate_inputs(0.0) == pytest.approx(out_norm)
    g = tf.ones((1, 4, 4, 3)) / math.sqrt(48.0)  # unit cotangent, aligned across positions
    with tf.GradientTape() as tape:
        objective = tf.reduce_sum(bias(x) * g)
    grad_norm = float(tf.norm(tape.gradient(objective, bias.bias)))
    assert grad_norm > 1.0 + 1e-3  # the upstream parameter bound G = 1 is exceeded
    assert grad_norm <= bias.backpropagate_params(0.0, 1.0) * (1 + 1e-6)


def test_lambda_requires_stated_constants():
    """lip-dp's DP_Lambda treated any function as gradient-norm preserving."""
    doubling = L.DP_Lambda(lambda t: 2.0 * t, lipschitz_constant=2.0, output_gain=2.0)
    assert doubling.propagate_inputs(1.0) == 2.0
    assert doubling.backpropagate_inputs(1.0, 1.0) == 2.0


class _UpstreamGroupSort(L.DP_GroupSort):
    """DP_GroupSort's bounds, computed by a deel-lip GroupSort (min/max autodiff)."""

    def build(self, input_shape):
        self.upstream = deel_lip_layers.GroupSort(self.n)
        self.upstream.build(input_shape)
        super().build(input_shape)

    def call(self, x):
        return self.upstream(x)


def _tied_pair_model(group_sort):
    """x = (1, 0) -> W1 = [[1, 1], [1, -1]] / sqrt(2) gives the tied pair (1, 1) / sqrt(2);
    W2 = diag(1, -1) maps the logit gradient tau-CE sends back, ~(1, -1), to (1, 1)."""
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(2,), upper_bound=1.0),
            L.DP_SpectralDense(2),
            group_sort,
            L.DP_SpectralDense(2),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=DatasetMetadata(
            input_shape=(2,), nb_classes=2, nb_samples_train=10, batch_size=1
        ),
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(tau=32.0), optimizer="sgd")
    model.build((None, 2))
    first, second = (layer for layer in model.dp_layers if hasattr(layer, "kernel"))
    first.kernel.assign(np.array([[1.0, 1.0], [1.0, -1.0]], "float32") / math.sqrt(2.0))
    second.kernel.assign(np.diag([1.0, -1.0]).astype("float32"))
    return model


def test_group_sort_gradient_at_ties_rule_s1():
    """At a tie, autodiff through deel-lip's minimum/maximum sends both cotangents of a
    pair to its first channel: (g1 + g2, 0), up to sqrt(2) ||g||. The per-example
    gradient of the layer before it then exceeds the declared bound by sqrt(2). lipdp's
    GroupSort backpropagates a permutation of the cotangent, ties included."""
    x = np.array([[1.0, 0.0]], "float32")
    y = np.array([[0.0, 1.0]], "float32")  # softmax(32 * logits) ~ (1, 0): gradient ~ tight
    # Named: Keras 3 refuses the name derived from the class ('__upstream...') in a graph.
    upstream = measure(_tied_pair_model(_UpstreamGroupSort(2, name="upstream")), x, y)
    assert upstream.worst_gradient > 1.4  # sqrt(2) x the bound
    ours = measure(_tied_pair_model(L.DP_GroupSort(2)), x, y)
    ours.assert_sound()
    assert ours.worst_gradient > 0.99  # the same example is tight, not degenerate


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_group_sort_matches_deel_lip_and_is_a_permutation(n, jit_compile):
    """Outputs and gradients bit-identical to deel-lip's where the inputs have no ties;
    with ties (zeros, repeated values) the input gradient is a permutation of the
    cotangent (same sorted values, same norm)."""
    rng = np.random.default_rng(n)
    layer = L.DP_GroupSort(n, jit_compile=jit_compile)
    upstream = deel_lip_layers.GroupSort(n)
    x = tf.constant(rng.normal(size=(4, 3, 3, 12)), tf.float32)
    g = tf.constant(rng.normal(size=(4, 3, 3, 12)), tf.float32)
    for layer_fn in (layer, upstream):
        layer_fn.build(x.shape)
    grads = []
    outputs = []
    for fn in (layer, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = fn(x)
            objective = tf.reduce_sum(out * g)
        outputs.append(out)
        grads.append(tape.gradient(objective, x))
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_array_equal(grads[0], grads[1])

    tied = tf.constant(rng.integers(-1, 2, size=(4, 3, 3, 12)), tf.float32)  # many ties
    with tf.GradientTape() as tape:
        tape.watch(tied)
        objective = tf.reduce_sum(layer(tied) * g)
    grad = tape.gradient(objective, tied)
    groups = (-1, n)
    np.testing.assert_array_equal(
        np.sort(np.reshape(grad, groups), axis=1), np.sort(np.reshape(g, groups), axis=1)
    )


@pytest.mark.parametrize("channels", [2, 12, 64, 128])
def test_xla_pair_sort_forms_are_the_exact_permutation(channels):
    """Both XLA forms of the pair sort (the swapped copy below
    PAIRED_VIEW_MIN_CHANNELS channels, the (-1, 2) view from there on) against numpy:
    every pair (a, b) becomes (b, a) when a > b and stays otherwise (a tie stays), and
    the input gradient is the cotangent permuted the same way -- bit for bit, on inputs
    full of ties; and the same as the graph version, sort_pairs."""
    from lipdp.clipless.layers.activations import sort_pairs, sort_pairs_xla

    rng = np.random.default_rng(channels)
    shape = (3, 2, 5, channels)
    x = rng.integers(-2, 3, size=shape).astype("float32") / 2.0  # many ties, exact values
    x[0] = rng.normal(size=shape[1:])
    g = rng.normal(size=shape).astype("float32")
    a, b = x[..., 0::2], x[..., 1::2]
    swap = a > b
    want_y, want_g = np.empty_like(x), np.empty_like(g)
    want_y[..., 0::2], want_y[..., 1::2] = np.where(swap, b, a), np.where(swap, a, b)
    ga, gb = g[..., 0::2], g[..., 1::2]
    want_g[..., 0::2], want_g[..., 1::2] = np.where(swap, gb, ga), np.where(swap, ga, gb)
    for fn in (sort_pairs_xla, sort_pairs, tf.function(sort_pairs_xla)):
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = fn(xt)
            objective = tf.reduce_sum(y * g)
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(tape.gradient(objective, xt), want_g)


def test_group_sort_config_round_trip():
    layer = L.DP_GroupSort(2, jit_compile=False)
    clone = L.DP_GroupSort.from_config(layer.get_config())
    assert clone.n == 2 and clone.jit_compile is False
    with pytest.raises(ValueError, match="jit_compile"):
        L.DP_GroupSort(2, jit_compile="yes")


def test_group_sort_reads_the_configuration_saved_when_it_derived_from_deel_lip():
    """The configuration a model saved before lipdp wrote its own GroupSort (deel-lip's keys
    plus ``jit_compile``) builds the same layer; ``n=None`` sorts all channels; a group size
    that does not divide the channels, another data format or another Lipschitz factor is
    refused."""
    saved = {
        "name": "dp__group_sort",
        "trainable": True,
        "dtype": "float32",
        "n": 4,
        "k_coef_lip": 1.0,
        "data_format": "channels_last",
        "jit_compile": None,
    }
    layer = L.DP_GroupSort.from_config(saved)
    assert (layer.n, layer.jit_compile, layer.name) == (4, None, "dp__group_sort")
    config = layer.get_config()
    # Keras 3 writes the dtype as a DTypePolicy configuration instead of its name.
    assert layer.dtype == "float32"
    assert {k: config[k] for k in saved if k != "dtype"} == {
        k: v for k, v in saved.items() if k != "dtype"
    }
    x = np.random.default_rng(0).normal(size=(3, 8)).astype("float32")
    np.testing.assert_array_equal(L.DP_GroupSort(None)(x), np.sort(x, axis=-1))
    np.testing.assert_array_equal(layer(x), np.sort(x.reshape(3, 2, 4), axis=-1).reshape(3, 8))
    with pytest.raises(ValueError, match="n=3 must divide the 8 channels"):
        L.DP_GroupSort(3)(x)
    with pytest.raises(ValueError, match="channels_last"):
        L.DP_GroupSort(2, data_format="channels_first")
    with pytest.raises(ValueError, match="k_coef_lip must be 1"):
        L.DP_GroupSort(2, k_coef_lip=2.0)
