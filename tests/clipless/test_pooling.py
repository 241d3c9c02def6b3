"""L2-norm pooling on TensorFlow: the fused path (two XLA kernels) against numpy."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.foundation import compat

pytestmark = pytest.mark.skipif(
    compat.keras_backend() != "tensorflow", reason="the fused path is TensorFlow's"
)


def _numpy_pool(x, pool, eps, g):
    """Output ``sqrt(s + eps) - sqrt(eps)`` per whole window and the input gradient of
    ``sum(y * g)``, ``x g / sqrt(s + eps)`` on every position of a window (float64)."""
    b, h, w, c = x.shape
    ph, pw = pool
    windows = x.astype("float64").reshape(b, h // ph, ph, w // pw, pw, c)
    root = np.sqrt((windows**2).sum(axis=(2, 4)) + eps)
    grad = windows * (g / root)[:, :, None, :, None, :]
    return root - np.sqrt(eps), grad.reshape(x.shape)


@pytest.mark.parametrize(
    ("shape", "pool", "padding"),
    [
        ((3, 8, 6, 4), (2, 2), "valid"),
        ((2, 9, 6, 3), (3, 2), "same"),
        ((2, 4, 4, 64), (2, 2), "valid"),
    ],
)
def test_fused_l2_pooling_matches_numpy(shape, pool, padding):
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype("float32")
    x[0, : pool[0], : pool[1]] = 0.0  # a zero window: output 0, gradient 0
    layer = L.DP_ScaledL2NormPooling2D(pool, padding=padding)
    layer.build(shape)
    assert layer._fused(shape)  # the path under test
    out_shape = (shape[0], shape[1] // pool[0], shape[2] // pool[1], shape[3])
    g = rng.normal(size=out_shape).astype("float32")
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt)
        objective = tf.reduce_sum(y * g)
    want_y, want_grad = _numpy_pool(x, pool, layer.eps, g)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tape.gradient(objective, xt), want_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[0, 0, 0], 0.0)


def test_partial_windows_take_the_generic_path():
    layer = L.DP_ScaledL2NormPooling2D(2, padding="same")
    layer.build((2, 5, 5, 3))
    assert not layer._fused((2, 5, 5, 3))
    y = layer(tf.ones((2, 5, 5, 3)))
    assert y.shape == (2, 3, 3, 3)
    # the corner window of the padded input holds one pixel: sqrt(1 + eps) - sqrt(eps)
    np.testing.assert_allclose(y[0, 2, 2], np.sqrt(1 + layer.eps) - np.sqrt(layer.eps), rtol=1e-6)
