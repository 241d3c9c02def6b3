"""Rule S9 in one place: which examples of a batch cannot be trained on as they are.

Three kinds of rows are neutralised (they count zero in the step) instead of making the
contribution unbounded or the step fail -- which would reveal that the row was sampled:

* a row holding a NaN or an infinity (input or label): :func:`finite_rows`;
* a row whose input holds a token id outside the range of the layer reading it (``10``,
  ``-1`` or ``2**31 - 1`` for an ``Embedding(10, ...)``, ``2.5``): :func:`ids_in_range`,
  the ranges from :func:`read_ids`. The CPU's embedding lookup and ``CategoryEncoding``'s
  assertion raise on such an id, which would stop the whole step;
* a row whose class-index label is not a class of the predictions (``10`` or ``-1``
  with 10 classes, ``2.5``): :func:`labels_in_range`. TensorFlow's sparse
  cross-entropy raises on such a label, likewise.

**Which ids are checked.** A record brings ids through the model's input; the layers
that read them state their valid range: ``Embedding`` (``[0, input_dim)``) and
``CategoryEncoding`` (``[0, num_tokens)``). :func:`input_id_ranges` finds, for each
tensor of the model's input, the layers that read it directly -- the first layer of the
forward loop, into nested ``Sequential`` and functional models (every layer reading the
input tensor of their graph) and through layers that only move values (``InputLayer``,
``Reshape``, ``Flatten``, ``Permute``) -- and keeps the narrowest range. A row is usable
iff every entry of such a tensor is a whole number in that range (integer or float
dtype: ``2.5``, which ``Embedding`` would truncate to 2, is refused like a label ``2.5``:
the test is never looser than the layer). An input read by no such layer has no range
(floats fed to ``Dense`` are values: any finite value is usable). Ids computed inside
the model (``Hashing``, ``IntegerLookup``, ``StringLookup``) lie in the range the
computing layer is configured for (``num_bins``, the vocabulary size): the model, not
the record, must make it fit the ``Embedding`` after it. The clipless family has no
layer reading ids (its first layer is ``DP_BoundedInput``, which bounds the norm of any
finite input).

A neutralised row is zeroed where it is read (finite values, id 0, in every range since
``input_dim, num_tokens >= 1``) so that the step runs, and given clipping factor 0 (or
loss 0 for a label) so that it contributes nothing; the training logs count it; ``fit``
on arrays refuses it, naming the rows.

Imports nothing else of lipdp, so that the input layer, the losses and the training steps
all use the same tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import tensorflow as tf

from lipdp.foundation import compat


def _dtype_name(dtype) -> str:
    """``"float32"``, ``"int64"``, ``"bool"``...: the name of a TensorFlow, NumPy or JAX
    dtype (each has a ``name``)."""
    return str(getattr(dtype, "name", dtype))


def is_floating(dtype) -> bool:
    """Whether ``dtype`` (any backend's) is a real floating type (``bfloat16`` included)."""
    return _dtype_name(dtype).startswith(("float", "bfloat"))


def finite_rows(values):
    """``(batch,)`` booleans: every entry of the example is finite (not NaN, not inf).
    Non-floating tensors (integer labels) are finite. Any backend's arrays, jit-safe
    (:func:`lipdp.foundation.compat.array_ops`)."""
    ops = compat.array_ops()
    values = ops.convert_to_tensor(values)
    rows = ops.shape(values)[0]
    if not is_floating(values.dtype):
        return ops.ones((rows,), dtype="bool")
    flat = ops.reshape(values, (rows, -1))
    return ops.all(ops.isfinite(flat), axis=1)


def zero_rows(keep, values):
    """``values`` with the examples where ``keep`` is False replaced by zeros (any
    backend's arrays of known rank, jit-safe).

    The zeros are one row broadcast by ``where`` (the zero of any dtype: an empty string
    for text), not ``zeros_like(values)``: on a batch of static shape (fixed-size batches)
    TensorFlow's graph optimiser folds ``zeros_like`` into a constant as large as the
    batch, which the traced step then keeps for good (measured: 103 MB held and 180 MB
    more at the peak of a logical batch of 8192 images, ``benchmarks/README.md``, "The
    target cell: the constant that grew with the batch")."""
    ops = compat.array_ops()
    mask = ops.reshape(keep, (-1,) + (1,) * (len(values.shape) - 1))
    return ops.where(mask, values, ops.zeros_like(values[:1]))


def kept_rows(finite, ids):
    """``(batch,)`` booleans: the rows a step may count before its labels are read --
    ``finite`` (:func:`finite_rows` of input and label) and, when the input is read as
    ids (``ids`` not ``None``, :func:`ids_in_range`), every id in range."""
    return finite if ids is None else finite & ids


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
    values, entries = _whole_numbers_below(labels, classes)
    if ignore_class is not None:
        entries |= values == tf.cast(ignore_class, values.dtype)
    return tf.reduce_all(entries, axis=1) | (classes < 2)


def _whole_numbers_below(values, size):
    """``(values, entries)``: ``values`` as ``(rows, -1)`` in a wide type and, per entry,
    whether it is a whole number in ``[0, size)``. Wide types: an int64 comparison for
    integers (``size`` may not fit uint8 values), float64 for floats (exact for every
    float32 and float16 value; NaN and infinities are not in range)."""
    wide = tf.int64 if values.dtype.is_integer else tf.float64
    rows = tf.shape(values)[0]
    values = tf.cast(tf.reshape(values, tf.stack([rows, -1])), wide)
    entries = (values >= 0) & (values < tf.cast(size, wide))
    if wide == tf.float64:
        entries &= tf.math.floor(values) == values
    return values, entries


def ids_in_range(ids, size):
    """``(batch,)`` booleans: every entry of the example is a whole number in ``[0,
    size)`` -- a token id the layer reading it can look up (:func:`input_id_ranges`).
    Integer or floating ids (a float id is read as the integer it equals; ``2.5`` is not
    an id); booleans and other types are not ids (all usable). In-graph."""
    ids = tf.convert_to_tensor(ids)
    if not (ids.dtype.is_integer or ids.dtype.is_floating):
        return tf.ones(tf.shape(ids)[:1], dtype=tf.bool)
    return tf.reduce_all(_whole_numbers_below(ids, size)[1], axis=1)


def neutralised_losses(per_example, labels, predictions, ignore_class=None):
    """``per_example(labels, predictions)`` (shape ``(batch,)``) with every example whose
    label is unusable -- a NaN or an infinity (:func:`finite_rows`) or a class index out
    of range (:func:`labels_in_range`) -- counting zero: its label is replaced by zeros
    first (finite, and class 0 for indices, so the loss neither fails nor turns NaN), then
    its loss by 0, so that its gradient is exactly 0, within every bound.

    Backend-neutral for labels that are not class indices (:func:`sparse_labels`, decided
    from the static shapes: the range test is then all True and is skipped); class indices
    are checked by :func:`labels_in_range`, on TensorFlow."""
    ops = compat.array_ops()
    labels = ops.convert_to_tensor(labels)
    usable = finite_rows(labels)
    if _sparse(labels, predictions):
        if compat.keras_backend() != "tensorflow":
            raise ValueError(
                "Class-index labels reach a loss on the "
                f"{compat.keras_backend()} backend, which checks only labels of the "
                "predictions' shape: one-hot encode the labels."
            )
        usable = usable & labels_in_range(labels, predictions, ignore_class)
    losses = per_example(zero_rows(usable, labels), predictions)
    return ops.where(usable, losses, ops.zeros_like(losses))


def _sparse(labels, predictions) -> bool:
    """:func:`sparse_labels` for any backend's arrays: TensorFlow tensors by it, arrays
    without a ``TensorShape`` (JAX: static shapes) by the same rule on their shapes."""
    if not hasattr(labels.shape, "rank"):  # not a TensorFlow tensor: a static shape
        if len(predictions.shape) < 2 or predictions.shape[-1] == 1:
            return False
        kind = _dtype_name(labels.dtype)
        if not (kind.startswith(("int", "uint")) or is_floating(labels.dtype)):
            return False
        rank, target = len(labels.shape), len(predictions.shape)
        return rank == target - 1 or (rank == target and labels.shape[-1] == 1)
    return sparse_labels(labels, predictions)


# ------------------------------------------------------------------- id ranges
@dataclass(frozen=True)
class IdRange:
    """Ids of one input tensor must be whole numbers in ``[0, size)``: the narrowest range
    of the layers reading it, ``reader`` the path of that layer (for messages)."""

    size: int
    reader: str


def _stated_range(layer) -> int | None:
    """The ids ``layer`` can read: ``[0, size)``, or ``None`` (not an id reader)."""
    if isinstance(layer, keras.layers.Embedding):
        return int(layer.input_dim)
    if isinstance(layer, keras.layers.CategoryEncoding) and layer.num_tokens is not None:
        return int(layer.num_tokens)
    return None


def _moves_values(layer) -> bool:
    """Does ``layer`` only move its input's values (the ids reach the next layer as they
    are)? Exact classes: a subclass may change ``call``."""
    layers = keras.layers
    return type(layer) in (layers.InputLayer, layers.Reshape, layers.Flatten, layers.Permute)


def _narrowest(ranges) -> IdRange | None:
    known = [r for r in ranges if r is not None]
    return min(known, key=lambda r: r.size) if known else None


def _is_graph(layer) -> bool:
    """A built functional model (:func:`lipdp.foundation.compat.is_graph_model`)."""
    return compat.is_graph_model(layer)


def _reading_range(layer, position, path) -> IdRange | None:
    """The range of the ids ``layer`` reads at its ``position``-th tensor argument: its
    own range (``Embedding``, ``CategoryEncoding``: the first argument), or the range
    inside it (a nested model)."""
    if _is_graph(layer):
        return _tensor_range(layer, layer.inputs[position], path)
    if isinstance(layer, keras.Sequential):
        return _chain_range(layer.layers, path) if position == 0 else None
    size = _stated_range(layer)
    return IdRange(size, path) if size is not None and position == 0 else None


def _tensor_range(model, tensor, path) -> IdRange | None:
    """The narrowest range of the layers of ``model``'s graph reading ``tensor`` (through
    the layers that only move values)."""
    ranges = []
    for layer, inputs, outputs in compat.graph_nodes(model):
        for position in [i for i, t in enumerate(inputs) if t is tensor]:
            if _moves_values(layer) and len(inputs) == 1:
                ranges += [_tensor_range(model, t, path) for t in outputs]
            else:
                ranges.append(_reading_range(layer, position, f"{path}/{layer.name}"))
    return _narrowest(ranges)


def _chain_range(layers, path) -> IdRange | None:
    """The range of the first layer of ``layers`` (run in order) that does not only move
    values."""
    for layer in layers:
        if not _moves_values(layer):
            return _reading_range(layer, 0, f"{path}/{layer.name}" if path else layer.name)
    return None


def _several_inputs(layers):
    """The first layer of ``layers`` that reads the input if it is a functional model
    with several inputs, else ``None``."""
    first = next((layer for layer in layers if not _moves_values(layer)), None)
    return first if first is not None and _is_graph(first) and len(first.inputs) > 1 else None


def input_id_ranges(layers) -> list:
    """For a model running ``layers`` in order on its input: one :class:`IdRange` (or
    ``None``: no id reader) per tensor of the input -- several only when the first layer
    is a functional model with several inputs, in the order of its ``inputs`` (module
    docstring)."""
    first = _several_inputs(layers)
    if first is not None:
        return [_tensor_range(first, t, first.name) for t in first.inputs]
    return [_chain_range(layers, "")]


def read_ids(layers, x) -> list:
    """``[(ids, IdRange)]``: the tensors (or arrays) of ``x``, the input of a model
    running ``layers``, that are read as ids, with their ranges (:func:`input_id_ranges`;
    several inputs are matched to the first layer's as its own call matches them, by
    name for a dict)."""
    first = _several_inputs(layers)
    if first is not None:
        inputs = compat.reference_inputs(first, x)
    else:
        inputs = tf.nest.flatten(x)
    ranges = input_id_ranges(layers)
    if len(inputs) != len(ranges):
        return []  # not the structure the first layer reads: Keras refuses it itself
    return [(ids, r) for ids, r in zip(inputs, ranges) if r is not None]


__all__ = [
    "IdRange",
    "finite_rows",
    "ids_in_range",
    "input_id_ranges",
    "kept_rows",
    "read_ids",
    "labels_in_range",
    "neutralised_losses",
    "sparse_labels",
    "zero_rows",
]
