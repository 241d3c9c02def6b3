"""Pooling layers with non-overlapping windows.

L2-norm pooling replaces each window ``w`` by ``||x_w||``. We compute it as
``sqrt(||x_w||^2 + eps) - sqrt(eps)``: the value at 0 is exactly 0 (so the output
bound has no ``eps`` term), the value never exceeds ``||x_w||``, and the gradient
``x_w / sqrt(||x_w||^2 + eps)`` has norm below 1 and is defined at 0. Windows do
not overlap (strides == pool size), so summing over windows gives
``||y|| <= ||x||`` and a Jacobian of norm at most 1: ``X -> X``, ``G -> G``.
"""

from __future__ import annotations

import math

import keras

from lipdp.clipless.layers.base import NonExpansiveLayer, register
from lipdp.clipless.layers.fused import fused_kernels_allowed
from lipdp.foundation import compat, validation

_EPS = 1e-6


def _smooth_norm(squared_norm, eps):
    return compat.array_ops().sqrt(squared_norm + eps) - math.sqrt(eps)


def _check_disjoint_windows(name, pool_size, strides):
    if strides is not None and tuple(strides) != tuple(pool_size):
        raise ValueError(
            f"{name} requires strides == pool_size (non-overlapping windows); overlapping "
            f"windows count a pixel several times and break the 1-Lipschitz bound. Got "
            f"pool_size={tuple(pool_size)}, strides={tuple(strides)}."
        )


def _windows(x, pool_size):
    """``x`` (batch, h, w, c) viewed as (batch, h/ph, ph, w/pw, pw, c)."""
    import tensorflow as tf

    _, h, w, c = x.shape
    ph, pw = pool_size
    return tf.reshape(x, [-1, h // ph, ph, w // pw, pw, c])


def _l2_pool_forward(x, pool_size, eps):
    """``(y, r)``: ``r = sqrt(s + eps)`` with ``s`` each window's sum of squares, and
    ``y = r - sqrt(eps)``."""
    import tensorflow as tf

    squares = tf.reduce_sum(tf.square(_windows(x, pool_size)), axis=[2, 4])
    root = tf.sqrt(squares + eps)
    return root - math.sqrt(eps), root


def _l2_pool_backward(x, g, root, pool_size):
    """``dx = x g / r`` on every position of a window (the gradient of ``sqrt(s + eps)``,
    whose norm over a window is ``|g| ||x_w|| / sqrt(||x_w||^2 + eps) < |g|``)."""
    import tensorflow as tf

    scale = (g / root)[:, :, None, :, None, :]
    return tf.reshape(_windows(x, pool_size) * scale, tf.shape(x))


_XLA_POOL = {}


def l2_norm_pool_xla(x, pool_size, eps):
    """L2-norm pooling of whole windows on TensorFlow as two XLA kernels: forward (the
    window sums of squares by one reduction, then the smoothed root) and backward
    ``x g / r`` (one elementwise pass), with the custom gradient between them in the
    graph. The same function and gradient as the generic path (square, average pooling
    times the area, root; autodiff) up to float round-off in the order of the window sum
    (one or two ulps), in half the memory passes (``benchmarks/README.md``, "Where the
    private step's time goes")."""
    import tensorflow as tf

    if not _XLA_POOL:
        _XLA_POOL["forward"] = tf.function(_l2_pool_forward, jit_compile=True)
        _XLA_POOL["backward"] = tf.function(_l2_pool_backward, jit_compile=True)
    forward, backward = _XLA_POOL["forward"], _XLA_POOL["backward"]
    pool_size, eps = tuple(pool_size), float(eps)

    @tf.autograph.experimental.do_not_convert
    @tf.custom_gradient
    def pool(x):
        y, root = forward(x, pool_size, eps)
        return y, lambda g: backward(x, g, root, pool_size)

    return pool(x)


@register
class DP_ScaledL2NormPooling2D(keras.layers.Layer, NonExpansiveLayer):
    """L2-norm pooling over non-overlapping windows (module docstring).

    ``padding="same"`` pads with zeros, which adds nothing to any window norm. On
    TensorFlow, whole windows (the pool size dividing height and width, nothing padded)
    run as two XLA kernels, :func:`l2_norm_pool_xla`; partial windows and other backends
    run the generic path (square, average pooling times the area, root).
    """

    def __init__(self, pool_size=(2, 2), strides=None, padding="valid", eps=_EPS, **kwargs):
        super().__init__(**kwargs)
        self.pool_size = validation.int_pair("pool_size", pool_size)
        _check_disjoint_windows(
            type(self).__name__,
            self.pool_size,
            None if strides is None else validation.int_pair("strides", strides),
        )
        self.padding = validation.choice("padding", str(padding).lower(), ("valid", "same"))
        self.eps = validation.positive("eps", eps)

    def call(self, inputs):
        if fused_kernels_allowed() and self._fused(inputs.shape):
            return l2_norm_pool_xla(inputs, self.pool_size, self.eps)
        ops = compat.array_ops()
        squares = ops.square(inputs)
        if self.padding == "same":
            squares = ops.pad(squares, self._same_padding(inputs.shape))
        area = self.pool_size[0] * self.pool_size[1]
        # average over VALID windows times the area is the window sum (to round-off).
        sums = area * ops.average_pool(squares, self.pool_size, self.pool_size, "valid")
        return _smooth_norm(sums, self.eps)

    def _fused(self, shape) -> bool:
        """TensorFlow, whole windows only (``"valid"`` and the pool size dividing height
        and width): the two XLA kernels of :func:`l2_norm_pool_xla`."""
        return (
            compat.keras_backend() == "tensorflow"
            and len(shape) == 4
            and all(isinstance(size, int) for size in shape[1:])
            and shape[1] % self.pool_size[0] == 0
            and shape[2] % self.pool_size[1] == 0
            and (self.padding == "valid" or self._same_padding(shape) == [[0, 0]] * 4)
        )

    def _same_padding(self, shape):
        pads = [[0, 0]]
        for size, pool in zip(shape[1:3], self.pool_size):
            extra = (-size) % pool
            pads.append([extra // 2, extra - extra // 2])
        return pads + [[0, 0]]

    def compute_output_shape(self, input_shape):
        out = []
        for size, pool in zip(input_shape[1:3], self.pool_size):
            if size is None:
                out.append(None)
            else:
                out.append(-(-size // pool) if self.padding == "same" else size // pool)
        return (input_shape[0], *out, input_shape[3])

    def get_config(self):
        config = super().get_config()
        config.update(pool_size=self.pool_size, padding=self.padding, eps=self.eps)
        return config


@register
class DP_ScaledGlobalL2NormPooling2D(keras.layers.Layer, NonExpansiveLayer):
    """Per channel, the L2 norm over all positions: ``y_c = ||x_{:, :, c}||``.

    The output norm equals the input norm (up to the ``eps`` smoothing, which only
    lowers it): gradient-norm preserving.
    """

    def __init__(self, eps=_EPS, **kwargs):
        super().__init__(**kwargs)
        self.eps = validation.positive("eps", eps)

    def call(self, inputs):
        ops = compat.array_ops()
        return _smooth_norm(ops.sum(ops.square(inputs), axis=(1, 2)), self.eps)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config.update(eps=self.eps)
        return config


@register
class DP_MaxPool2D(keras.layers.MaxPool2D, NonExpansiveLayer):
    """Max pooling over non-overlapping windows.

    ``|max(x_w)| <= max_i |x_i| <= ||x_w||`` and the max is 1-Lipschitz for the
    infinity norm, hence for the Euclidean norm; disjoint windows sum up to
    ``||y|| <= ||x||``.
    """

    def __init__(self, pool_size=(2, 2), strides=None, padding="valid", **kwargs):
        _check_disjoint_windows(
            type(self).__name__,
            validation.int_pair("pool_size", pool_size),
            None if strides is None else validation.int_pair("strides", strides),
        )
        super().__init__(pool_size=pool_size, strides=None, padding=padding, **kwargs)
