"""1-Lipschitz activations.

Both map 0 to 0 and are 1-Lipschitz, hence ``X -> X`` and ``G -> G``
(:class:`~lipdp.layers.base.NonExpansiveLayer`).
"""

from __future__ import annotations

import deel.lip.layers
import tensorflow as tf

from lipdp.layers.base import NonExpansiveLayer, register


@register
class DP_GroupSort(deel.lip.layers.GroupSort, NonExpansiveLayer):
    """Sorts the channels by groups of ``n`` (deel-lip's GroupSort).

    A permutation of the coordinates inside each group: the output norm equals
    the input norm, and the Jacobian is a permutation matrix almost everywhere,
    so the layer is gradient-norm preserving.
    """

    def __init__(self, n=2, **kwargs):
        if kwargs.pop("k_coef_lip", 1.0) != 1.0:
            raise ValueError("DP_GroupSort is 1-Lipschitz by construction; k_coef_lip must be 1.")
        super().__init__(n=n, **kwargs)


@register
class DP_ReLU(tf.keras.layers.ReLU, NonExpansiveLayer):
    """ReLU, optionally leaky (``|negative_slope| <= 1``) or capped (``max_value``).

    With threshold 0 and ``|negative_slope| <= 1`` each coordinate satisfies
    ``|f(a) - f(b)| <= |a - b|`` and ``f(0) = 0``. A non-zero threshold breaks
    ``|f(a)| <= |a|`` and is refused.
    """

    def __init__(self, max_value=None, negative_slope=0.0, threshold=0.0, **kwargs):
        if threshold != 0.0:
            raise ValueError("DP_ReLU requires threshold=0 (otherwise ||f(x)|| <= ||x|| fails).")
        if abs(negative_slope) > 1.0:
            raise ValueError("DP_ReLU requires |negative_slope| <= 1 to stay 1-Lipschitz.")
        if max_value is not None and max_value < 0:
            raise ValueError("DP_ReLU requires max_value >= 0.")
        super().__init__(max_value=max_value, negative_slope=negative_slope, **kwargs)
