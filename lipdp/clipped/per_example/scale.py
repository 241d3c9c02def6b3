r"""Row scaling and round-off: how each backend keeps a row's norm from underflowing or
overflowing (rule S13), in one place.

A finite record can put a row's quantities far from 1 (inputs of ``1e-19`` and a
cotangent of ``1e19`` give a Dense kernel gradient near 1 whose ghost norm squares the
inputs to ``1e-38``, flushed to 0 in float32). Both backends therefore carry a row as a
*scale* times a *unit* part, and differ only in the precision the squares are formed in:

**TensorFlow (float64 squares).** The row's output cotangents are divided by ``s_i = max
|G_i|`` (:func:`unit_rows`; ``1 / s_i`` multiplied, exact for a power of 2 and rounded
once otherwise), every per-row gradient is computed for the unit cotangent and its
squares are summed in float64 (:func:`square_sums`), whose range holds every product of
inputs and cotangents of magnitude ``1e-30`` to ``1e30``; the factor is applied as the
float32 coefficient ``k_i = C_i s_i``, rounded once, or 0 outside float32's normal range
(:func:`float32_coefficients`). The argument: :mod:`lipdp.clipped.per_example.engine`.
When every row of a batch already has ``max |G_i|`` in :data:`MODERATE` (the common case:
cotangents of an ordinary loss), the division is skipped: ``s_i = 1`` and ``U_i = G_i``
(:func:`unit_rows` says why that keeps the same guarantee); on a CNN the division was a
full write of every layer's cotangents, 10 % of the clipped step at b = 1024 (issue 39).

**JAX (float32 only: JAX's default has no float64).** The norm of a row is computed from
the row divided by its largest magnitude ``m_i`` (:func:`scaled_rows`): ``m_i ||x_i /
m_i||`` (:func:`array_norms` for one array, :func:`row_norms` over every leaf of a
gradient), exact to float32 round-off for any finite scale; the ghost norms' Grams add
their float32 round-off bound (:func:`lipdp.clipped.per_example.dense.gram_norms`).

The two are kept apart on purpose: each is the numbers its backend has always released
(the TensorFlow scaling multiplies by ``1 / s_i`` and treats denormal rows as unscaled,
which float64 squares absorb; the float32 one divides by ``m_i`` for every positive
``m_i``), and neither imports the other backend (TensorFlow and JAX are imported by the
functions that use them).
"""

from __future__ import annotations

import numpy as np

#: float32's normal range: a coefficient outside it is not applied (module docstring).
TINY, HUGE = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)

#: Row maxima ``max |G_i|`` for which :func:`unit_rows` keeps the cotangents unscaled when a
#: whole batch lies within them (``2^-24`` to ``2^8``; its docstring gives the margins).
MODERATE = (2.0**-24, 2.0**8)


# ------------------------------------------------------------ TensorFlow: float64
def scaled(scales, t):
    """Row ``i`` of ``t`` times ``scales[i]`` (TensorFlow)."""
    import tensorflow as tf

    shape = tf.concat([tf.shape(scales), tf.ones([tf.rank(t) - 1], tf.int32)], axis=0)
    return tf.reshape(tf.cast(scales, t.dtype), shape) * t


def unit_rows(g):
    """``(U, s)`` with ``U_i = G_i / s_i``: ``s_i = max |G_i|`` (``s_i = 1`` for a row of
    zeros, of denormal numbers or with a NaN, so that ``1 / s_i`` is finite; a row with
    an infinity gets NaN entries, hence a NaN norm: dropped). The maximum and minimum are
    two reads; ``abs`` would write a copy of ``G``.

    **Moderate batches are not divided.** When every row's ``s_i`` (after the
    substitutions above) lies in :data:`MODERATE` ``= [2^-24, 2^8]``, the result is ``(G,
    1)``: ``s_i = 1`` and ``U = G`` itself, no pass over ``G`` (a batch with one row
    outside, an infinity included, is divided as above). The engine's argument
    (:mod:`lipdp.clipped.per_example.engine`) holds for *any* finite ``s_i > 0`` with
    ``U_i = G_i / s_i``: the norm is ``s_i^2 ||u_i||^2`` and the released part ``k_i u_i``
    with ``k_i = C_i s_i``, so the factor ``C_i ||g_i|| <= R`` is kept whatever ``s_i``.
    The choice ``s_i = max |G_i|`` serves only the range: the unit row's largest entry
    is 1, so float32 products of inputs of magnitude ``1e-30`` to ``1e30`` with it
    neither underflow nor overflow. With ``s_i = 1`` on a moderate batch the largest entry
    of ``U_i`` is in ``[2^-24, 2^8]`` instead: the largest products of such inputs with it
    are within ``[1e-30 * 2^-24, 1e30 * 2^8] = [5.9e-38, 2.6e32]``, still inside
    float32's normal range ``[1.2e-38, 3.4e38]`` (a sum of ``T`` of them up to ``T = 10^6``
    positions), and the squares are float64 as before: the same guarantee for the same
    inputs (``tests/clipped/test_extreme_records.py`` checks both paths against a float64
    reference)."""
    import tensorflow as tf

    # A dense tensor: a cotangent may come as IndexedSlices (TensorFlow 2.15, a gather
    # under row isolation), and both branches of the condition must return a Tensor.
    g = tf.convert_to_tensor(g)
    flat = tf.reshape(g, tf.stack([tf.shape(g)[0], -1]))
    s = tf.maximum(tf.reduce_max(flat, axis=1), -tf.reduce_min(flat, axis=1))
    s = tf.where(s >= TINY, s, tf.ones_like(s))  # its reciprocal is finite
    low, high = MODERATE
    moderate = tf.reduce_all((s >= low) & (s <= high))  # False for an infinite row
    return tf.cond(
        moderate,
        lambda: (tf.identity(g), tf.ones_like(s)),
        lambda: (scaled(1.0 / s, g), s),
    )


def float32_coefficients(values, keep=None):
    """``values`` (float64, ``>= 0``) as float32 multipliers: rounded once where they are
    in float32's normal range, 0 elsewhere (and where ``keep`` is False, or NaN): see
    :mod:`lipdp.clipped.per_example.engine` for why this keeps every contribution within
    its bound."""
    import tensorflow as tf

    usable = (values >= TINY) & (values <= HUGE)
    if keep is not None:
        usable &= keep
    return tf.cast(tf.where(usable, values, tf.zeros_like(values)), tf.float32)


def square_sums(per_row):
    """``sum`` of squares of each row over several ``(b, ...)`` tensors, in float64: each
    row's dot product with itself (a ``1 x n`` by ``n x 1`` product per row), which reads
    the float64 copy once where squaring then summing wrote a second copy (issue 39). The
    square of a float32 number is exact in float64 (48 significant bits of 53) and the
    sum of ``n`` of them is rounded as any float64 sum, relatively ``n 2^-53`` at most."""
    import tensorflow as tf

    sums = []
    for t in per_row:
        row = tf.reshape(tf.cast(t, tf.float64), tf.stack([tf.shape(t)[0], 1, -1]))
        sums.append(tf.reshape(tf.linalg.matmul(row, row, adjoint_b=True), [-1]))
    return tf.add_n(sums)


# ------------------------------------------------------------------ JAX: float32
def scaled_rows(x, axes):
    """``(x / m, m)`` with ``m`` the largest ``|entry|`` of each row over ``axes`` (row axis
    first); ``x`` is divided by 1 where ``m`` is 0 or not finite, so that a NaN or an
    infinity stays in ``m`` (JAX)."""
    import jax.numpy as jnp

    m = jnp.max(jnp.abs(x), axis=axes)
    return x / jnp.reshape(_divisor(m), (-1,) + (1,) * (x.ndim - 1)), m


def _divisor(m):
    """``m`` where it is positive and finite, else 1 (nothing to scale, or a non-finite
    row that stays non-finite)."""
    import jax.numpy as jnp

    return jnp.where((m > 0) & jnp.isfinite(m), m, 1.0)


def array_norms(x):
    """``||x_i||`` of each row of one array ``(rows, ...)`` in float32, scaled by the row's
    largest magnitude (:func:`scaled_rows`); ``m`` itself (NaN or infinite) for a row
    holding a NaN or an infinity (JAX)."""
    import jax.numpy as jnp

    axes = tuple(range(1, x.ndim))
    unit, m = scaled_rows(x, axes)
    return jnp.where(m > 0, m * jnp.sqrt(jnp.sum(jnp.square(unit), axis=axes)), m)


def row_norms(grads):
    """``||g_i||`` over every leaf of ``grads`` (float32, shape ``(rows,)``): scaled by the
    row's largest magnitude over all leaves (as :func:`array_norms`), so that neither
    squares of large entries overflow nor those of tiny ones underflow; not finite for a
    gradient holding a NaN or an infinity (NaN for a NaN) (JAX)."""
    import jax
    import jax.numpy as jnp

    leaves = [
        jnp.reshape(g, (g.shape[0], -1)).astype("float32") for g in jax.tree_util.tree_leaves(grads)
    ]
    scale = jnp.max(jnp.stack([jnp.max(jnp.abs(g), axis=1) for g in leaves]), axis=0)
    safe = _divisor(scale)
    sums = sum(jnp.sum(jnp.square(g / safe[:, None]), axis=1) for g in leaves)
    return jnp.where(scale > 0, scale * jnp.sqrt(sums), jnp.where(jnp.isnan(scale), scale, 0.0))


__all__ = [
    "HUGE",
    "MODERATE",
    "TINY",
    "array_norms",
    "float32_coefficients",
    "row_norms",
    "scaled",
    "scaled_rows",
    "square_sums",
    "unit_rows",
]
