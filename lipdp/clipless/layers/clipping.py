"""Clipping the per-example cotangent: identity forward, clipped backward."""

from __future__ import annotations

import keras

from lipdp.clipless import projections
from lipdp.clipless.layers.base import NonExpansiveLayer, register
from lipdp.foundation import compat, validation
from lipdp.foundation.variables import state_variable

MODES = ("fixed", "dynamic")


def clipped_cotangent(cotangent, clip_value, normalizer=None):
    """Each row of ``cotangent`` clipped to norm ``clip_value / n`` (``n``: ``normalizer``,
    the rows of the batch when ``None``): the backward rule of :func:`_clip_cotangent`,
    written once for every backend (:func:`lipdp.clipless.projections.clip_by_norm` over
    the non-batch axes, the operations of ``tf.clip_by_norm``)."""
    ops = compat.array_ops()
    if normalizer is None:
        b = ops.cast(ops.shape(cotangent)[0], cotangent.dtype)
    else:
        b = ops.cast(normalizer, cotangent.dtype)
    axes = tuple(range(1, len(cotangent.shape)))
    return projections.clip_by_norm(cotangent, ops.cast(clip_value, cotangent.dtype) / b, axes)


def _clip_cotangent(inputs, clip_value, normalizer=None):
    """Identity whose backward pass clips each row's cotangent to ``clip_value / n``.

    The loss is the sum of per-row losses divided by ``n``, the loss normaliser
    (:attr:`lipdp.foundation.metadata.DatasetMetadata.loss_normalizer`: the rows of a batch, the
    expected batch size under Poisson sampling), so the cotangent of row ``i`` is
    ``g_i / n`` with ``g_i`` the gradient of its own loss; clipping ``g_i / n`` at
    ``C / n`` is clipping ``g_i`` at ``C``. ``normalizer=None`` uses the number of rows
    of the batch.

    The rule is :func:`clipped_cotangent`; only the custom-gradient decorator depends on
    the backend (a hook): ``tf.custom_gradient`` on TensorFlow, ``jax.custom_vjp`` on JAX
    (:func:`lipdp.clipless.jax.gradients.with_clipped_cotangent`, where ``clip_value`` is an
    argument whose value comes from the step's state, with cotangent 0).
    """
    if compat.keras_backend() == "jax":
        from lipdp.clipless.jax.gradients import with_clipped_cotangent

        value = getattr(clip_value, "value", clip_value)  # a Keras variable: its (scoped) value
        return with_clipped_cotangent(inputs, value, normalizer, clipped_cotangent)
    import tensorflow as tf

    @tf.custom_gradient
    def clip(x):
        def grad(dy):
            if isinstance(dy, tf.IndexedSlices):  # as tf.clip_by_norm: clip the values' rows
                rows = dy.dense_shape[0] if normalizer is None else normalizer
                values = clipped_cotangent(dy.values, clip_value, rows)
                return tf.IndexedSlices(values, dy.indices, dy.dense_shape)
            return clipped_cotangent(dy, clip_value, normalizer)

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
        return _clip_cotangent(inputs, self.clip_value, loss_normalizer)

    def compute_output_shape(self, input_shape):
        return input_shape

    def backpropagate_inputs(self, input_bound, gradient_bound):
        ops = compat.array_ops()
        return ops.minimum(ops.cast(gradient_bound, "float32"), self.clip_value)

    def propagate_lipschitz(self, input_bound, lipschitz):
        # Identity forward: clipping is a property of training, not of the function.
        return lipschitz

    def get_config(self):
        config = super().get_config()
        config.update(clip_value=float(self.clip_value.numpy()), mode=self.mode)
        return config
