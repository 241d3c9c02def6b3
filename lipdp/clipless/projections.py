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
  (``svd``, float32), times ``1 + margin`` for round-off;
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

**Backends.** Every function is written once with :func:`lipdp.foundation.compat.array_ops`
(``keras.ops`` on Keras 3 -- TensorFlow or JAX --, the TensorFlow shim on Keras 2), takes the
backend's arrays and runs under ``tf.function`` and ``jax.jit`` alike (the Python loops
unroll). Two per-backend points: :func:`matmul` uses TensorFlow's transpose flags on
TensorFlow (the numbers lipdp has always produced: a flagged product does not sum in the
order of a product of an explicit transpose) and :func:`certified_operator_norm` (float64
eigenvalues: in the graph on TensorFlow, on the host through ``jax.pure_callback`` on JAX).
"""

from __future__ import annotations

from lipdp.foundation import compat

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
#: ``tf.math.l2_normalize``'s default floor on the squared norm.
_L2_EPSILON = 1e-12


def matmul(a, b, *, transpose_a: bool = False, transpose_b: bool = False):
    """``a^(T) b^(T)``, the transposes as the flags say.

    Per-backend hook: on TensorFlow ``tf.matmul`` with its transpose flags, the product
    lipdp has always computed (its flagged kernel does not sum in the order a product with
    an explicit transpose does, so the flags keep the TensorFlow numbers bitwise); elsewhere
    ``ops.matmul`` of the transposed operands.
    """
    if compat.keras_backend() == "tensorflow":
        import tensorflow as tf

        return tf.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
    ops = compat.array_ops()
    a = ops.transpose(a) if transpose_a else a
    b = ops.transpose(b) if transpose_b else b
    return ops.matmul(a, b)


def l2_normalize(x, axis=-1):
    """``x / max(||x||, 1e-6)`` along ``axis``, as ``tf.math.l2_normalize`` computes it:
    ``x * rsqrt(max(sum x^2, 1e-12))`` (the same operations, so the same numbers)."""
    ops = compat.array_ops()
    square_sum = ops.sum(ops.square(x), axis=axis, keepdims=True)
    return x * ops.rsqrt(ops.maximum(square_sum, _L2_EPSILON))


def frobenius_norm(x):
    """``sqrt(sum x^2)`` over every entry (``tf.norm``'s Euclidean norm)."""
    ops = compat.array_ops()
    return ops.sqrt(ops.sum(ops.square(x)))


def clip_by_norm(x, limit, axes=None):
    """``x min(1, limit / ||x||)``, the norm over ``axes`` (every axis: ``None``), in the
    operations of ``tf.clip_by_norm``: ``x limit / max(||x||, limit)`` with ``||x||`` taken
    as 0 where ``sum x^2 = 0`` (no square root of 0 on the gradient's path, so a zero ``x``
    has a finite gradient). ``limit > 0``: a zero ``x`` stays zero."""
    ops = compat.array_ops()
    limit = ops.cast(limit, x.dtype)
    l2sum = ops.sum(x * x, axis=axes, keepdims=True)
    positive = l2sum > 0
    l2sum_safe = ops.where(positive, l2sum, ops.ones_like(l2sum))
    l2norm = ops.where(positive, ops.sqrt(l2sum_safe), l2sum)
    return (x * limit) / ops.maximum(l2norm, limit)


def power_iteration(matrix, u, iterations: int):
    """Estimate the largest singular value of ``matrix`` (shape ``(m, n)``).

    ``u`` (shape ``(1, n)``) is a warm start, normally the vector returned by the
    previous call on the same layer: weights move little between steps, so a few
    iterations per step keep the estimate converged.

    Returns ``(sigma, u)`` with ``sigma = ||matrix u^T|| <= sigma_max`` (an
    under-estimate, hence the margin used by the projections) and the new unit
    vector ``u``.
    """
    ops = compat.array_ops()
    u = l2_normalize(u, axis=-1)
    for _ in range(iterations):
        v = l2_normalize(matmul(u, matrix, transpose_b=True), axis=-1)  # (1, m)
        u = l2_normalize(matmul(v, matrix), axis=-1)  # (1, n)
    sigma = frobenius_norm(matmul(u, matrix, transpose_b=True))
    return ops.stop_gradient(sigma), ops.stop_gradient(u)


def largest_singular_value(matrix):
    """Exact (up to float round-off) largest singular value."""
    ops = compat.array_ops()
    return ops.max(ops.svd(matrix, compute_uv=False))


def _gram(matrix):
    """The Gram matrix on the smaller side: ``M^T M`` (``m >= n``) or ``M M^T``."""
    m, n = matrix.shape
    if m >= n:
        return matmul(matrix, matrix, transpose_a=True)
    return matmul(matrix, matrix, transpose_b=True)


def gershgorin_sigma_bound(matrix):
    """Certified upper bound on ``sigma_max``: sqrt of the largest absolute row sum
    of the Gram matrix (on the smaller side). Tight for nearly orthogonal matrices."""
    ops = compat.array_ops()
    return ops.sqrt(ops.max(ops.sum(ops.abs(_gram(matrix)), axis=1)))


def bjorck_step(matrix):
    """One Björck orthogonalisation step, ``W <- 1.5 W - 0.5 W W^T W``.

    The product is ordered so that the Gram matrix has the smaller dimension.
    """
    m, n = matrix.shape
    if m >= n:
        gram_term = matmul(matrix, matmul(matrix, matrix, transpose_a=True))
    else:
        gram_term = matmul(matmul(matrix, matrix, transpose_b=True), matrix)
    return 1.5 * matrix - 0.5 * gram_term


def spectral_ball_projection(matrix, *, margin: float = DEFAULT_MARGIN, radius: float = 1.0):
    """Rescale ``matrix`` so that its spectral norm is at most ``radius``.

    ``W <- W / max(1, sigma_max (1 + margin) / C)`` with the exact ``sigma_max``. A
    matrix already inside the ball is left unchanged, so the projection does not
    fight the optimizer.
    """
    ops = compat.array_ops()
    sigma = largest_singular_value(matrix)
    return matrix / ops.maximum(ops.cast(1.0, matrix.dtype), sigma * (1.0 + margin) / radius)


def orthogonal_projection(
    matrix,
    u,
    *,
    power_iterations: int = DEFAULT_POWER_ITERATIONS,
    bjorck_iterations: int = DEFAULT_BJORCK_ITERATIONS,
    margin: float = DEFAULT_MARGIN,
    radius: float = 1.0,
):
    """Map ``matrix`` to (nearly) ``radius`` times the closest matrix with orthonormal
    rows or columns.

    Certified normalisation to spectral norm <= 2, then ``bjorck_iterations``
    Björck steps (see the module docstring): the result has spectral norm at most
    ``radius`` whatever the accuracy of the warm-started power iteration, which only
    decides how close to orthogonal the result is. Returns ``(projected, u)``.
    """
    ops = compat.array_ops()
    sigma, u = power_iteration(matrix, u, power_iterations)
    divisor = ops.maximum(sigma * (1.0 + margin), 0.5 * gershgorin_sigma_bound(matrix))
    matrix = matrix / divisor
    for _ in range(bjorck_iterations):
        matrix = bjorck_step(matrix)
    return matrix * (_BJORCK_ROUNDOFF * radius), u


def frobenius_ball_projection(matrix, *, radius: float = 1.0):
    """Euclidean projection onto ``{W : ||W||_F <= radius}``: ``W / max(1, ||W|| / C)``,
    with ``||W||`` rounded up by ``NORM_ROUNDOFF`` so that float32 round-off of the
    division cannot leave the result a hair outside the ball."""
    ops = compat.array_ops()
    norm = frobenius_norm(matrix) * (1.0 + NORM_ROUNDOFF)
    return matrix / ops.maximum(ops.cast(1.0, matrix.dtype), norm / radius)


def certified_operator_norm(matrix, norm: str):
    """An upper bound on the spectral norm of ``matrix``, from its entries alone.

    ``norm="spectral"``: ``sigma_max`` from the eigenvalues of the smaller Gram matrix,
    computed in float64; ``norm="frobenius"``: ``||W||_F`` (``>= sigma_max``), summed in
    float64. Both are multiplied by ``1 + NORM_ROUNDOFF`` and rounded to float32.

    **Why float64 certifies the float32 kernel, for every kernel.** Every float32 entry is
    exact in float64, and so is every product of two of them (24 + 24 significant bits
    <= 53; the exponents of float32 squares, 2^-298..2^256, are inside float64's normal
    range: no overflow, no underflow, whatever the entries -- 1e-38 and 3e38 included).
    The Gram ``G = M^T M`` (``n x n``, ``n`` the smaller side, sums of ``m`` terms) is then
    formed with ``|fl(G) - G| <= gamma_m |M|^T |M|`` entrywise (``gamma_m = m u / (1 - m u)``,
    ``u = 2^-53``; any summation order), so ``||fl(G) - G||_2 <= gamma_m ||M||_F^2 <=
    gamma_m n sigma_max^2``; the symmetric eigen-solver is backward stable,
    ``|lambda_hat - lambda| <= p(n) u ||G||_2`` with ``p(n)`` a low-degree polynomial
    (``n^2`` is generous). For ``m, n <= 10^4`` both are below ``10^-7`` relative on
    ``lambda_max = sigma_max^2``, i.e. ``5 10^-8`` on ``sigma_max`` -- under the final
    float32 rounding (``2^-24 = 6 10^-8``), and ``NORM_ROUNDOFF = 10^-6`` covers the sum
    more than ten times. A ``sigma_max`` above float32's range rounds to ``inf`` (the bound
    then reads the radius ``C``: ``min(C, inf)``); a kernel with a NaN or an infinity
    gives NaN (as on TensorFlow: the step's noise is NaN, nothing finite is released).

    **Subnormal numbers (JAX).** XLA on CPU flushes subnormal float32 numbers to 0 (inputs
    and results of its arithmetic). The certificate therefore reads the kernel's stored
    bits (a bitcast, no arithmetic) and bounds both the stored kernel ``M`` and the one the
    step computes with, ``M + E`` (``E``: minus the subnormal entries, ``||E||_2 <=
    sqrt(#subnormals) 2^-126``): ``sigma_max(M) + sqrt(#subnormals) 2^-126``; a positive
    result below ``2^-126`` is returned as ``2^-126`` (a subnormal would be read as 0).

    **Backends.** TensorFlow: in the graph (``tf.linalg.eigvalsh``; differentiable, the
    adversarial soundness search differentiates through it). JAX: without
    ``jax_enable_x64`` (which cannot be switched on inside a ``jax.jit`` trace) XLA has no
    float64, so the same float64 computation runs on the host in numpy
    (:func:`certified_operator_norm_float64`) through ``jax.pure_callback``: inside the
    compiled step it reads the very kernel of the step's state (the weights the gradient
    is taken at) and returns a float32 scalar of the trace -- not a constant baked in the
    step, which is therefore not traced again when the weights move. Not differentiable
    on JAX (nothing differentiates the bound there). A float32 certificate would need a
    derived slack for the Gram's round-off (``gamma_m`` with ``u = 2^-24``: up to
    ``10^-3`` relative for large kernels) and rescaling against float32 over/underflow
    (``1e20`` entries overflow the Gram, ``1e-20`` ones underflow it to 0); the float64
    certificate needs neither and gives TensorFlow's number.
    """
    if norm not in ("spectral", "frobenius"):
        raise ValueError(f"norm must be 'spectral' or 'frobenius', got {norm!r}.")
    backend = compat.keras_backend()
    if backend == "jax":
        import jax
        import numpy as np

        if np.dtype(matrix.dtype) != np.float32:
            raise ValueError(f"certified_operator_norm takes float32 kernels, got {matrix.dtype}.")

        def host(bits):  # the stored bits, subnormals included (docstring)
            return certified_operator_norm_float64(_float32_bits_to_float64(bits), norm)

        bits = jax.lax.bitcast_convert_type(matrix, np.uint32)
        shape = jax.ShapeDtypeStruct((), np.float32)
        return jax.pure_callback(host, shape, bits, vmap_method="sequential")
    if backend != "tensorflow":
        raise ValueError(
            "adaptive_norm=True needs float64 eigenvalues (certified_operator_norm), which "
            f"the {backend} backend does not compute: use adaptive_norm=False "
            "or train on KERAS_BACKEND=tensorflow."
        )
    import tensorflow as tf

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
    return tf.cast(value * (1.0 + NORM_ROUNDOFF), matrix.dtype)


def _float32_bits_to_float64(bits):
    """The float64 values of float32 numbers given by their bits (``uint32``), decoded with
    integer arithmetic and ``ldexp`` -- exact, subnormals included, even where the thread
    reads subnormal float32 numbers as 0 (XLA's callbacks run with the flush-to-zero and
    denormals-are-zero flags set, so ``astype(float64)`` would give 0)."""
    import numpy as np

    bits = np.asarray(bits, np.uint32).astype(np.int64)
    sign = np.where(bits >> 31, -1.0, 1.0)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    finite = np.ldexp(
        np.where(exponent > 0, mantissa + 2**23, mantissa).astype(np.float64),
        np.maximum(exponent, 1) - 150,
    )
    special = np.where(mantissa == 0, np.inf, np.nan)  # exponent 255
    return sign * np.where(exponent == 255, special, finite)


def certified_operator_norm_float64(matrix, norm: str):
    """:func:`certified_operator_norm` in numpy on the host (its float64 computation, the
    JAX backend's certificate): ``matrix`` the float64 values of a float32 kernel
    (:func:`_float32_bits_to_float64` of its bits, or a float32 array); returns a float32
    numpy scalar."""
    import numpy as np

    dtype = np.dtype(np.float32)
    wide = np.asarray(matrix).astype(np.float64)
    if not np.all(np.isfinite(wide)):  # numpy's eigvalsh refuses them; TensorFlow: NaN
        return np.asarray(np.nan, dtype)
    if norm == "frobenius":
        value = np.sqrt(np.sum(np.square(wide)))
    else:
        m, n = wide.shape
        gram = wide.T @ wide if m >= n else wide @ wide.T
        value = np.sqrt(max(float(np.max(np.linalg.eigvalsh(gram))), 0.0))
    # XLA on CPU reads subnormal numbers as 0: the kernel the step computes with differs
    # from the stored one by E, ||E||_2 <= ||E||_F <= sqrt(#subnormals) * tiny.
    tiny = float(np.finfo(dtype).tiny)
    subnormal = int(np.count_nonzero((wide != 0) & (np.abs(wide) < tiny)))
    value = value + np.sqrt(subnormal) * tiny
    with np.errstate(over="ignore"):  # above float32's range: inf (module docstring)
        result = np.asarray(value * (1.0 + NORM_ROUNDOFF)).astype(dtype)
    if 0.0 < value and result < tiny:  # a subnormal result would be read as 0
        result = np.asarray(tiny, dtype)
    return result


def l2_ball_projection(vector, radius: float):
    """Exact Euclidean projection onto the ball of the given radius (:func:`clip_by_norm`
    over every axis)."""
    return clip_by_norm(vector, radius)
