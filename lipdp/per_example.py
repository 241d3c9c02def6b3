r"""Per-example gradient norms and clipped gradient sums for a chain of Keras layers.

Clipped DP-SGD (:mod:`lipdp.dpsgd`) needs, for every row ``i`` of a batch and every layer
``l`` with trainable variables, the squared norm ``||g_il||^2`` of the row's gradient for
that layer's variables; the clipping rule turns them into factors ``C_il``; the step
releases ``sum_i C_il g_il`` per layer. Two methods compute the same numbers (tested
against a naive loop of one ``GradientTape`` per row):

``"jacobian"``
    The Jacobian of the vector of per-row losses (``tape.jacobian``, vectorised with
    ``pfor``): every per-example gradient is materialised, ``b x (number of
    parameters)`` floats. The reference, and the method for any layer.

``"ghost"`` (the default; "book-keeping" of Bu et al. 2023 with the ghost norms of
Goodfellow 2015 and Li et al. 2022)
    One forward pass records each weighted layer's input ``A`` and *pre-activation* output
    ``Z``; one backward pass of ``sum_i loss_i`` gives the cotangents ``G = d sum/dZ``,
    whose row ``i`` is ``d loss_i / dZ_i`` because no layer couples the rows (batch
    normalisation is refused). Then, per row:

    * ``Dense`` on ``(b, d)``: ``grad_W = a_i g_i^T`` so ``||grad_W||^2 = ||a_i||^2
      ||g_i||^2``; bias ``||g_i||^2``.
    * ``Dense`` on sequences ``(b, T, d)`` and ``Conv2D`` (``A_i``: the ``T`` positions'
      input patches, ``k_h k_w c`` wide, from ``tf.image.extract_patches``): ``grad_W =
      A_i^T G_i``, ``||grad_W||_F^2 = <A_i A_i^T, G_i G_i^T>`` (cost ``T^2 (d + p)`` per
      row for ``d`` inputs and ``p`` outputs, float64 against cancellation) or the
      materialised ``A_i^T G_i`` (cost ``T d p``), whichever is cheaper; bias
      ``||sum_t G_it||^2``.
    * ``Embedding``: ``grad_E = sum_t e_{id_t} G_it^T`` so ``||grad_E||^2 = sum_{t,s}
      [id_t = id_s] <G_it, G_is>`` (float64).
    * any other layer with variables (normalisations, depthwise convolutions, nested
      models, subclasses of the above): its per-example gradients from a vectorised map
      of the layer's own vector-Jacobian product ``(a_i, g_i) -> grad``; materialised for
      that layer only.

    The clipped sum of a ghost layer is its vector-Jacobian product with the cotangents
    ``C_il G_i`` (a layer-local second backward pass, rows dropped by the clipping zeroed
    in both ``A`` and ``G``): no per-example gradient of those layers is materialised;
    where the materialised branch was cheaper, its ``A_i^T G_i`` give the clipped sum
    ``sum_i C_il A_i^T G_i`` directly and the second backward pass is skipped.

A variable shared by two layers would make a row's gradient the sum of two parts whose
norms are computed separately; :func:`weighted_layers` refuses it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import tensorflow as tf

from lipdp import validation
from lipdp.records import zero_rows

#: How per-example gradients are obtained (module docstring).
GRADIENT_METHODS = ("ghost", "jacobian")


# ------------------------------------------------------------------------ structure
def weighted_layers(layers) -> list:
    """The layers with trainable variables, in order; a variable may belong to one only."""
    result, owner = [], {}
    for layer in layers:
        variables = layer.trainable_variables
        for v in variables:
            if v.ref() in owner and owner[v.ref()] is not layer:
                raise ValueError(
                    f"Variable {v.name!r} is shared by layers {owner[v.ref()].name!r} and "
                    f"{layer.name!r}: per-example norms would be computed per part. Use "
                    "separate variables."
                )
            owner[v.ref()] = layer
        if variables:
            result.append(layer)
    return result


def ghost_rule(layer) -> str:
    """How the ghost method treats ``layer``: ``"dense"``, ``"conv2d"``, ``"embedding"``
    or ``"vectorized"`` (exact classes only: a subclass may change ``call``)."""
    layers = tf.keras.layers
    kind = type(layer)
    if kind is layers.Dense:
        return "dense"
    if kind is layers.Conv2D and layer.groups == 1 and layer.data_format == "channels_last":
        return "conv2d"
    if kind is layers.Embedding and not layer.mask_zero:
        return "embedding"
    return "vectorized"


def _dense_linear(layer, a):
    z = tf.tensordot(a, layer.kernel, [[a.shape.rank - 1], [0]])
    z.set_shape(a.shape[:-1].concatenate([layer.units]))
    return z + layer.bias if layer.use_bias else z


def _conv2d_linear(layer, a):
    z = layer.convolution_op(a, layer.kernel)
    return tf.nn.bias_add(z, layer.bias) if layer.use_bias else z


def _embedding_linear(layer, a):
    ids = a if a.dtype in (tf.int32, tf.int64) else tf.cast(a, tf.int32)
    return tf.nn.embedding_lookup(layer.embeddings, ids)


_LINEAR = {"dense": _dense_linear, "conv2d": _conv2d_linear, "embedding": _embedding_linear}


@dataclass
class _Record:
    """One weighted layer seen by a forward pass: its input, its (pre-activation) output
    on the tape, the ghost rule; after the backward pass, the output cotangents and, for
    the vectorised fallback and the materialised ghost branch, the per-row gradients."""

    layer: tf.keras.layers.Layer
    inputs: tf.Tensor
    outputs: tf.Tensor
    rule: str
    cotangents: tf.Tensor | None = None
    per_row: list | None = None


@dataclass
class Ascent:
    """A per-row step ``theta_i' = theta + s_i g_i`` (BAM's ascent, ``s_i = lambda /
    ||g_i||``): ``first`` holds the rows' gradients ``g_i`` at ``theta`` (its records), and
    the second pass runs every weighted layer at its row-wise shifted weights."""

    first: PerExampleGradients
    scales: tf.Tensor


def _recorded_forward(model, x, records, ascent=None):
    """The model's forward loop, with each weighted layer split into its linear part
    (recorded) and its activation; under an :class:`Ascent`, each weighted layer of row
    ``i`` runs at ``W + s_i grad_W loss_i`` (the gradient at ``theta``, held constant)."""
    shifts = iter(ascent.first.records) if ascent is not None else None

    def apply(layer, h, kwargs):
        if not layer.built:
            layer(h, training=True, **kwargs)  # creates the variables read below
        if not layer.trainable_variables:
            return layer(h, training=True, **kwargs)
        rule = ghost_rule(layer)
        first = next(shifts) if shifts is not None else None
        if rule == "vectorized" and first is None:
            out = layer(h, training=True, **kwargs)
            records.append(_Record(layer, h, out, rule))
            return out
        if rule == "vectorized":
            out = _shifted_call(first, h, ascent.scales)
            records.append(_Record(layer, h, out, rule))
            return _masked_like_keras(layer, h, out)
        z = _LINEAR[rule](layer, h)
        if first is not None:
            z = z + _SHIFT[rule](first, h, ascent.scales)
        records.append(_Record(layer, h, z, rule))
        return _masked_like_keras(layer, h, z if rule == "embedding" else layer.activation(z))

    return model.forward(x, training=True, apply=apply)


def _masked_like_keras(layer, inputs, outputs):
    """``outputs`` with the Keras mask ``layer.__call__`` would attach (masking layers
    downstream, e.g. pooling after ``Embedding(mask_zero=True)``, read it)."""
    mask = layer.compute_mask(inputs, getattr(inputs, "_keras_mask", None))
    if mask is not None:
        outputs._keras_mask = mask  # noqa: SLF001 - Keras 2's mask convention
    return outputs


# --------------------------------------------------------------------- ghost norms
def _rows(t, width):
    """``t`` as ``(rows, positions, width)``."""
    return tf.reshape(t, [tf.shape(t)[0], -1, width])


def _materialise(positions, d, p) -> bool:
    """Cheaper to materialise ``A_i^T G_i`` (``T d p`` multiply-adds per row) than to go
    through the ``T x T`` Grams (``T^2 (d + p)``)?"""
    return positions is not None and positions * (d + p) >= d * p


def _product_sq_norms(a, g):
    """``||A_i^T G_i||_F^2`` per row for ``A: (b, T, d)``, ``G: (b, T, p)``, through the
    ``T x T`` Grams (float64 against cancellation); see :func:`_materialised_gradients`
    for the other branch."""
    a, g = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
    grams = tf.einsum("btd,bsd->bts", a, a) * tf.einsum("btp,bsp->bts", g, g)
    return tf.cast(tf.reduce_sum(grams, axis=[1, 2]), tf.float32)


def _bias_sq_norms(g, width):
    return tf.reduce_sum(tf.square(tf.reduce_sum(_rows(g, width), axis=1)), axis=1)


def _patches(layer, a):
    """The input patch of every output position of a Conv2D, ``(b, T, k_h k_w c)``."""
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.strides, layer.dilation_rate
    patches = tf.image.extract_patches(
        a,
        sizes=[1, kh, kw, 1],
        strides=[1, sh, sw, 1],
        rates=[1, dh, dw, 1],
        padding=layer.padding.upper(),
    )
    return _rows(patches, kh * kw * a.shape[-1])


def _materialised_gradients(record):
    """Row-wise gradients ``[A_i^T G_i, sum_t G_it]`` of a Dense layer on sequences or
    of a Conv2D layer when materialising them is cheaper than the Grams
    (:func:`_materialise`), else ``None``. Once paid for, they also give the clipped sum
    (``sum_i C_i grad_i``, ``b d p`` multiply-adds) and BAM's shift, so the layer-local
    backward pass is skipped."""
    layer, a, g = record.layer, record.inputs, record.cotangents
    if record.rule == "conv2d":
        a, width = _patches(layer, a), layer.filters
    elif record.rule == "dense" and a.shape.rank > 2:
        a, width = _rows(a, a.shape[-1]), layer.units
    else:
        return None
    if not _materialise(a.shape[1], a.shape[2], width):
        return None
    g = _rows(g, width)
    kernel = tf.einsum("btd,btp->bdp", a, g)
    grads = [tf.reshape(kernel, [-1, *layer.kernel.shape])]  # patches are (k_h, k_w, c)
    return grads + [tf.reduce_sum(g, axis=1)] if layer.use_bias else grads


def _dense_sq_norms(layer, a, g):
    if a.shape.rank == 2:
        g_sq = tf.reduce_sum(tf.square(g), axis=1)
        kernel = tf.reduce_sum(tf.square(a), axis=1) * g_sq
        return kernel + g_sq if layer.use_bias else kernel
    kernel = _product_sq_norms(_rows(a, a.shape[-1]), _rows(g, layer.units))
    return kernel + _bias_sq_norms(g, layer.units) if layer.use_bias else kernel


def _conv2d_sq_norms(layer, a, g):
    kernel = _product_sq_norms(_patches(layer, a), _rows(g, layer.filters))
    return kernel + _bias_sq_norms(g, layer.filters) if layer.use_bias else kernel


def _same_ids(a):
    """``(b, T, T)``: positions ``t, s`` of a row hold the same id."""
    ids = tf.reshape(tf.cast(a, tf.int64), [tf.shape(a)[0], -1])
    return tf.equal(ids[:, :, None], ids[:, None, :])


def _embedding_sq_norms(layer, a, g):
    g = tf.cast(_rows(g, layer.output_dim), tf.float64)
    inner = tf.einsum("btp,bsp->bts", g, g)
    same = tf.where(_same_ids(a), inner, tf.zeros_like(inner))
    return tf.cast(tf.reduce_sum(same, [1, 2]), tf.float32)


_SQ_NORMS = {"dense": _dense_sq_norms, "conv2d": _conv2d_sq_norms, "embedding": _embedding_sq_norms}


# ------------------------------------------------------- row-wise shifted weights (BAM)
def _scaled(scales, t):
    """Row ``i`` of ``t`` times ``scales[i]``."""
    shape = tf.concat([tf.shape(scales), tf.ones([tf.rank(t) - 1], tf.int32)], axis=0)
    return tf.reshape(scales, shape) * t


def _product_shift(a_new, a, g, first):
    """``A'_i (A_i^T G_i)`` per row: the linear part's response to the kernel gradient
    (from the first pass's materialised gradients when it has them)."""
    if first.per_row is not None:
        kernel = tf.stop_gradient(first.per_row[0])
        return tf.einsum("btd,bdp->btp", a_new, tf.reshape(kernel, [-1, a.shape[2], g.shape[2]]))
    return tf.einsum("bts,bsp->btp", tf.einsum("btd,bsd->bts", a_new, a), g)


def _first_pass(first):
    """A first-pass record's input and cotangent, held constant in the second pass."""
    return tf.stop_gradient(first.inputs), tf.stop_gradient(first.cotangents)


def _dense_shift(first, a_new, scales):
    """``a'_i (s_i grad_W) + s_i grad_b`` of a Dense layer (``grad_W = A_i^T G_i``)."""
    layer, (a, g) = first.layer, _first_pass(first)
    if a.shape.rank == 2:
        shift = tf.reduce_sum(a_new * a, axis=1, keepdims=True) * g
        shift = shift + g if layer.use_bias else shift
        return _scaled(scales, shift)
    width = a.shape[-1]
    shift = _product_shift(_rows(a_new, width), _rows(a, width), _rows(g, layer.units), first)
    if layer.use_bias:
        shift = shift + tf.reduce_sum(_rows(g, layer.units), axis=1, keepdims=True)
    return _scaled(scales, tf.reshape(shift, tf.shape(g)))


def _conv2d_shift(first, a_new, scales):
    layer, (a, g) = first.layer, _first_pass(first)
    g_rows = _rows(g, layer.filters)
    shift = _product_shift(_patches(layer, a_new), _patches(layer, a), g_rows, first)
    if layer.use_bias:
        shift = shift + tf.reduce_sum(g_rows, axis=1, keepdims=True)
    return _scaled(scales, tf.reshape(shift, tf.shape(g)))


def _embedding_shift(first, a_new, scales):
    """Position ``s`` of row ``i`` looks up ``E + s_i grad_E``: ``s_i sum_t [id_t = id_s]
    G_it`` more (the ids are the data: the same in both passes)."""
    layer, (a, g) = first.layer, _first_pass(first)
    g_rows = _rows(g, layer.output_dim)
    shift = tf.einsum("bst,btp->bsp", tf.cast(_same_ids(a), g.dtype), g_rows)
    return _scaled(scales, tf.reshape(shift, tf.shape(g)))


_SHIFT = {"dense": _dense_shift, "conv2d": _conv2d_shift, "embedding": _embedding_shift}


def _variable_slots(layer) -> list:
    """``(object, attribute)`` holding each trainable variable of ``layer`` (or of a
    sub-layer), to run the layer on other weights."""
    slots = {}
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001 - Keras 2 walk
        for name, value in vars(sub).items():
            if isinstance(value, tf.Variable):
                slots.setdefault(value.ref(), (sub, name))
    missing = [v.name for v in layer.trainable_variables if v.ref() not in slots]
    if missing:
        raise ValueError(
            f"Cannot run layer {layer.name!r} on row-wise weights: variables {missing} are "
            "not held as layer attributes. Use per-example ascent only with layers that "
            "store their variables as attributes (all built-in Keras layers do)."
        )
    return [slots[v.ref()] for v in layer.trainable_variables]


@contextlib.contextmanager
def _weights_replaced(slots, tensors):
    """Within the block the layer reads ``tensors`` instead of its variables. Plain
    ``object.__setattr__``: Keras' attribute tracking would reorder the layer's weights."""
    saved = [getattr(owner, name) for owner, name in slots]
    for (owner, name), tensor in zip(slots, tensors):
        object.__setattr__(owner, name, tensor)
    try:
        yield
    finally:
        for (owner, name), variable in zip(slots, saved):
            object.__setattr__(owner, name, variable)


def _row_call(layer, slots, a_i, weights):
    """``layer`` on one row with its variables replaced by ``weights``."""
    with _weights_replaced(slots, weights):
        return layer(a_i[None], training=True)[0]


def _shifted_weights(layer, first_grads, scale):
    return [v + scale * grad for v, grad in zip(layer.trainable_variables, first_grads)]


def _shifted_call(first, h, scales):
    """A vectorised-fallback layer on each row at ``W + s_i grad_i`` (materialised)."""
    layer, slots = first.layer, _variable_slots(first.layer)
    grads = [tf.stop_gradient(t) for t in first.per_row]

    def one_row(args):
        a_i, scale, row_grads = args
        return _row_call(layer, slots, a_i, _shifted_weights(layer, row_grads, scale))

    return tf.vectorized_map(one_row, (h, scales, grads))


def _vectorized_gradients(record, first=None, scales=None):
    """Per-row gradients of a fallback layer: ``vectorized_map`` of the layer's own
    vector-Jacobian product on ``(a_i, g_i)``, at ``W`` or, after an ascent, at ``W + s_i
    grad_i``."""
    layer, variables = record.layer, record.layer.trainable_variables
    slots = _variable_slots(layer) if first is not None else None
    shifts = [tf.stop_gradient(t) for t in first.per_row] if first is not None else None

    def one_row(args):
        a_i, g_i = args[:2]
        with tf.GradientTape() as tape:
            if first is None:
                out = layer(a_i[None], training=True)[0]
                sources = variables
            else:
                sources = _shifted_weights(layer, args[3], args[2])
                tape.watch(sources)
                out = _row_call(layer, slots, a_i, sources)
        return tape.gradient(out, sources, output_gradients=g_i, unconnected_gradients="zero")

    inputs = (record.inputs, record.cotangents)
    if first is not None:
        inputs = (*inputs, scales, shifts)
    return tf.vectorized_map(one_row, inputs)


def _square_sums(per_row):
    """``sum`` of squares of each row over several ``(b, ...)`` tensors."""
    return tf.add_n(
        [tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), 1) for t in per_row]
    )


def _local_vjp(record, inputs, cotangents):
    """``sum_i`` of the rows' gradients for cotangents ``G``: the layer's linear part
    re-run on ``inputs`` (the forward op is pruned in graph mode) and differentiated. A
    row-wise shift is constant in the weights, so this is also the gradient at the
    shifted weights."""
    variables = record.layer.trainable_variables
    with tf.GradientTape() as tape:
        z = _LINEAR[record.rule](record.layer, inputs)
    grads = tape.gradient(z, variables, output_gradients=cotangents, unconnected_gradients="zero")
    return [tf.convert_to_tensor(grad) for grad in grads]  # embedding: IndexedSlices


# ------------------------------------------------------------------------- results
@dataclass
class PerExampleGradients:
    """The per-row facts of one batch, per weighted layer (in forward order).

    ``sq_norms[l]``: ``(b,)`` squared norms of each row's gradient for layer ``l``'s
    variables. ``y_pred``: the forward pass's predictions. :meth:`clipped_sums` returns
    ``{variable ref: sum_i C_il g_il}`` for factors ``C_il``.
    """

    layers: list
    sq_norms: list
    y_pred: tf.Tensor
    _summer: object
    records: list | None = None

    def clipped_sums(self, factors, keep) -> dict:
        """``factors[l]``: ``(b,)`` factors of layer ``l``; rows where ``keep`` is False
        contribute nothing (their inputs and cotangents are zeroed, rule S9)."""
        return self._summer(factors, keep)


def per_example_gradients(
    model, x, per_example_losses, method="ghost", ascent=None
) -> PerExampleGradients:
    """The per-example squared norms of ``model`` (a chain of Keras layers run by
    ``model.forward``) on ``x``; ``per_example_losses(y_pred)`` gives the ``(b,)`` losses.
    ``ascent``: an :class:`Ascent` (ghost method only): the gradients of each row at its
    own shifted weights."""
    validation.choice("per-example gradient method", method, GRADIENT_METHODS)
    if method == "jacobian":
        if ascent is not None:
            raise ValueError("A per-example ascent (BAM) needs gradient_method='ghost'.")
        return _jacobian(model, x, per_example_losses)
    records = []
    with tf.GradientTape() as tape:
        y_pred = _recorded_forward(model, x, records, ascent)
        total = tf.reduce_sum(per_example_losses(y_pred))
    cotangents = tape.gradient(total, [r.outputs for r in records])
    weighted_layers([r.layer for r in records])  # refuses shared variables
    first = ascent.first.records if ascent is not None else [None] * len(records)
    sq_norms = []
    for record, g, before in zip(records, cotangents, first):
        record.cotangents = tf.zeros_like(record.outputs) if g is None else g
        if record.rule == "vectorized":
            scales = None if ascent is None else ascent.scales
            record.per_row = _vectorized_gradients(record, before, scales)
            sq_norms.append(_square_sums(record.per_row))
        elif (materialised := _materialised_gradients(record)) is not None:
            record.per_row = materialised
            sq_norms.append(_square_sums(materialised))
        else:
            sq_norms.append(_SQ_NORMS[record.rule](record.layer, record.inputs, record.cotangents))

    def summer(factors, keep):
        sums = {}
        for record, c in zip(records, factors):
            c = tf.where(keep, c, tf.zeros_like(c))
            if record.per_row is not None:
                parts = [tf.tensordot(c, zero_rows(keep, t), [[0], [0]]) for t in record.per_row]
            else:
                cotangents = _scaled(c, zero_rows(keep, record.cotangents))
                parts = _local_vjp(record, zero_rows(keep, record.inputs), cotangents)
            variables = record.layer.trainable_variables
            sums.update({v.ref(): part for v, part in zip(variables, parts)})
        return sums

    layers = [r.layer for r in records]
    return PerExampleGradients(layers, sq_norms, y_pred, summer, records)


def _jacobian(model, x, per_example_losses) -> PerExampleGradients:
    layers = weighted_layers(model.layers_forward_order())
    variables = [v for layer in layers for v in layer.trainable_variables]
    with tf.GradientTape() as tape:
        y_pred = model.forward(x, training=True)
        losses = per_example_losses(y_pred)
    jacobians = tape.jacobian(losses, variables, experimental_use_pfor=True)
    rows = tf.shape(losses)[0]
    jacobians = [
        tf.zeros(tf.concat([[rows], v.shape], 0), v.dtype) if j is None else j
        for j, v in zip(jacobians, variables)
    ]
    by_layer, start = [], 0
    for layer in layers:
        count = len(layer.trainable_variables)
        by_layer.append(jacobians[start : start + count])
        start += count

    def summer(factors, keep):
        sums = {}
        for layer, grads, c in zip(layers, by_layer, factors):
            c = tf.where(keep, c, tf.zeros_like(c))
            for v, t in zip(layer.trainable_variables, grads):
                sums[v.ref()] = tf.tensordot(c, zero_rows(keep, t), axes=[[0], [0]])
        return sums

    sq_norms = [_square_sums(grads) for grads in by_layer]
    return PerExampleGradients(layers, sq_norms, y_pred, summer)


__all__ = [
    "GRADIENT_METHODS",
    "Ascent",
    "PerExampleGradients",
    "ghost_rule",
    "per_example_gradients",
    "weighted_layers",
]
