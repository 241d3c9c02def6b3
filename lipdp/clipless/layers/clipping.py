"""Clipping the per-example cotangent: identity forward, clipped backward."""

from __future__ import annotations

import keras
import tensorflow as tf

from lipdp.clipless.layers.base import NonExpansiveLayer, register
from lipdp.foundation import compat, validation
from lipdp.foundation.variables import state_variable

MODES = ("fixed", "dynamic")


def _clip_cotangent(inputs, clip_value, normalizer=None):
    """Identity whose backward pass clips each row's cotangent to ``clip_value / n``.

    The loss is the sum of per-row losses divided by ``n``, the loss normaliser
    (:attr:`lipdp.foundation.metadata.DatasetMetadata.loss_normalizer`: the rows of a batch, the
    expected batch size under Poisson sampling), so the cotangent of row ``i`` is
    ``g_i / n`` with ``g_i`` the gradient of its own loss; clipping ``g_i / n`` at
    ``C / n`` is clipping ``g_i`` at ``C``. ``normalizer=None`` uses the number of rows
    of the batch.
    """

    @tf.custom_gradient
    def clip(x):
        def grad(dy):
            if normalizer is None:
                b = tf.cast(tf.shape(dy)[0], dy.dtype)
            else:
                b = tf.cast(normalizer, dy.dtype)
            axes = list(range(1, len(dy.shape)))
            return tf.clip_by_norm(dy, tf.cast(clip_value, dy.dtype) / b, axes=axes)

        return tf.identity(x), grad

    return clip(inputs)


@register
class DP_ClipGradient(keras.layers.Layer, NonExpansiveLayer):
    """Per-example clipping of the loss gradient flowing backward through this layer.

    Forward: identity (``X -> X``). Backward: every example's cotangent has norm at
    most ``clip_value``, so ``G -> min(G, clip_value)``. Placed right after the
    logits it clips the gradient of the loss w.r.t. the logits (a vector of size
    ``classes`` per example: cheap), which tightens every bound upstream.

    Args:
        clip_value: the threshold ``C > 0`` (per-example scale).
        mode: ``"fixed"``, or ``"dynamic"`` when a callback of
            :mod:`lipdp.clipless.dynamic` updates ``clip_value`` privately during training.
    """

    def __init__(self, clip_value, mode="fixed", **kwargs):
        super().__init__(**kwargs)
        self.mode = validation.choice("mode", mode, MODES)
        clip_value = validation.positive("clip_value", clip_value)
        # A variable so that the in-graph bounds follow dynamic updates.
        self.clip_value = state_variable(float(clip_value), "float32", "clip_value")

    uses_loss_normalizer = True

    def call(self, inputs, loss_normalizer=None):
        """``loss_normalizer``: passed by the DP model it runs in (its metadata's)."""
        if compat.keras_backend() == "jax":  # prototype slice (lipdp.clipless.jax)
            from lipdp.clipless.jax import calls

            return calls.clip_cotangent(inputs, self.clip_value.value, loss_normalizer)
        return _clip_cotangent(inputs, self.clip_value, loss_normalizer)

    def compute_output_shape(self, input_shape):
        return input_shape

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return tf.minimum(tf.cast(gradient_bound, tf.float32), self.clip_value)

    def propagate_lipschitz(self, input_bound, lipschitz):
        # Identity forward: clipping is a property of training, not of the function.
        return lipschitz

    def get_config(self):
        config = super().get_config()
        config.update(clip_value=float(self.clip_value.numpy()), mode=self.mode)
        return config
