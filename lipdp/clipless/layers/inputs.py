"""Input layers: where the bound ``X_0`` on the input norm comes from."""

from __future__ import annotations

import logging

import keras

from lipdp.clipless.layers.base import NonExpansiveLayer, register
from lipdp.core.records import finite_rows, zero_rows
from lipdp.foundation import compat, validation

logger = logging.getLogger(__name__)


@register
class DP_BoundedInput(keras.layers.Layer, NonExpansiveLayer):
    """Clips each example to Euclidean norm ``upper_bound`` (the public ``X_0``).

    Clipping ``x -> x * min(1, B / ||x||)`` is the projection onto a convex ball,
    hence 1-Lipschitz; every output has norm at most ``B``. A DP model must start
    with this layer (optionally preceded by :class:`DP_InputLayer`).

    Rule S9: an example with a NaN or an infinity anywhere is replaced by zeros (norm 0,
    inside the ball), so that its contribution stays within the bounds; ``tf.clip_by_norm``
    alone would pass a NaN through and turn an infinity into NaN. (A finite example is
    unchanged by this step; the map is no longer continuous at non-finite inputs, which
    are not points of the input space.)

    Args:
        upper_bound: the bound ``B > 0`` on the norm of one example.
        enforce_clipping: if False the input is not clipped and ``B`` becomes an
            *assumption* about the data (logged as a warning): the guarantee then
            holds only if every example really has norm at most ``B``.
    """

    def __init__(self, input_shape=None, upper_bound=None, enforce_clipping=True, **kwargs):
        if upper_bound is None:
            raise ValueError(
                "DP_BoundedInput needs upper_bound > 0 (got None): it is the public bound on "
                "the norm of one example."
            )
        upper_bound = validation.positive("DP_BoundedInput upper_bound", upper_bound)
        kwargs = compat.accept_batch_input_shape(kwargs)
        if input_shape is not None:
            kwargs["input_shape"] = tuple(input_shape)
        with compat.input_shape_accepted():
            super().__init__(**kwargs)
        self.upper_bound = float(upper_bound)
        self.enforce_clipping = bool(enforce_clipping)
        if not self.enforce_clipping:
            logger.warning(
                "DP_BoundedInput(enforce_clipping=False): the privacy guarantee assumes every "
                "example has norm <= %g; nothing enforces it.",
                self.upper_bound,
            )

    def call(self, inputs):
        inputs = zero_rows(finite_rows(inputs), inputs)  # also unclipped: NaN is never <= B
        if not self.enforce_clipping:
            return inputs
        return clip_rows(inputs, self.upper_bound)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        if input_bound is None:
            return self.upper_bound
        return min(self.upper_bound, input_bound)

    def get_config(self):
        config = super().get_config()
        config.update(upper_bound=self.upper_bound, enforce_clipping=self.enforce_clipping)
        config.update(compat.batch_input_shape_config(self))
        return config


def clip_rows(inputs, bound):
    """Each row ``x`` as ``x min(1, B / ||x||)``, without overflow for any finite row.

    ``tf.clip_by_norm`` forms ``x B`` and ``sum x^2``, which overflow for entries near the
    float32 limit (an entry of 3e38 gives ``inf / inf = NaN``). Here each row is divided by
    its largest magnitude ``s`` first: with ``u = x / s`` (entries in [-1, 1], ``||u|| <=
    sqrt(d)``) the output is ``u min(s, B / ||u||)``, the same function, whose norm
    ``min(||x||, B)`` is computed from finite numbers only; a zero row stays zero.
    Written with :func:`lipdp.foundation.compat.array_ops` (any backend, jit-safe).
    """
    ops = compat.array_ops()
    axes = tuple(range(1, len(inputs.shape)))
    scale = ops.max(ops.abs(inputs), axis=axes, keepdims=True)
    unit = inputs / ops.where(scale > 0, scale, ops.ones_like(scale))
    norm = ops.sqrt(ops.sum(ops.square(unit), axis=axes, keepdims=True))
    safe_norm = ops.where(norm > 0, norm, ops.ones_like(norm))
    return unit * ops.minimum(scale, ops.cast(bound, inputs.dtype) / safe_norm)


@register
class DP_InputLayer(keras.layers.Layer, NonExpansiveLayer):
    """Identity layer that only declares the input shape.

    It gives no bound: a :class:`DP_BoundedInput` must follow it.
    """

    def __init__(self, input_shape=None, **kwargs):
        kwargs = compat.accept_batch_input_shape(kwargs)
        if input_shape is not None:
            kwargs["input_shape"] = tuple(input_shape)
        with compat.input_shape_accepted():
            super().__init__(**kwargs)

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), **compat.batch_input_shape_config(self)}
