"""Per-example input-norm bounds: the ``X`` of every sensitivity computation.

A bound function rescales each example of a *batch* so that its Euclidean norm (over
all non-batch axes) is at most a public bound; :func:`bound_clip_value` and
:func:`bound_normalize` build one, together with the bound it guarantees. The image
and tabular pipelines accept such a ``(fn, bound)`` pair, or a number, as their
``bound_fct`` argument and record the bound as ``DatasetMetadata.max_norm``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lipdp.foundation.validation import positive

#: Relative margin below the target norm used by the bound functions, and above the
#: exact bound by :func:`~lipdp.data.images.colorspace_max_norm`: rounding a float64
#: result to float32 changes each coordinate by a relative 2**-24 at most, so a float32
#: example rescaled in float64 to ``(1 - ROUNDING_MARGIN) * bound`` has a norm
#: ``<= bound`` exactly.
ROUNDING_MARGIN = 2.0**-20


def _per_example_norms(x: tf.Tensor) -> tf.Tensor:
    """Euclidean norm of each example (over all non-batch axes), broadcastable to ``x``."""
    if x.shape.rank is None or x.shape.rank < 1:
        raise ValueError("bound functions expect a batch: a tensor of rank >= 1.")
    axes = list(range(1, x.shape.rank))
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axes, keepdims=True))


def _rescale(x, target, only_shrink):
    """Examples of ``x`` rescaled to norm ``target`` (or left alone if already below
    and ``only_shrink``), computed in float64 with :data:`ROUNDING_MARGIN`."""
    x = tf.convert_to_tensor(x)
    wide = tf.cast(x, tf.float64)
    norms = _per_example_norms(wide)
    scale = tf.math.divide_no_nan(tf.constant(target * (1.0 - ROUNDING_MARGIN), tf.float64), norms)
    if only_shrink:
        scale = tf.where(norms > target, scale, tf.ones_like(scale))
    return tf.cast(wide * scale, x.dtype)


def bound_clip_value(value):
    """``(fn, value)``: ``fn`` scales every example whose norm exceeds ``value`` down to
    norm ``value`` (others are unchanged).

    ``fn`` takes a *batch* (axis 0 indexes examples; the norm is over all other axes)
    and returns it clipped; called as ``fn(x, y, ...)`` it returns ``(fn(x), y, ...)``
    so that it can be mapped over a batched ``tf.data`` pipeline (never over single
    examples: their first axis would be taken as the batch). Clipped examples get the
    norm ``value * (1 - ROUNDING_MARGIN)``, so that norms are ``<= value`` even after
    rounding to float32.
    """
    value = positive("value", value)

    def clip(x, *rest):
        clipped = _rescale(x, value, only_shrink=True)
        return (clipped, *rest) if rest else clipped

    return clip, value


def bound_normalize():
    """``(fn, 1.0)``: ``fn`` divides each example of a batch by its norm (examples of
    norm 0 stay 0; norms become ``1 - ROUNDING_MARGIN``); same calling convention as
    :func:`bound_clip_value`."""

    def normalize(x, *rest):
        out = _rescale(x, 1.0, only_shrink=False)
        return (out, *rest) if rest else out

    return normalize, 1.0


def _parse_bound_fct(bound_fct):
    """``None``, a number (clip to it) or a ``(fn, bound)`` pair -> ``(fn, bound)``."""
    if bound_fct is None:
        return None, None
    if isinstance(bound_fct, (int, float, np.floating, np.integer)) and not isinstance(
        bound_fct, bool
    ):
        return bound_clip_value(bound_fct)
    if isinstance(bound_fct, (tuple, list)) and len(bound_fct) == 2 and callable(bound_fct[0]):
        return bound_fct[0], positive("the bound of bound_fct", bound_fct[1])
    raise TypeError(
        "bound_fct must be None, a positive number, or a (fn, bound) pair such as "
        f"bound_clip_value(1.0) or bound_normalize(); got {bound_fct!r}."
    )


__all__ = ["ROUNDING_MARGIN", "bound_clip_value", "bound_normalize"]
