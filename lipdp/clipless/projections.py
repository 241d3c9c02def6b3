"""Projections of weight matrices onto Lipschitz constraint sets.

lipdp trains constrained layers *by projection* (rule S3): the forward pass uses
the stored kernel itself, the gradient is taken with respect to that kernel, and
after each optimizer step the kernel is mapped back onto its feasible set. No
differentiable re-parametrisation sits between the variable and the loss, so the
per-example gradient bound of a layer never has to account for the Jacobian of
a normalisation.

Three sets are used, each of some radius ``C > 0`` (1 by default):

* the **spectral ball** ``{W : ||W||_2 <= C}`` (``C``-Lipschitz dense maps);
* ``C`` times the **orthogonal matrices** (gradient-norm-preserving maps for ``C = 1``),
  reached with Björck's iteration ``W <- 1.5 W - 0.5 W W^T W``;
* the **Frobenius ball** ``{W : ||W||_F <= C}`` (exact, no iteration needed).

Each is the unit set scaled by ``C``, so every projection below maps ``W / C`` onto the
unit set and multiplies back by ``C``. Lip-DP-SGD (:mod:`lipdp.clipless.layers.constrained`) reads
the *current* norm of a projected kernel instead of its radius:
:func:`certified_operator_norm` gives an upper bound on it from the weights alone.

Safety (rule S4). Power iteration approaches the largest singular value from
below (``sigma_est <= sigma_max``); after a noisy optimizer step a warm-started
estimate can be low by tens of percent, far more than any reasonable margin. The
projections therefore never rely on it alone:

* the **spectral ball** uses the exact largest singular value
  (``tf.linalg.svd``, float32), times ``1 + margin`` for round-off;
* the **orthogonal** projection divides by ``d = max(sigma_est (1 + margin),
  sqrt(r) / 2)`` where ``r`` is the largest absolute row sum of the Gram matrix
  ``W^T W`` (Gershgorin: ``sigma_max^2 <= r``). Hence ``||W / d||_2 <= 2``. Björck's
  step acts on each singular value as ``s -> 1.5 s - 0.5 s^3``, whose maximum over
  ``[0, 2]`` is exactly 1 (at ``s = 1``), and it maps ``[0, 1]`` into itself: after
  one step every singular value lies in ``[0, 1]``, whatever the quality of the
  estimate, and the following steps push them towards 1. Near an orthogonal
  matrix ``r`` is close to 1, so the certificate costs nothing in accuracy.

A final factor ``1 - 2^-20`` absorbs float32 round-off in the last Björck step.
Exact operator norms can be audited with :mod:`lipdp.clipless.audit`.
"""

from __future__ import annotations

import tensorflow as tf

#: Relative margin on the largest singular value (float32 round-off is ~1e-7
#: relative; the margin keeps projected kernels clearly inside the ball).
DEFAULT_MARGIN = 1e-3
#: Shrink factor after the last Björck step (round-off of the cubic polynomial).
_BJORCK_ROUNDOFF = 1.0 - 2.0**-20
DEFAULT_POWER_ITERATIONS = 8
DEFAULT_BJORCK_ITERATIONS = 15
#: Relative slack on a norm rounded to float32 (one float32 rounding is at most 2^-24
#: relative; the slack is generous).
NORM_ROUNDOFF = 1e-6


def power_iteration(
    matrix: tf.Tensor, u: tf.Tensor, iterations: int
) -> tuple[tf.Tensor, tf.Tensor]:
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


def largest_singular_value(matrix: tf.Tensor) -> tf.Tensor:
    """Exact (up to float round-off) largest singular value."""
    return tf.reduce_max(tf.linalg.svd(matrix, compute_uv=False))


def gershgorin_sigma_bound(matrix: tf.Tensor) -> tf.Tensor:
    """Certified upper bound on ``sigma_max``: sqrt of the largest absolute row sum
    of the Gram matrix (on the smaller side). Tight for nearly orthogonal matrices."""
    m, n = matrix.shape
    gram = (
        tf.matmul(matrix, matrix, transpose_a=True)
        if m >= n
        else tf.matmul(matrix, matrix, transpose_b=True)
    )
    return tf.sqrt(tf.reduce_max(tf.reduce_sum(tf.abs(gram), axis=1)))


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
    matrix: tf.Tensor, *, margin: float = DEFAULT_MARGIN, radius: float = 1.0
) -> tf.Tensor:
    """Rescale ``matrix`` so that its spectral norm is at most ``radius``.

    ``W <- W / max(1, sigma_max (1 + margin) / C)`` with the exact ``sigma_max``. A
    matrix already inside the ball is left unchanged, so the projection does not
    fight the optimizer.
    """
    sigma = largest_singular_value(matrix)
    return matrix / tf.maximum(tf.cast(1.0, matrix.dtype), sigma * (1.0 + margin) / radius)


def orthogonal_projection(
    matrix: tf.Tensor,
    u: tf.Tensor,
    *,
    power_iterations: int = DEFAULT_POWER_ITERATIONS,
    bjorck_iterations: int = DEFAULT_BJORCK_ITERATIONS,
    margin: float = DEFAULT_MARGIN,
    radius: float = 1.0,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Map ``matrix`` to (nearly) ``radius`` times the closest matrix with orthonormal
    rows or columns.

    Certified normalisation to spectral norm <= 2, then ``bjorck_iterations``
    Björck steps (see the module docstring): the result has spectral norm at most
    ``radius`` whatever the accuracy of the warm-started power iteration, which only
    decides how close to orthogonal the result is. Returns ``(projected, u)``.
    """
    sigma, u = power_iteration(matrix, u, power_iterations)
    divisor = tf.maximum(sigma * (1.0 + margin), 0.5 * gershgorin_sigma_bound(matrix))
    matrix = matrix / divisor
    for _ in range(bjorck_iterations):
        matrix = bjorck_step(matrix)
    return matrix * (_BJORCK_ROUNDOFF * radius), u


def frobenius_ball_projection(matrix: tf.Tensor, *, radius: float = 1.0) -> tf.Tensor:
    """Euclidean projection onto ``{W : ||W||_F <= radius}``: ``W / max(1, ||W|| / C)``,
    with ``||W||`` rounded up by ``NORM_ROUNDOFF`` so that float32 round-off of the
    division cannot leave the result a hair outside the ball."""
    norm = tf.norm(matrix) * (1.0 + NORM_ROUNDOFF)
    return matrix / tf.maximum(tf.cast(1.0, matrix.dtype), norm / radius)


def certified_operator_norm(matrix: tf.Tensor, norm: str) -> tf.Tensor:
    """An upper bound on the spectral norm of ``matrix``, from its entries alone.

    ``norm="spectral"``: ``sigma_max`` from the eigenvalues of the smaller Gram matrix,
    computed in float64 (the float32 entries are exact in float64, so the only error is
    the float64 eigen-solver's, ~1e-15 relative); ``norm="frobenius"``: ``||W||_F``
    (``>= sigma_max``), summed in float64. Both are multiplied by ``1 + NORM_ROUNDOFF``
    to cover the final rounding to float32. Differentiable (the adversarial soundness
    search differentiates through it).
    """
    wide = tf.cast(matrix, tf.float64)
    if norm == "frobenius":
        value = tf.sqrt(tf.reduce_sum(tf.square(wide)))
    elif norm == "spectral":
        m, n = matrix.shape
        gram = (
            tf.matmul(wide, wide, transpose_a=True)
            if m >= n
            else tf.matmul(wide, wide, transpose_b=True)
        )
        value = tf.sqrt(tf.maximum(tf.reduce_max(tf.linalg.eigvalsh(gram)), 0.0))
    else:
        raise ValueError(f"norm must be 'spectral' or 'frobenius', got {norm!r}.")
    return tf.cast(value * (1.0 + NORM_ROUNDOFF), matrix.dtype)


def l2_ball_projection(vector: tf.Tensor, radius: float) -> tf.Tensor:
    """Exact Euclidean projection onto the ball of the given radius."""
    return tf.clip_by_norm(vector, radius)
