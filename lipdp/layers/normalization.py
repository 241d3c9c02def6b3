"""Normalisation without batch statistics (rule S2: no coupling between examples)."""

from __future__ import annotations

import tensorflow as tf

from lipdp.layers.base import NonExpansiveLayer, register


@register
class DP_LayerCentering(tf.keras.layers.Layer, NonExpansiveLayer):
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
        return inputs - tf.reduce_mean(inputs, axis=axes, keepdims=True)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(pixelwise=self.pixelwise, channelwise=self.channelwise)
        return config
