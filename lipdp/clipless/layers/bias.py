"""A bias kept in a Euclidean ball."""

from __future__ import annotations

import math

import keras

from lipdp.clipless import projections
from lipdp.clipless.layers.base import DPLayer, register, validate_nm_coef
from lipdp.foundation import validation


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
            self.bias.assign(projections.l2_ball_projection(self.bias, self.norm_max))

    def get_config(self):
        config = super().get_config()
        config.update(norm_max=self.norm_max, nm_coef=self.nm_coef)
        return config
