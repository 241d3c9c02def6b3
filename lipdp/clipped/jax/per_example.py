r"""Per-example gradients, their norms and the clipped sum, under ``jit`` (pure functions).

For a batch of rows ``i`` with per-example losses ``l_i(theta)``:

1. ``g_i = grad l_i(theta)`` for every row at once: ``jax.vmap(jax.grad(l))`` over the
   rows, each row's loss computed on a batch of one (:func:`per_example_gradients`), so row
   ``i``'s loss is a function of row ``i`` only -- no layer can mix the rows of a batch
   (rule S2; the non-trainable state is checked not to change, :mod:`lipdp.clipped.jax.model`).
2. ``||g_i||`` over *all* trainable variables (flat clipping), in float32 without
   overflow or underflow: ``m_i ||g_i / m_i||`` with ``m_i`` the largest ``|entry|`` of the
   row (:func:`row_norms`, from :mod:`lipdp.clipped.per_example.scale`, where both
   backends' row scaling lives; the ghost norms use it too). A gradient with a NaN or an
   infinity has a non-finite norm.
3. ``C_i``: :meth:`lipdp.clipped.clipping.Clipping.factors`, the rule the TensorFlow
   models use (written once, in ``keras.ops``): ``min(1, R / ||g_i||)`` (flat), ``R /
   (||g_i|| + gamma)`` (automatic), ``R / Z`` if ``||g_i|| <= Z`` else 0 (global); in
   every mode ``||C_i g_i|| <= R``.
4. ``sum_i w_i C_i g_i`` (:func:`clipped_sum`), with ``w_i`` in ``[0, 1]`` the row's weight
   (0 for padding, a neutralised record, or a non-finite norm; those rows are zeroed by
   selection, not multiplied, so a NaN cannot leak into the sum).

**Sensitivity.** Adding or removing one row adds or removes one term ``w_i C_i g_i``, of
norm at most ``R`` (up to float32 round-off of the norm, relative ~1e-6, covered by
:data:`lipdp.core.noise.ROUNDOFF_SLACK`). The step divides the sum by the loss
normaliser ``b`` (the expected batch size under Poisson sampling, the declared batch size
otherwise; never the number of rows sampled, which is private), so the released average
moves by at most ``R (1 + slack) / b``: its Gaussian noise has standard deviation
``sigma R (1 + slack) / b`` on every coordinate.
"""

from __future__ import annotations

from lipdp.clipped.per_example.scale import array_norms, row_norms, scaled_rows


def per_example_gradients(row_loss, params, *rows):
    """``(grads, aux)`` of ``row_loss(params, *row) -> (loss, aux)`` for every row of
    ``rows`` (arrays or nests sharing the leading axis): each leaf of ``grads`` has the
    row axis first."""
    import jax

    in_axes = (None,) + (0,) * len(rows)
    return jax.vmap(jax.grad(row_loss, has_aux=True), in_axes=in_axes)(params, *rows)


def usable_rows(norms, factors, weights):
    """The rows that enter the sum: weight above 0, finite norm and factor."""
    import jax.numpy as jnp

    return (weights > 0) & jnp.isfinite(norms) & jnp.isfinite(factors)


def clipped_sum(grads, norms, factors, weights):
    """``sum_i w_i C_i g_i`` for every leaf of ``grads`` (module docstring): the rows not
    :func:`usable_rows` are selected out, never multiplied by 0 (``0 * inf`` is NaN)."""
    import jax
    import jax.numpy as jnp

    usable = usable_rows(norms, factors, weights)
    scale = weights * factors
    scale = jnp.where(usable, scale, 0.0)

    def summed(g):
        kept = jnp.where(jnp.reshape(usable, (-1,) + (1,) * (g.ndim - 1)), g, 0.0)
        # Full float32 products (accelerators' default may use bfloat16 passes): the term
        # row i adds must be C_i g_i itself, whose norm was bounded.
        return jnp.tensordot(scale.astype(g.dtype), kept, axes=1, precision="highest")

    return jax.tree_util.tree_map(summed, grads)


__all__ = [
    "clipped_sum",
    "array_norms",
    "per_example_gradients",
    "row_norms",
    "scaled_rows",
    "usable_rows",
]
