"""Why lipdp does not reuse some deel-lip / lip-dp pieces as they are (rules S1-S3).

Each test measures the problem on the upstream component and checks that the lipdp
counterpart does not have it. Other findings are tested where the lipdp side lives:
the stride-1 convolution factor in ``test_projections.py``, the KR/HKR batch
coupling and the KCosine constant in ``test_losses.py``.
"""

import math

import pytest
import tensorflow as tf
from deel.lip.layers import SpectralDense

from lipdp import layers as L


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
