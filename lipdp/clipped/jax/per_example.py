r"""Per-example gradients, their norms and the clipped sum, under ``jit`` (pure functions).

For a batch of rows ``i`` with per-example losses ``l_i(theta)``:

1. ``g_i = grad l_i(theta)`` for every row at once: ``jax.vmap(jax.grad(l))`` over the
   rows, each row's loss computed on a batch of one (:func:`per_example_gradients`), so row
   ``i``'s loss is a function of row ``i`` only -- no layer can mix the rows of a batch
   (rule S2; the non-trainable state is checked not to change, :mod:`lipdp.clipped.jax.model`).
2. ``||g_i||`` over *all* trainable variables (flat clipping), in float32 without
   overflow or underflow: ``m_i ||g_i / m_i||`` with ``m_i`` the largest ``|entry|`` of the
   row (:func:`row_norms`). A gradient with a NaN or an infinity has a non-finite norm.
3. ``C_i`` (:func:`clip_factors`): ``min(1, R / ||g_i||)`` (flat), ``R / (||g_i|| +
   gamma)`` (automatic), ``R / Z`` if ``||g_i|| <= Z`` else 0 (global); in every mode
   ``||C_i g_i|| <= R`` (:class:`lipdp.clipped.clipping.Clipping`).
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


def per_example_gradients(row_loss, params, *rows):
    """``(grads, aux)`` of ``row_loss(params, *row) -> (loss, aux)`` for every row of
    ``rows`` (arrays or nests sharing the leading axis): each leaf of ``grads`` has the
    row axis first."""
    import jax

    in_axes = (None,) + (0,) * len(rows)
    return jax.vmap(jax.grad(row_loss, has_aux=True), in_axes=in_axes)(params, *rows)


def _row_major(leaf):
    import jax.numpy as jnp

    return jnp.reshape(leaf, (leaf.shape[0], -1)).astype("float32")


def row_norms(grads):
    """``||g_i||`` over every leaf of ``grads`` (float32, shape ``(rows,)``): scaled by the
    row's largest magnitude, so that neither squares of large entries overflow nor those
    of tiny ones underflow; NaN or infinite for a gradient holding a NaN or an infinity."""
    import jax
    import jax.numpy as jnp

    leaves = [_row_major(g) for g in jax.tree_util.tree_leaves(grads)]
    scale = jnp.max(jnp.stack([jnp.max(jnp.abs(g), axis=1) for g in leaves]), axis=0)
    safe = jnp.where(scale > 0, scale, 1.0)
    sums = sum(jnp.sum(jnp.square(g / safe[:, None]), axis=1) for g in leaves)
    return jnp.where(scale > 0, scale * jnp.sqrt(sums), jnp.where(jnp.isnan(scale), scale, 0.0))


def clip_factors(clipping, norms):
    """``C_i`` of :class:`lipdp.clipped.clipping.Clipping` from the norms (float32); the
    caller drops the rows whose norm is not finite."""
    import jax.numpy as jnp

    r = jnp.float32(clipping.clip_norm)
    if clipping.mode == "flat":
        return r / jnp.maximum(norms, r)
    if clipping.mode == "automatic":
        return r / (norms + jnp.float32(clipping.gamma))
    if clipping.mode == "global":
        z = jnp.float32(clipping.threshold)
        return jnp.where(norms <= z, r / z, 0.0)
    raise ValueError(
        f"{clipping.mode!r} clipping is not available on the JAX backend: use 'flat', "
        "'automatic' or 'global' (per-layer clipping runs on KERAS_BACKEND=tensorflow)."
    )


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


__all__ = ["clip_factors", "clipped_sum", "per_example_gradients", "row_norms", "usable_rows"]
