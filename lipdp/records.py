"""Rule S9 in one place: which examples of a batch cannot be trained on as they are.

Two kinds of rows are neutralised (they count zero in the step) instead of making the
contribution unbounded or the step fail -- which would reveal that the row was sampled:

* a row holding a NaN or an infinity (input or label): :func:`finite_rows`;
* a row whose class-index label is not a class of the predictions (``10`` or ``-1``
  with 10 classes, ``2.5``): :func:`labels_in_range`. TensorFlow's sparse
  cross-entropy raises on such a label, which would stop the whole step.

Imports nothing else of lipdp, so that the input layer, the losses and the training steps
all use the same tests.
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


def sparse_labels(labels, predictions) -> bool:
    """Whether ``labels`` are class indices into the last axis of ``predictions``, decided
    from the static shapes (at trace time): integer or floating labels whose rank is one
    less than the predictions' (``(b,)`` for ``(b, K)``, ``(b, T)`` for ``(b, T, K)``), or
    equal with a trailing dimension 1 (``(b, 1)`` for ``(b, K)``), predictions of rank >= 2.

    Labels of a single output (``K = 1``: binary or regression targets such as ``(b,)``
    for ``(b, 1)``) are values, not indices: :func:`labels_in_range` accepts them all
    (at run time when ``K`` is not known statically). Shapes of unknown rank are not
    classified (no check).
    """
    label_shape, prediction_shape = labels.shape, predictions.shape
    if label_shape.rank is None or prediction_shape.rank is None or prediction_shape.rank < 2:
        return False
    if not (labels.dtype.is_integer or labels.dtype.is_floating):
        return False
    if prediction_shape[-1] == 1:
        return False
    if label_shape.rank == prediction_shape.rank - 1:
        return True
    return label_shape.rank == prediction_shape.rank and label_shape[-1] == 1


def labels_in_range(labels, predictions, ignore_class=None):
    """``(batch,)`` booleans: the example's label can be used by a loss on ``predictions``.

    Labels that are not class indices (:func:`sparse_labels`, e.g. one-hot) always can.
    Class indices can iff every entry of the example is a whole number in ``[0, K)``, ``K``
    the predictions' last dimension (read at run time; ``K = 1``: always), or equals
    ``ignore_class`` (Keras' ``SparseCategoricalCrossentropy(ignore_class=...)`` gives such
    entries a zero loss itself). A NaN or an infinity is not in range. In-graph: no host
    synchronisation; only the predictions' shape is read, never their values.
    """
    labels = tf.convert_to_tensor(labels)
    predictions = tf.convert_to_tensor(predictions)
    rows = tf.shape(labels)[0]
    if not sparse_labels(labels, predictions):
        return tf.ones([rows], dtype=tf.bool)
    classes = tf.shape(predictions)[-1]
    # Wide types: an int64 comparison for integers (K may not fit uint8 labels), float64
    # for floats (exact for every float32 and float16 value).
    wide = tf.int64 if labels.dtype.is_integer else tf.float64
    values = tf.cast(tf.reshape(labels, tf.stack([rows, -1])), wide)
    entries = (values >= 0) & (values < tf.cast(classes, wide))
    if wide == tf.float64:
        entries &= tf.math.floor(values) == values
    if ignore_class is not None:
        entries |= values == tf.cast(ignore_class, wide)
    return tf.reduce_all(entries, axis=1) | (classes < 2)


def neutralised_losses(per_example, labels, predictions, ignore_class=None):
    """``per_example(labels, predictions)`` (shape ``(batch,)``) with every example whose
    label is unusable -- a NaN or an infinity (:func:`finite_rows`) or a class index out
    of range (:func:`labels_in_range`) -- counting zero: its label is replaced by zeros
    first (finite, and class 0 for indices, so the loss neither fails nor turns NaN), then
    its loss by 0, so that its gradient is exactly 0, within every bound."""
    labels = tf.convert_to_tensor(labels)
    usable = finite_rows(labels) & labels_in_range(labels, predictions, ignore_class)
    losses = per_example(zero_rows(usable, labels), predictions)
    return tf.where(usable, losses, tf.zeros_like(losses))


__all__ = ["finite_rows", "labels_in_range", "neutralised_losses", "sparse_labels", "zero_rows"]
