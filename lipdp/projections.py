"""Projections of weight matrices onto Lipschitz constraint sets.

lipdp trains constrained layers *by projection* (rule S3): the forward pass uses
the stored kernel itself, the gradient is taken with respect to that kernel, and
after each optimizer step the kernel is mapped back onto its feasible set. No
differentiable re-parametrisation sits between the variable and the loss, so the
per-example gradient bound of a layer never has to account for the Jacobian of
a normalisation.

Three sets are used:

* the **spectral ball** ``{W : ||W||_2 <= 1}`` (Lipschitz-1 dense maps);
* the **orthogonal matrices** (gradient-norm-preserving maps), reached with
  Björck's iteration ``W <- 1.5 W - 0.5 W W^T W``;
* the **Frobenius ball** ``{W : ||W||_F <= 1}`` (exact, no iteration needed).

Safety (rule S4). Power iteration approaches the largest singular value from
below: ``sigma_est <= sigma_max``. Dividing by ``sigma_est`` alone could leave a
norm slightly above one, so the spectral projections divide by
``sigma_est * (1 + margin)``. Björck's step has a second safety property: its
action on each singular value is ``s -> 1.5 s - 0.5 s^3``, whose maximum over
``[0, 2]`` is exactly 1 (reached at ``s = 1``); hence as soon as the normalised
matrix has norm below 2 (i.e. the power-iteration estimate is not off by a factor
two), every Björck step lands in the unit spectral ball in exact arithmetic. The
exact operator norms can be audited with :mod:`lipdp.audit`.
"""

from __future__ import annotations

import tensorflow as tf

#: Relative margin applied to the power-iteration estimate of the largest
#: singular value. Float32 round-off is ~1e-7 relative; the margin also absorbs the
#: (small) under-estimation of a warm-started power iteration.
DEFAULT_MARGIN = 1e-3
DEFAULT_POWER_ITERATIONS = 8
DEFAULT_BJORCK_ITERATIONS = 15


def power_iteration(matrix: tf.Tensor, u: tf.Tensor, iterations: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Estimate the largest singular value of ``matrix`` (shape ``(m, n)``).

    ``u`` (shape ``(1, n)``) is a warm start, normally the vector returned by the
    previous call on the same layer: weights move little between steps, so a few
    iterations per step keep the estimate converged.

    Returns ``(sigma, u)`` with ``sigma = ||matrix u^T|| <= sigma_max`` (an
    under-estimate, hence the margin used by the projections) and the new unit
    vector ``u``.
    """
    u = tf.math.l2_normalize(u, axis=-1)
    for _ in range(iterations):
        v = tf.math.l2_normalize(tf.matmul(u, matrix, transpose_b=True), axis=-1)  # (1, m)
        u = tf.math.l2_normalize(tf.matmul(v, matrix), axis=-1)  # (1, n)
    sigma = tf.norm(tf.matmul(u, matrix, transpose_b=True))
    return tf.stop_gradient(sigma), tf.stop_gradient(u)


def bjorck_step(matrix: tf.Tensor) -> tf.Tensor:
    """One Björck orthogonalisation step, ``W <- 1.5 W - 0.5 W W^T W``.

    The product is ordered so that the Gram matrix has the smaller dimension.
    """
    m, n = matrix.shape
    if m >= n:
        gram_term = tf.matmul(matrix, tf.matmul(matrix, matrix, transpose_a=True))
    else:
        gram_term = tf.matmul(tf.matmul(matrix, matrix, transpose_b=True), matrix)
    return 1.5 * matrix - 0.5 * gram_term


def spectral_ball_projection(
    matrix: tf.Tensor,
    u: tf.Tensor,
    *,
    power_iterations: int = DEFAULT_POWER_ITERATIONS,
    margin: float = DEFAULT_MARGIN,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Rescale ``matrix`` so that its spectral norm is at most one.

    ``W <- W / max(1, sigma_est (1 + margin))``. A matrix already inside the
    ball (by the margin) is left unchanged, so the projection does not fight the
    optimizer. Returns ``(projected, u)``.
    """
    sigma, u = power_iteration(matrix, u, power_iterations)
    scale = tf.maximum(tf.cast(1.0, matrix.dtype), sigma * (1.0 + margin))
    return matrix / scale, u


def orthogonal_projection(
    matrix: tf.Tensor,
    u: tf.Tensor,
    *,
    power_iterations: int = DEFAULT_POWER_ITERATIONS,
    bjorck_iterations: int = DEFAULT_BJORCK_ITERATIONS,
    margin: float = DEFAULT_MARGIN,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Map ``matrix`` to (nearly) the closest matrix with orthonormal rows or columns.

    Spectral normalisation first (so that Björck's iteration converges), then
    ``bjorck_iterations`` Björck steps. All singular values end in ``[0, 1]``
    (see the module docstring) and converge to 1. Returns ``(projected, u)``.
    """
    sigma, u = power_iteration(matrix, u, power_iterations)
    matrix = matrix / (sigma * (1.0 + margin))
    for _ in range(bjorck_iterations):
        matrix = bjorck_step(matrix)
    return matrix, u


def frobenius_ball_projection(matrix: tf.Tensor) -> tf.Tensor:
    """Exact Euclidean projection onto ``{W : ||W||_F <= 1}``."""
    return matrix / tf.maximum(tf.cast(1.0, matrix.dtype), tf.norm(matrix))


def l2_ball_projection(vector: tf.Tensor, radius: float) -> tf.Tensor:
    """Exact Euclidean projection onto the ball of the given radius."""
    return tf.clip_by_norm(vector, radius)
