r"""Ghost rule of ``keras.layers.Dense`` (exact class), and the identities of a kernel
gradient that is a sum of outer products over positions (shared with
:mod:`lipdp.clipped.per_example.convolution`).

``Z_i = A_i W + b`` for row ``i``'s input ``A_i`` of ``T`` positions (``T = 1`` on
``(b, d)`` inputs; a ``(b, ..., d)`` input has every axis but the last as positions),
``W`` of shape ``(d, p)``. For the output cotangent ``G_i`` (``T x p``):

* kernel gradient ``grad_W,i = A_i^T G_i = sum_t a_t g_t^T``; on ``(b, d)`` inputs
  ``a_i g_i^T``, of squared norm ``||a_i||^2 ||g_i||^2``;
* on sequences the *ghost norm*

      ``||sum_t a_t g_t^T||_F^2 = sum_{t,s} <a_t, a_s> <g_t, g_s> = <A_i A_i^T, G_i G_i^T>``

  from the two ``T x T`` Grams, ``T^2 (d + p)`` multiply-adds per row, in float64
  (against cancellation between positions, and for the range: rule S13); or the
  materialised ``A_i^T G_i`` (``T d p``), whichever is cheaper (:func:`materialise`): the
  materialised rows then also give the clipped sum ``sum_i k_i A_i^T U_i`` and BAM's
  shift without a second backward pass;
* bias gradient ``sum_t g_t``;
* BAM's shift (:meth:`~lipdp.clipped.per_example.registry.GhostRule.shift`): at weights
  ``W + grad_W,i`` the input ``A'_i`` gives ``A'_i A_i^T G_i = (A'_i A_i^T) G_i`` more
  (``<a'_i, a_i> g_i`` for ``T = 1``), plus ``sum_t g_t`` for the bias.

**The two precisions of these identities** (row scaling: :mod:`lipdp.clipped.per_example.scale`):

* TensorFlow: the squared norms in float64 (:func:`product_sq_norms`, the ``(b, d)`` case
  in :class:`DenseRule`), exact over float64's range;
* JAX (float32 only): :func:`product_norms`, the norms (not squared) from the factors
  scaled by their rows' largest magnitudes: ``T = 1``: ``||a_i|| ||g_i||``; materialised
  rows (:func:`materialise`, the same choice) and their norm; else the Grams of the scaled
  factors *plus a bound on their float32 round-off* (:func:`gram_norms`): cancellation
  between positions could otherwise under-estimate the norm (a privacy leak).

A ``Dense`` whose kernel is computed (Keras 3's LoRA or quantization:
:func:`~lipdp.clipped.per_example.registry.stored_weights`) goes to the vectorised
fallback; so does a subclass of ``Dense`` unless a rule is registered for
it: it may compute its kernel otherwise (:mod:`lipdp.clipped.per_example.registry`).
"""

from __future__ import annotations

import keras

from lipdp.clipped.per_example.registry import (
    GhostRule,
    register_ghost_rule,
    rows,
    stored_weights,
)
from lipdp.clipped.per_example.scale import array_norms, scaled_rows
from lipdp.foundation import compat

#: Unit round-off of float32.
UNIT_ROUNDOFF = 2.0**-24

#: Precision of every JAX product here: full float32 ("highest"). The bounds assume
#: float32 round-off; on accelerators JAX's default may compute float32 products in
#: bfloat16 or TF32 passes, whose error (~1e-3) would exceed both the Gram round-off bound
#: and the slack between a row's bounded norm and the term it adds to the sum.
EXACT = "highest"


def materialise(positions, d, p) -> bool:
    """Cheaper to materialise ``A_i^T G_i`` (``T d p`` multiply-adds per row) than to go
    through the ``T x T`` Grams (``T^2 (d + p)``)? (``positions`` unknown: no.)"""
    return positions is not None and positions * (d + p) >= d * p


def product_sq_norms(a, g):
    """``||A_i^T G_i||_F^2`` per row for ``A: (b, T, d)``, ``G: (b, T, p)``, through the
    ``T x T`` Grams ``<A_i A_i^T, G_i G_i^T>``, in float64 (module docstring;
    TensorFlow)."""
    import tensorflow as tf

    a, g = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
    grams = tf.einsum("btd,bsd->bts", a, a) * tf.einsum("btp,bsp->bts", g, g)
    return tf.reduce_sum(grams, axis=[1, 2])


def product_rows(a, g, kernel_shape):
    """``A_i^T G_i`` per row, reshaped to ``(b, *kernel_shape)``, when materialising is
    cheaper than the Grams (:func:`materialise`), else ``None`` (TensorFlow)."""
    import tensorflow as tf

    if not materialise(a.shape[1], a.shape[2], g.shape[2]):
        return None
    return tf.reshape(tf.einsum("btd,btp->bdp", a, g), [-1, *kernel_shape])


def product_shift(a_new, a, g, kernel_rows):
    """``A'_i (A_i^T G_i)`` per row for ``A', A: (b, T, d)``, ``G: (b, T, p)``: from the
    materialised ``kernel_rows`` when there are some, else as ``(A'_i A_i^T) G_i``
    (TensorFlow)."""
    import tensorflow as tf

    if kernel_rows is not None:
        kernel = tf.reshape(kernel_rows, [-1, a.shape[2], g.shape[2]])
        return tf.einsum("btd,bdp->btp", a_new, kernel)
    return tf.einsum("bts,bsp->btp", tf.einsum("btd,bsd->bts", a_new, a), g)


def gram_norms(a, g):
    """An upper bound on ``||A_i^T G_i||_F`` for ``a: (rows, T, d)``, ``g: (rows, T, p)``
    (float32, JAX) from the Grams ``<A_i A_i^T, G_i G_i^T>`` of the scaled factors plus
    their float32 round-off bound: each Gram entry is a dot product of length ``d``
    (``p``) and the sum has ``T^2`` terms, so the computed value is within ``c (sum_t
    ||a_t|| ||g_t||)^2`` of the exact one with ``c = 2 (d + p + T^2 + 4) u`` (``u =
    2^-24``; the factor 2 covers the rounding of the bound itself); the norm returned is
    ``sqrt(computed + bound)``, an upper bound. Not finite for a row holding a NaN or an
    infinity."""
    import jax.numpy as jnp

    rows_, t, d = a.shape
    p = g.shape[2]
    an, ma = scaled_rows(a, (1, 2))
    gn, mg = scaled_rows(g, (1, 2))
    grams = jnp.einsum("btd,bsd->bts", an, an, precision=EXACT) * jnp.einsum(
        "btp,bsp->bts", gn, gn, precision=EXACT
    )
    computed = jnp.sum(grams, axis=(1, 2))
    triangle = jnp.sum(
        jnp.sqrt(jnp.sum(jnp.square(an), axis=2) * jnp.sum(jnp.square(gn), axis=2)), axis=1
    )
    c = 2.0 * (d + p + t * t + 4) * UNIT_ROUNDOFF
    bound = jnp.sqrt(jnp.maximum(computed, 0.0) + jnp.float32(c) * jnp.square(triangle))
    # NaN or infinity in a row: the bound is not finite.
    return jnp.where(jnp.isfinite(ma) & jnp.isfinite(mg), ma * mg * bound, ma * mg * jnp.nan)


def product_norms(a, g):
    """``(norms, kernel_rows)`` of the kernel gradients ``A_i^T G_i`` for ``a: (rows, T,
    d)``, ``g: (rows, T, p)`` in float32 (JAX; module docstring): ``||a_i|| ||g_i||`` for
    ``T = 1``; else the materialised ``(rows, d, p)`` products (:func:`materialise`), which
    also give the clipped sum, and their norms; else :func:`gram_norms` (``kernel_rows``
    ``None``)."""
    import jax.numpy as jnp

    t, d, p = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return array_norms(a[:, 0]) * array_norms(g[:, 0]), None
    if materialise(t, d, p):
        kernel_rows = jnp.einsum("btd,btp->bdp", a, g, precision=EXACT)
        return array_norms(kernel_rows), kernel_rows
    return gram_norms(a, g), None


class DenseRule(GhostRule):
    """``Dense`` on ``(b, d)`` or ``(b, ..., d)`` inputs (module docstring)."""

    name = "dense"

    def applies(self, layer) -> bool:
        return stored_weights(layer)

    def product_factors(self, layer, a, g):
        return rows(a, a.shape[-1]), rows(g, layer.units)

    def apply_kernel(self, layer, a, kernel):
        return compat.array_ops().matmul(a, kernel)

    def linear(self, layer, a):
        import tensorflow as tf

        z = tf.tensordot(a, layer.kernel, [[a.shape.rank - 1], [0]])
        z.set_shape(a.shape[:-1].concatenate([layer.units]))
        return z + layer.bias if layer.use_bias else z

    def kernel_sq_norms(self, layer, a, g):
        import tensorflow as tf

        if a.shape.rank == 2:
            a, g = tf.cast(a, tf.float64), tf.cast(g, tf.float64)
            return tf.reduce_sum(tf.square(a), axis=1) * tf.reduce_sum(tf.square(g), axis=1)
        return product_sq_norms(*self.product_factors(layer, a, g))

    def kernel_rows(self, layer, a, g):
        if a.shape.rank == 2:
            return None  # a_i g_i^T: the ghost norm is always cheaper
        return product_rows(*self.product_factors(layer, a, g), layer.kernel.shape)

    def shift(self, layer, a_new, a, g, kernel_rows):
        import tensorflow as tf

        if a.shape.rank == 2:
            shift = tf.reduce_sum(a_new * a, axis=1, keepdims=True) * g
            return shift + g if layer.use_bias else shift
        width, g_rows = a.shape[-1], rows(g, layer.units)
        shift = product_shift(rows(a_new, width), rows(a, width), g_rows, kernel_rows)
        if layer.use_bias:
            shift = shift + tf.reduce_sum(g_rows, axis=1, keepdims=True)
        return tf.reshape(shift, tf.shape(g))


register_ghost_rule(keras.layers.Dense, DenseRule())

__all__ = [
    "UNIT_ROUNDOFF",
    "DenseRule",
    "gram_norms",
    "materialise",
    "product_norms",
    "product_rows",
    "product_shift",
    "product_sq_norms",
]
