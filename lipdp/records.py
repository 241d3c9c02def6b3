"""Rule S9 in one place: which examples of a batch hold a NaN or an infinity.

Imports nothing else of lipdp, so that the input layer, the losses and the training step
all use the same test.
"""

from __future__ import annotations

import tensorflow as tf


def finite_rows(values):
    """``(batch,)`` booleans: every entry of the example is finite (not NaN, not inf).
    Non-floating tensors (integer labels) are finite."""
    values = tf.convert_to_tensor(values)
    if not values.dtype.is_floating:
        return tf.ones(tf.shape(values)[:1], dtype=tf.bool)
    flat = tf.reshape(values, tf.stack([tf.shape(values)[0], -1]))
    return tf.reduce_all(tf.math.is_finite(flat), axis=1)


def zero_rows(keep, values):
    """``values`` with the examples where ``keep`` is False replaced by zeros."""
    shape = tf.concat([tf.shape(keep), tf.ones([tf.rank(values) - 1], tf.int32)], axis=0)
    mask = tf.broadcast_to(tf.reshape(keep, shape), tf.shape(values))
    return tf.where(mask, values, tf.zeros_like(values))


__all__ = ["finite_rows", "zero_rows"]
