r"""Ghost rule of ``keras.layers.Conv2D`` (exact class, ``groups == 1``,
``channels_last``, the kernel a variable: no Keras 3 LoRA or quantization): a Dense layer
on input patches.

Output position ``t`` of row ``i`` is ``z_t = P_t(A_i) W + b``, where ``P_t(A_i)`` is the
input patch the kernel covers at ``t`` (``k_h x k_w x c``, with the layer's strides,
dilation and padding, flattened in that order: ``tf.image.extract_patches``) and ``W``
the kernel reshaped to ``(k_h k_w c, filters)``. With ``A_i`` replaced by the ``T x k_h
k_w c`` matrix of its patches, every identity of :mod:`lipdp.clipped.per_example.dense`
holds as is: kernel gradient ``P_i^T G_i``, ghost norm

    ``||P_i^T G_i||_F^2 = <P_i P_i^T, G_i G_i^T>``

(``T^2 (k_h k_w c + filters)`` per row, float64) or the materialised ``P_i^T G_i`` (``T
k_h k_w c filters``) when cheaper, bias ``sum_t g_t``, BAM's shift ``(P'_i P_i^T) G_i``.

The patches are the rule's one per-backend piece (:func:`patches`: TensorFlow's
``extract_patches``, JAX's ``conv_general_dilated_patches`` reordered to the same
layout); the rest is :mod:`lipdp.clipped.per_example.dense`'s, on both backends.

Grouped convolutions (``groups > 1``: the kernel is block-diagonal across channel groups,
not one matrix on whole patches), ``channels_first`` (the patches would be taken along the
wrong axes), subclasses and the other convolutions (``Conv1D``, ``Conv3D``,
``DepthwiseConv2D``, transposed ones) go to the vectorised fallback.
"""

from __future__ import annotations

import contextlib
import threading

import keras

from lipdp.clipped.per_example.dense import (
    materialise,
    product_rows,
    product_shift,
    product_sq_norms,
)
from lipdp.clipped.per_example.registry import (
    GhostRule,
    register_ghost_rule,
    rows,
    stored_weights,
)
from lipdp.foundation import compat


def patches(layer, a):
    """The input patch of every output position of a Conv2D, ``(b, T, k_h k_w c)``, the
    features ordered as the kernel's ``(k_h, k_w, c)`` axes, on either backend."""
    if compat.keras_backend() != compat.SUPPORTED_BACKEND:
        return _jax_patches(layer, a)
    import tensorflow as tf

    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.strides, layer.dilation_rate
    result = sliced_patches(a, (kh, kw), (sh, sw), (dh, dw), layer.padding)
    if result is None:  # spatial sizes known only at run time
        result = tf.image.extract_patches(
            a,
            sizes=[1, kh, kw, 1],
            strides=[1, sh, sw, 1],
            rates=[1, dh, dw, 1],
            padding=layer.padding.upper(),
        )
    return rows(result, kh * kw * a.shape[-1])


def single_channel_patches(layer, a):
    """The patches of a one-channel input (a first layer on grey images) as ``(b, k_h k_w,
    T)``, or ``None`` (several channels, unknown sizes, TensorFlow's padding of another
    backend): the slices of :func:`sliced_patches` stacked on a new axis 1, block copies,
    where concatenating them on the feature axis interleaves single values (issue 39: 4x
    faster). Row ``i``'s kernel gradient is then the plain product ``P_i G_i``."""
    if compat.keras_backend() != compat.SUPPORTED_BACKEND or a.shape[-1] != 1:
        return None
    import tensorflow as tf

    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.strides, layer.dilation_rate
    slices = _offset_slices(a, (kh, kw), (sh, sw), (dh, dw), layer.padding)
    if slices is None:
        return None
    positions = slices[0].shape[1] * slices[0].shape[2]
    stacked = tf.stack(slices, axis=1)  # (b, k_h k_w, out_h, out_w, 1)
    return tf.reshape(stacked, [-1, kh * kw, positions])


#: Whether :func:`offset_kernel_rows` is used: only while a model bounds its physical
#: batch (:func:`kernel_rows_by_offset`). Measured side by side (benchmarks/README.md,
#: "Second pass: row scaling and float64 squares"): conv 2 of the benchmark CNN at
#: b = 1024, 217 ms by offsets against 177 ms from the patch matrix; the patch matrix
#: is the clipped step's largest tensor (115 MB at P = 512). Speed where the user did not
#: ask for bounded memory, memory where they did.
_BY_OFFSET = threading.local()


@contextlib.contextmanager
def kernel_rows_by_offset():
    """Inside (while tracing), materialised Conv2D kernel rows are computed without the
    patch matrix (:func:`offset_kernel_rows`): entered by the clipped step of a model
    given ``physical_batch_size``. The released sums and the norms are the same numbers
    either way (both are ``P_i^T G_i`` row by row; tested against a tape per row)."""
    previous = getattr(_BY_OFFSET, "on", False)
    _BY_OFFSET.on = True
    try:
        yield
    finally:
        _BY_OFFSET.on = previous


def offset_kernel_rows(layer, a, g):
    """Row ``i``'s kernel gradient ``P_i^T G_i`` ``(b, k_h, k_w, c, filters)`` as ``k_h
    k_w`` products ``S_ij^T G_i`` of the strided slice ``S_ij`` ``(T, c)`` of kernel offset
    ``(i, j)`` (:func:`_offset_slices`) with the cotangents, stacked in the kernel's
    order: the same sums as the materialised product on the patches, without the patch
    matrix ``(b, T, k_h k_w c)`` (``k_h k_w`` times the input; with the slices it is
    concatenated from, issue 39's largest tensor of the clipped step on a CNN: 230 MB of
    the second convolution at ``P = 512``). ``None`` where :func:`materialise` prefers
    the Grams, or the slices are not available (unknown sizes, JAX)."""
    if compat.keras_backend() != compat.SUPPORTED_BACKEND:
        return None
    import tensorflow as tf

    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.strides, layer.dilation_rate
    c = a.shape[-1]
    g_rows = rows(g, layer.filters)  # (b, T, filters)
    positions = g_rows.shape[1]
    if c is None or not materialise(positions, kh * kw * c, layer.filters):
        return None
    slices = _offset_slices(a, (kh, kw), (sh, sw), (dh, dw), layer.padding)
    if slices is None:
        return None
    products = [
        tf.linalg.matmul(tf.reshape(s, [-1, positions, c]), g_rows, transpose_a=True)
        for s in slices
    ]  # each (b, c, filters)
    return tf.reshape(tf.stack(products, axis=1), [-1, *layer.kernel.shape])


def sliced_patches(a, kernel_size, strides, dilation_rate, padding):
    """``tf.image.extract_patches`` of ``a`` ``(b, H, W, c)`` (static ``H``, ``W``, ``c``;
    else ``None``) as ``k_h k_w`` strided slices of the padded input concatenated on the
    feature axis, in the kernel's ``(k_h, k_w, c)`` order: the same values (data movement
    only, no arithmetic), several times faster on CPU than TensorFlow's patch kernel
    (issue 39: it was the largest cost of the clipped step on a CNN).

    Output position ``(y, x)`` reads input ``(y s_h + i d_h - p_top, x s_w + j d_w -
    p_left)`` for kernel offset ``(i, j)``: TensorFlow's ``SAME`` padding (``p_top =
    floor(p_total / 2)``, ``p_total = max((out - 1) s + (k - 1) d + 1 - in, 0)``, ``out =
    ceil(in / s)``) or none (``VALID``, ``out = floor((in - (k - 1) d - 1) / s) + 1``)."""
    import tensorflow as tf

    slices = _offset_slices(a, kernel_size, strides, dilation_rate, padding)
    if slices is None:
        return None
    return slices[0] if len(slices) == 1 else tf.concat(slices, axis=-1)


def _offset_slices(a, kernel_size, strides, dilation_rate, padding):
    """The ``k_h k_w`` strided slices ``(b, out_h, out_w, c)`` of the padded input, one per
    kernel offset ``(i, j)`` in row-major order (:func:`sliced_patches`), or ``None``."""
    import tensorflow as tf

    (kh, kw), (sh, sw), (dh, dw) = kernel_size, strides, dilation_rate
    h, w, c = a.shape[1], a.shape[2], a.shape[3]
    if h is None or w is None or c is None:
        return None
    spans = ((h, kh, sh, dh), (w, kw, sw, dw))
    if padding.lower() == "same":
        outs = [-(-size // s) for size, _, s, _ in spans]
        totals = [
            max((o - 1) * s + (k - 1) * d + 1 - size, 0) for o, (size, k, s, d) in zip(outs, spans)
        ]
        a = tf.pad(
            a,
            [
                [0, 0],
                [totals[0] // 2, totals[0] - totals[0] // 2],
                [totals[1] // 2, totals[1] - totals[1] // 2],
                [0, 0],
            ],
        )
    else:
        outs = [(size - (k - 1) * d - 1) // s + 1 for size, k, s, d in spans]
    oh, ow = outs
    if oh <= 0 or ow <= 0:
        return None
    return [
        a[:, i * dh : i * dh + (oh - 1) * sh + 1 : sh, j * dw : j * dw + (ow - 1) * sw + 1 : sw, :]
        for i in range(kh)
        for j in range(kw)
    ]


def _jax_patches(layer, inputs):
    """:func:`patches` on JAX (``conv_general_dilated_patches`` orders the features
    ``(c, k_h, k_w)``: reordered)."""
    import jax
    import jax.numpy as jnp

    kh, kw = layer.kernel_size
    c = inputs.shape[-1]
    result = jax.lax.conv_general_dilated_patches(
        inputs,
        filter_shape=(kh, kw),
        window_strides=tuple(layer.strides),
        padding=layer.padding.upper(),
        rhs_dilation=tuple(layer.dilation_rate),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )  # features ordered (C, kh, kw)
    b = result.shape[0]
    result = jnp.reshape(result, (b, -1, c, kh, kw))
    result = jnp.transpose(result, (0, 1, 3, 4, 2))
    return jnp.reshape(result, (b, -1, kh * kw * c))


class Conv2DRule(GhostRule):
    """``Conv2D`` with ``groups == 1`` and ``channels_last`` (module docstring)."""

    name = "conv2d"

    def applies(self, layer) -> bool:
        return layer.groups == 1 and layer.data_format == "channels_last" and stored_weights(layer)

    def product_factors(self, layer, a, g):
        # the patches are (k_h, k_w, c): the kernel's layout, (k_h, k_w, c, filters)
        return patches(layer, a), rows(g, layer.filters)

    def apply_kernel(self, layer, a, kernel):
        return layer.convolution_op(a, kernel)

    def linear(self, layer, a):
        import tensorflow as tf

        z = layer.convolution_op(a, layer.kernel)
        return tf.nn.bias_add(z, layer.bias) if layer.use_bias else z

    def kernel_sq_norms(self, layer, a, g):
        return product_sq_norms(*self.product_factors(layer, a, g))

    def kernel_rows(self, layer, a, g):
        single = single_channel_patches(layer, a)
        if single is not None and materialise(single.shape[2], single.shape[1], layer.filters):
            import tensorflow as tf

            product = tf.linalg.matmul(single, rows(g, layer.filters))  # (b, k_h k_w, filters)
            return tf.reshape(product, [-1, *layer.kernel.shape])
        offsets = offset_kernel_rows(layer, a, g) if getattr(_BY_OFFSET, "on", False) else None
        if offsets is not None:
            return offsets
        return product_rows(*self.product_factors(layer, a, g), layer.kernel.shape)

    def shift(self, layer, a_new, a, g, kernel_rows):
        import tensorflow as tf

        g_rows = rows(g, layer.filters)
        shift = product_shift(patches(layer, a_new), patches(layer, a), g_rows, kernel_rows)
        if layer.use_bias:
            shift = shift + tf.reduce_sum(g_rows, axis=1, keepdims=True)
        return tf.reshape(shift, tf.shape(g))


register_ghost_rule(keras.layers.Conv2D, Conv2DRule())

__all__ = [
    "Conv2DRule",
    "kernel_rows_by_offset",
    "offset_kernel_rows",
    "patches",
    "single_channel_patches",
    "sliced_patches",
]
