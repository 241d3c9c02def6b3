r"""The JAX forms of the slice's layer calls, loss and projections (``jax.numpy``).

Each function is the same mathematics as its TensorFlow twin, named in its docstring; the
layers dispatch to it when ``keras.backend.backend() == "jax"`` (their TensorFlow path is
unchanged). Prototype: the next step writes each pair once with
:func:`lipdp.foundation.compat.array_ops` and removes the twin.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lipdp.clipless import projections as tf_projections


# ------------------------------------------------------------------------- layers
def finite_rows(values):
    """``(batch,)``: no NaN and no infinity in the row (:func:`lipdp.core.records.finite_rows`)."""
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        return jnp.ones(values.shape[:1], bool)
    return jnp.all(jnp.isfinite(jnp.reshape(values, (values.shape[0], -1))), axis=1)


def zero_rows(keep, values):
    """The rows where ``keep`` is False replaced by zeros (:func:`lipdp.core.records.zero_rows`)."""
    mask = jnp.reshape(keep, (-1,) + (1,) * (values.ndim - 1))
    return jnp.where(mask, values, jnp.zeros_like(values))


def clip_rows(inputs, bound):
    """Each row ``x`` as ``x min(1, B / ||x||)`` without overflow
    (:func:`lipdp.clipless.layers.inputs.clip_rows`: the same formula, ``u = x / max|x|``)."""
    axes = tuple(range(1, inputs.ndim))
    scale = jnp.max(jnp.abs(inputs), axis=axes, keepdims=True)
    unit = inputs / jnp.where(scale > 0, scale, jnp.ones_like(scale))
    norm = jnp.sqrt(jnp.sum(jnp.square(unit), axis=axes, keepdims=True))
    safe_norm = jnp.where(norm > 0, norm, jnp.ones_like(norm))
    return unit * jnp.minimum(scale, jnp.asarray(bound, inputs.dtype) / safe_norm)


def bounded_input(inputs, bound, enforce_clipping):
    """``DP_BoundedInput.call``: non-finite rows zeroed (S9), then clipped to ``bound``."""
    inputs = zero_rows(finite_rows(inputs), inputs)
    return clip_rows(inputs, bound) if enforce_clipping else inputs


def dense(inputs, kernel):
    """``y_t = W^T x_t`` on the last axis (``tf.tensordot(x, W, [[-1], [0]])``)."""
    return jnp.tensordot(inputs, kernel, axes=[[-1], [0]])


def group_sort(x, n):
    """Sort the last axis by groups of ``n`` with ``jnp.sort``.

    JAX differentiates ``sort`` by sorting the operand together with an iota and gathering
    the tangent with the resulting permutation: the Jacobian is that permutation matrix,
    ties included (a tie keeps the order of the iota), so ``||J^T g|| = ||g||`` everywhere --
    the property ``sort_pairs``'s custom gradient gives on TensorFlow (rule S1).
    """
    groups = jnp.reshape(x, x.shape[:-1] + (x.shape[-1] // n, n))
    return jnp.reshape(jnp.sort(groups, axis=-1), x.shape)


def clip_cotangent(inputs, clip_value, normalizer=None):
    """``DP_ClipGradient.call``: the identity, whose backward pass clips each row's cotangent
    to ``clip_value / n`` (``n``: ``normalizer``, the rows of the batch when ``None``), the
    rule of :func:`lipdp.clipless.layers.clipping._clip_cotangent` (``tf.custom_gradient``
    there, ``jax.custom_vjp`` here). ``clip_value`` is an argument (its value comes from the
    step's state; its cotangent is 0), ``normalizer`` a static number."""
    return _clipped(inputs, jnp.asarray(clip_value, inputs.dtype), normalizer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _clipped(x, clip_value, normalizer):
    return x


def _clipped_forward(x, clip_value, normalizer):
    return x, clip_value


def _clipped_backward(normalizer, clip_value, g):
    """``tf.clip_by_norm``'s formula row by row: ``g * l / max(||g_i||, l)``, ``l = C / n``
    (a zero row stays zero, no division by zero since ``l > 0``)."""
    rows = g.shape[0] if normalizer is None else normalizer
    limit = clip_value / jnp.asarray(rows, g.dtype)
    axes = tuple(range(1, g.ndim))
    norm = jnp.sqrt(jnp.sum(jnp.square(g), axis=axes, keepdims=True))
    return g * limit / jnp.maximum(norm, limit), jnp.zeros_like(clip_value)


_clipped.defvjp(_clipped_forward, _clipped_backward)


# --------------------------------------------------------------------------- loss
def tau_cce_rows(tau, y_true, y_pred):
    """Per-row ``DP_TauCategoricalCrossentropy`` (``CE(y, softmax(tau z)) / tau`` with the
    labels made admissible: ``max(y, 0) / max(sum, 1)``); a row whose label has a NaN or an
    infinity counts 0 with its label zeroed (rule S9, :meth:`DP_Loss.call`)."""
    y_pred = jnp.asarray(y_pred)
    y_true = jnp.asarray(y_true, y_pred.dtype)
    usable = finite_rows(y_true)
    y_true = zero_rows(usable, y_true)
    y_true = jnp.maximum(y_true, 0.0)
    y_true = y_true / jnp.maximum(jnp.sum(y_true, axis=-1, keepdims=True), 1.0)
    log_p = jax.nn.log_softmax(tau * y_pred, axis=-1)
    rows = -jnp.sum(y_true * log_p, axis=-1) / tau
    if rows.ndim > 1:
        rows = jnp.mean(jnp.reshape(rows, (rows.shape[0], -1)), axis=1)
    return jnp.where(usable, rows, 0.0)


# -------------------------------------------------------------------- projections
def _l2_normalize(v):
    """``tf.math.l2_normalize``: ``v / sqrt(max(sum v^2, 1e-12))``."""
    return v / jnp.sqrt(jnp.maximum(jnp.sum(jnp.square(v), axis=-1, keepdims=True), 1e-12))


def power_iteration(matrix, u, iterations):
    """:func:`lipdp.clipless.projections.power_iteration`."""
    u = _l2_normalize(u)
    for _ in range(iterations):
        v = _l2_normalize(u @ matrix.T)
        u = _l2_normalize(v @ matrix)
    sigma = jnp.linalg.norm(u @ matrix.T)
    return jax.lax.stop_gradient(sigma), jax.lax.stop_gradient(u)


def gershgorin_sigma_bound(matrix):
    """:func:`lipdp.clipless.projections.gershgorin_sigma_bound`."""
    m, n = matrix.shape
    gram = matrix.T @ matrix if m >= n else matrix @ matrix.T
    return jnp.sqrt(jnp.max(jnp.sum(jnp.abs(gram), axis=1)))


def bjorck_step(matrix):
    """:func:`lipdp.clipless.projections.bjorck_step`."""
    m, n = matrix.shape
    gram_term = matrix @ (matrix.T @ matrix) if m >= n else (matrix @ matrix.T) @ matrix
    return 1.5 * matrix - 0.5 * gram_term


def orthogonal_projection(matrix, u, *, power_iterations, bjorck_iterations, margin, radius):
    """:func:`lipdp.clipless.projections.orthogonal_projection` (same certificate: divide by
    ``max(sigma_est (1 + margin), gershgorin / 2)``, then Björck, then the round-off factor)."""
    sigma, u = power_iteration(matrix, u, power_iterations)
    matrix = matrix / jnp.maximum(sigma * (1.0 + margin), 0.5 * gershgorin_sigma_bound(matrix))
    for _ in range(bjorck_iterations):
        matrix = bjorck_step(matrix)
    return matrix * (tf_projections._BJORCK_ROUNDOFF * radius), u


def spectral_ball_projection(matrix, *, margin, radius):
    """:func:`lipdp.clipless.projections.spectral_ball_projection` (exact ``sigma_max``)."""
    sigma = jnp.max(jnp.linalg.svd(matrix, compute_uv=False))
    return matrix / jnp.maximum(1.0, sigma * (1.0 + margin) / radius)


def frobenius_ball_projection(matrix, *, radius):
    """:func:`lipdp.clipless.projections.frobenius_ball_projection`."""
    norm = jnp.linalg.norm(matrix) * (1.0 + tf_projections.NORM_ROUNDOFF)
    return matrix / jnp.maximum(1.0, norm / radius)


def projected_kernel(layer, kernel, u):
    """``(kernel, u)`` after ``layer``'s projection (:meth:`ConstrainedKernelLayer._project`),
    a pure function of the values: what the jit-compiled step applies after the update."""
    matrix = jnp.reshape(kernel, (-1, kernel.shape[-1]))
    radius = layer.weight_norm_bound
    if layer.constraint == "frobenius":
        projected = frobenius_ball_projection(matrix, radius=radius)
    elif layer.constraint == "spectral":
        projected = spectral_ball_projection(matrix, margin=layer.margin, radius=radius)
    else:
        projected, u = orthogonal_projection(
            matrix,
            u,
            power_iterations=layer.power_iterations,
            bjorck_iterations=layer.bjorck_iterations,
            margin=layer.margin,
            radius=radius,
        )
    return jnp.reshape(projected, kernel.shape), u
