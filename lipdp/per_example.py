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
    in both ``A`` and ``G``): no per-example gradient of those layers is materialised.

A variable shared by two layers would make a row's gradient the sum of two parts whose
norms are computed separately; :func:`weighted_layers` refuses it.
"""

from __future__ import annotations

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
    """One weighted layer seen by the forward pass: its input, its (pre-activation)
    output on the tape, and the ghost rule."""

    layer: tf.keras.layers.Layer
    inputs: tf.Tensor
    outputs: tf.Tensor
    rule: str


def _recorded_forward(model, x, records):
    """The model's forward loop, with each weighted layer split into its linear part
    (recorded) and its activation."""

    def apply(layer, h, kwargs):
        if not layer.built:
            layer(h, training=True, **kwargs)  # creates the variables read below
        if not layer.trainable_variables:
            return layer(h, training=True, **kwargs)
        rule = ghost_rule(layer)
        if rule == "vectorized":
            out = layer(h, training=True, **kwargs)
            records.append(_Record(layer, h, out, rule))
            return out
        z = _LINEAR[rule](layer, h)
        records.append(_Record(layer, h, z, rule))
        return z if rule == "embedding" else layer.activation(z)

    return model.forward(x, training=True, apply=apply)


# --------------------------------------------------------------------- ghost norms
def _rows(t, width):
    """``t`` as ``(rows, positions, width)``."""
    return tf.reshape(t, [tf.shape(t)[0], -1, width])


def _product_sq_norms(a, g):
    """``||A_i^T G_i||_F^2`` per row for ``A: (b, T, d)``, ``G: (b, T, p)``."""
    positions, d, p = a.shape[1], a.shape[2], g.shape[2]
    # Cost per row: T d p multiply-adds materialised, T^2 (d + p) through the Grams.
    if positions is not None and positions * (d + p) >= d * p:
        materialised = tf.einsum("btd,btp->bdp", a, g)
        return tf.reduce_sum(tf.square(materialised), axis=[1, 2])
    a, g = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
    grams = tf.einsum("btd,bsd->bts", a, a) * tf.einsum("btp,bsp->bts", g, g)
    return tf.cast(tf.reduce_sum(grams, axis=[1, 2]), tf.float32)


def _bias_sq_norms(g, width):
    return tf.reduce_sum(tf.square(tf.reduce_sum(_rows(g, width), axis=1)), axis=1)


def _dense_sq_norms(layer, a, g):
    if a.shape.rank == 2:
        g_sq = tf.reduce_sum(tf.square(g), axis=1)
        kernel = tf.reduce_sum(tf.square(a), axis=1) * g_sq
        return kernel + g_sq if layer.use_bias else kernel
    kernel = _product_sq_norms(_rows(a, a.shape[-1]), _rows(g, layer.units))
    return kernel + _bias_sq_norms(g, layer.units) if layer.use_bias else kernel


def _conv2d_sq_norms(layer, a, g):
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.strides, layer.dilation_rate
    patches = tf.image.extract_patches(
        a,
        sizes=[1, kh, kw, 1],
        strides=[1, sh, sw, 1],
        rates=[1, dh, dw, 1],
        padding=layer.padding.upper(),
    )
    width, filters = kh * kw * a.shape[-1], layer.filters
    kernel = _product_sq_norms(_rows(patches, width), _rows(g, filters))
    return kernel + _bias_sq_norms(g, filters) if layer.use_bias else kernel


def _embedding_sq_norms(layer, a, g):
    width = layer.output_dim
    ids = tf.reshape(tf.cast(a, tf.int64), [tf.shape(a)[0], -1])
    g = tf.cast(_rows(g, width), tf.float64)
    same = tf.equal(ids[:, :, None], ids[:, None, :])
    inner = tf.einsum("btp,bsp->bts", g, g)
    return tf.cast(tf.reduce_sum(tf.where(same, inner, tf.zeros_like(inner)), [1, 2]), tf.float32)


_SQ_NORMS = {"dense": _dense_sq_norms, "conv2d": _conv2d_sq_norms, "embedding": _embedding_sq_norms}


def _vectorized_gradients(layer, a, g):
    """Per-row gradients of ``layer``'s variables: ``vectorized_map`` of the layer's own
    vector-Jacobian product on ``(a_i, g_i)``."""
    variables = layer.trainable_variables

    def one_row(args):
        a_i, g_i = args
        with tf.GradientTape() as tape:
            out = layer(a_i[None], training=True)
        return tape.gradient(
            out,
            variables,
            output_gradients=g_i[None],
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )

    return tf.vectorized_map(one_row, (a, g))


def _square_sums(per_row):
    """``sum`` of squares of each row over several ``(b, ...)`` tensors."""
    return tf.add_n(
        [tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), 1) for t in per_row]
    )


def _weighted_rows(factors, t):
    shape = tf.concat([tf.shape(factors), tf.ones([tf.rank(t) - 1], tf.int32)], axis=0)
    return tf.reshape(factors, shape) * t


def _local_vjp(record, inputs, cotangents):
    """``sum_i`` of the rows' gradients for cotangents ``G``: the layer's linear part
    re-run on ``inputs`` (the forward op is pruned in graph mode) and differentiated."""
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

    def clipped_sums(self, factors, keep) -> dict:
        """``factors[l]``: ``(b,)`` factors of layer ``l``; rows where ``keep`` is False
        contribute nothing (their inputs and cotangents are zeroed, rule S9)."""
        return self._summer(factors, keep)


def per_example_gradients(model, x, per_example_losses, method="ghost") -> PerExampleGradients:
    """The per-example squared norms of ``model`` (a chain of Keras layers run by
    ``model.forward``) on ``x``; ``per_example_losses(y_pred)`` gives the ``(b,)`` losses."""
    validation.choice("per-example gradient method", method, GRADIENT_METHODS)
    if method == "jacobian":
        return _jacobian(model, x, per_example_losses)
    records = []
    with tf.GradientTape() as tape:
        y_pred = _recorded_forward(model, x, records)
        total = tf.reduce_sum(per_example_losses(y_pred))
    cotangents = tape.gradient(total, [r.outputs for r in records])
    cotangents = [tf.zeros_like(r.outputs) if c is None else c for r, c in zip(records, cotangents)]
    weighted_layers([r.layer for r in records])  # refuses shared variables
    sq_norms, materialised = [], {}
    for index, (record, g) in enumerate(zip(records, cotangents)):
        if record.rule == "vectorized":
            grads = _vectorized_gradients(record.layer, record.inputs, g)
            materialised[index] = grads
            sq_norms.append(_square_sums(grads))
        else:
            sq_norms.append(_SQ_NORMS[record.rule](record.layer, record.inputs, g))

    def summer(factors, keep):
        sums = {}
        for index, (record, g, c) in enumerate(zip(records, cotangents, factors)):
            c = tf.where(keep, c, tf.zeros_like(c))
            variables = record.layer.trainable_variables
            if index in materialised:
                grads = [zero_rows(keep, t) for t in materialised[index]]
                parts = [tf.tensordot(c, t, axes=[[0], [0]]) for t in grads]
            else:
                inputs = zero_rows(keep, record.inputs)
                parts = _local_vjp(record, inputs, _weighted_rows(c, zero_rows(keep, g)))
            sums.update({v.ref(): part for v, part in zip(variables, parts)})
        return sums

    return PerExampleGradients([r.layer for r in records], sq_norms, y_pred, summer)


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
    "PerExampleGradients",
    "ghost_rule",
    "per_example_gradients",
    "weighted_layers",
]
