"""A bias kept in a Euclidean ball."""

from __future__ import annotations

import math

import keras

from lipdp.clipless.layers.base import DPLayer, register, validate_nm_coef
from lipdp.foundation import compat, validation


@register
class DP_AddBias(keras.layers.Layer, DPLayer):
    """Adds a bias ``b`` (one value per channel) with ``||b|| <= norm_max``.

    The bias is broadcast over the ``m`` positions of the example (``m`` is the
    product of the non-batch, non-channel dimensions; 1 for vectors), so the
    added vector has norm ``sqrt(m) ||b||`` and the gradient of the bias sums the
    cotangent over positions:

    * output bound: ``X + sqrt(m) * norm_max``;
    * cotangent bound: ``G`` (the map is a translation);
    * parameter bound: ``||sum_p g_p|| <= sum_p ||g_p|| <= sqrt(m) ||g||``, so
      ``sqrt(m) * G``.

    (The original lip-dp used ``X + norm_max`` and ``G`` regardless of ``m``,
    which under-estimates both when the bias follows a convolution.)
    ``b`` is projected onto the ball after every step (exact projection).
    """

    def __init__(self, norm_max, nm_coef=1.0, **kwargs):
        super().__init__(**kwargs)
        self.norm_max = validation.positive("DP_AddBias norm_max", norm_max)
        self.nm_coef = validate_nm_coef(nm_coef)

    def build(self, input_shape):
        self.positions = math.prod(int(d) for d in input_shape[1:-1])
        self.bias = self.add_weight(
            name="bias", shape=(int(input_shape[-1]),), initializer="zeros", trainable=True
        )
        super().build(input_shape)

    def call(self, inputs):
        return inputs + self.bias

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        return input_bound + math.sqrt(self._positions()) * self.norm_max

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def backpropagate_params(self, input_bound, gradient_bound):
        return math.sqrt(self._positions()) * gradient_bound

    def _positions(self):
        if not self.built:
            raise RuntimeError(f"{self.name}: build the model before computing bounds.")
        return self.positions

    def has_parameters(self):
        return bool(self.trainable)

    def project(self):
        if self.trainable:
            self.bias.assign(self.projected_values(self.bias))

    def projected_values(self, bias):
        """The projection of ``bias`` (a value, not the variable) onto the ball: a pure
        function, which a jit-compiled step applies to its new trainable values."""
        return l2_ball_projection(bias, self.norm_max)

    def get_config(self):
        config = super().get_config()
        config.update(norm_max=self.norm_max, nm_coef=self.nm_coef)
        return config


def l2_ball_projection(vector, radius):
    """Exact Euclidean projection onto the ball ``||v|| <= radius``: ``v * radius /
    max(||v||, radius)``, written with :func:`lipdp.foundation.compat.array_ops` so that it
    runs on every backend and under ``jax.jit``. It is ``tf.clip_by_norm``'s formula, op
    for op (the norm through a ``where`` so that its gradient at 0 is finite), so the
    TensorFlow numbers are those of ``tf.clip_by_norm``. The result has norm at most
    ``radius`` up to one rounding of the final product (rule S4 for the bias is the bound
    ``X + sqrt(m) * norm_max``; a relative excess of a float32 ulp is within the
    round-off slack of the sensitivity)."""
    ops = compat.array_ops()
    squared = ops.sum(vector * vector, keepdims=True)
    positive = squared > 0
    safe = ops.where(positive, squared, ops.ones_like(squared))
    norm = ops.where(positive, ops.sqrt(safe), squared)
    return (vector * radius) / ops.maximum(norm, radius)
