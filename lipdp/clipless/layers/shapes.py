"""Layers that only rearrange coordinates: the norm is unchanged, ``X -> X``, ``G -> G``."""

from __future__ import annotations

import keras

from lipdp.clipless.layers.base import NonExpansiveLayer, register


@register
class DP_Flatten(keras.layers.Flatten, NonExpansiveLayer):
    """Flatten (a permutation-free reshape)."""


@register
class DP_Reshape(keras.layers.Reshape, NonExpansiveLayer):
    """Reshape (same coordinates, other shape)."""


@register
class DP_Permute(keras.layers.Permute, NonExpansiveLayer):
    """Permutation of the non-batch axes."""
