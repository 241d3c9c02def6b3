"""Normalisation without batch statistics (rule S2: no coupling between examples)."""

from __future__ import annotations

import math

import keras
import numpy as np

from lipdp.clipless.layers.base import DPLayer, NonExpansiveLayer, register
from lipdp.foundation import compat, validation


@register
class DP_LayerCentering(keras.layers.Layer, NonExpansiveLayer):
    """Subtract, for each example, the mean over some axes.

    ``x -> x - mean(x)`` is the orthogonal projection onto the vectors with zero
    mean along those axes: linear, of operator norm 1, so ``X -> X``, ``G -> G``.
    Statistics are per example; nothing is shared across the batch and there is no
    scaling (dividing by a data-dependent standard deviation is not Lipschitz).

    For image inputs ``(batch, h, w, c)``:

    * ``channelwise=True`` (default): for each pixel, mean over the channels;
    * ``pixelwise=True``: for each channel, mean over the positions;
    * both ``False``: mean over all coordinates.

    Other ranks: mean over all non-batch axes.
    """

    def __init__(self, pixelwise=False, channelwise=True, **kwargs):
        super().__init__(**kwargs)
        if pixelwise and channelwise:
            raise ValueError("DP_LayerCentering: choose pixelwise or channelwise, not both.")
        self.pixelwise = bool(pixelwise)
        self.channelwise = bool(channelwise)

    def _axes(self, rank):
        if rank == 4 and self.channelwise:
            return [3]
        if rank == 4 and self.pixelwise:
            return [1, 2]
        return list(range(1, rank))

    def call(self, inputs):
        axes = self._axes(len(inputs.shape))
        return inputs - compat.array_ops().mean(inputs, axis=axes, keepdims=True)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(pixelwise=self.pixelwise, channelwise=self.channelwise)
        return config


@register
class DP_GroupNormalization(keras.layers.Layer, DPLayer):
    r"""Lip-DP-SGD's group normalisation: ``(x_q - mu_q) / max(alpha, sigma_q)``.

    The channels (last axis) are split into ``groups`` contiguous groups; group ``q`` of
    one example holds its channels at every position (``n_q`` values). ``mu_q`` and
    ``sigma_q = sqrt(mean((x_q - mu_q)^2))`` are that example's statistics: nothing is
    shared across the batch (rule S2), and there are no trainable parameters.

    Bounds (Barczewski & Ramon, Eq. 2 and Table 2; derivation here). Write
    ``z = x_q - mu_q`` (an orthogonal projection of ``x_q``, so ``||z|| <= ||x_q||``) and
    ``r = alpha sqrt(n_q)``. Since ``sigma_q = ||z|| / sqrt(n_q)``, the map is
    ``z -> z / alpha`` for ``||z|| <= r`` and ``z -> sqrt(n_q) z / ||z||`` beyond, i.e.
    ``(1 / alpha) * P(z)`` with ``P`` the Euclidean projection onto the ball of radius
    ``r``. A projection onto a convex set is 1-Lipschitz, so each group is
    ``1/alpha``-Lipschitz and so is the layer (groups are disjoint blocks):

    * cotangent bound ``G -> G / alpha``;
    * output bound: ``||out_q|| = min(||z|| / alpha, sqrt(n_q))``, summed over groups
      ``||out||^2 <= min(X^2 / alpha^2, N)``: ``X -> min(X / alpha, sqrt(N))`` with ``N``
      the number of values per example. The ``sqrt(N)`` cap does not depend on the input:
      after this layer the bound no longer grows with the layers before it.

    ``max(alpha, sigma)`` is computed as ``sqrt(max(alpha^2, var))``, whose gradient is
    finite even for a constant group (``var = 0``), where ``sqrt`` alone would give NaN.

    Args:
        groups: number of groups; must divide the number of channels.
        alpha: the floor ``alpha > 0`` of the divisor (the layer is ``1/alpha``-Lipschitz).
            The paper searches ``alpha`` in ``[0.1 / n_q, 1 / n_q]``.
    """

    def __init__(self, groups=8, alpha=1.0, **kwargs):
        super().__init__(**kwargs)
        self.groups = validation.count("groups", groups, 1)
        self.alpha = validation.positive("alpha", alpha)
        self._values_per_example = None

    def build(self, input_shape):
        channels = int(input_shape[-1])
        if channels % self.groups:
            raise ValueError(
                f"{self.name}: groups={self.groups} must divide the {channels} channels; "
                f"choose a divisor of {channels}."
            )
        self._values_per_example = int(np.prod([int(d) for d in input_shape[1:]]))
        super().build(input_shape)

    def call(self, inputs):
        ops = compat.array_ops()
        channels = inputs.shape[-1]
        positions = math.prod(int(d) for d in inputs.shape[1:-1])
        grouped = ops.reshape(inputs, (-1, positions, self.groups, channels // self.groups))
        centred = grouped - ops.mean(grouped, axis=(1, 3), keepdims=True)
        variance = ops.mean(ops.square(centred), axis=(1, 3), keepdims=True)
        divisor = ops.sqrt(ops.maximum(variance, ops.cast(self.alpha**2, inputs.dtype)))
        return ops.reshape(centred / divisor, (-1, *inputs.shape[1:]))

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        if self._values_per_example is None:
            raise ValueError(f"{self.name}: build the model before computing bounds.")
        cap = math.sqrt(self._values_per_example)
        if input_bound is None:  # before DP_BoundedInput: nothing is bounded yet
            return None
        if isinstance(input_bound, (int, float)):
            return min(input_bound / self.alpha, cap)
        return compat.array_ops().minimum(input_bound / self.alpha, cap)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound / self.alpha

    def get_config(self):
        config = super().get_config()
        config.update(groups=self.groups, alpha=self.alpha)
        return config
