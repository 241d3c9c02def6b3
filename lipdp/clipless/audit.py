"""Audit of the exact operator norms of constrained layers (rule S4).

The projections of :mod:`lipdp.clipless.projections` estimate the largest singular value by
power iteration, an estimate *from below*; they compensate with a safety margin.
This module checks the result independently: it computes the operator norm of
each constrained layer **as used in the forward pass** with float64 linear
algebra and compares it with the Lipschitz constant the layer declares to the
bound propagation.

* Dense kernels: largest singular value of the float32 kernel, float64 SVD.
* Convolutions: the linear map ``x -> conv2d(x, K_eff)`` on inputs of the layer's
  real shape ``(h, w, c_in)`` (zero padding, strides) is materialised in numpy by
  placing each kernel coefficient where the convolution reads it (float64; every entry
  of the matrix is one kernel coefficient or zero, so it is exact, whatever the
  backend) and its largest singular value is
  computed in float64. When ``h * w * c_in`` exceeds ``max_exact_size`` the
  matrix is not built and a Fourier **upper bound** is returned instead (see
  :func:`conv_operator_norm`).

Every norm is returned as an :class:`OperatorNorm`, a ``float`` that also carries
the method used (``"svd"`` exact, ``"fft-bound"`` upper bound).

Example::

    from lipdp.clipless.audit import audit_model, assert_sound
    for record in audit_model(model):
        print(record)
    assert_sound(model)  # raises SensitivityViolation listing the violations
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lipdp.clipless.layers.constrained import ConstrainedKernelLayer
from lipdp.clipless.layers.residual import DP_WrappedResidual
from lipdp.foundation import compat

#: Default largest ``h * w * c_in`` for which a convolution matrix is materialised.
DEFAULT_MAX_EXACT_SIZE = 4096
#: Default largest number of entries (``n_in * n_out``) of a materialised matrix
#: (2**26 float64 entries = 512 MiB).
DEFAULT_MAX_MATRIX_ENTRIES = 2**26
#: Default relative tolerance of :func:`audit_model` (see its docstring).
DEFAULT_TOLERANCE = 1e-5

METHOD_SVD = "svd"
METHOD_FFT_BOUND = "fft-bound"


class OperatorNorm(float):
    """A float (the norm) that remembers how it was obtained.

    Attributes:
        method: ``"svd"`` (exact, float64) or ``"fft-bound"`` (an upper bound on
            the exact norm, see :func:`conv_operator_norm`).
        exact: ``method == "svd"``.
    """

    method: str

    def __new__(cls, value, method: str):
        obj = super().__new__(cls, value)
        obj.method = method
        return obj

    @property
    def exact(self) -> bool:
        return self.method == METHOD_SVD

    def __repr__(self) -> str:
        return f"OperatorNorm({float(self)!r}, method={self.method!r})"

    def __reduce__(self):
        return (OperatorNorm, (float(self), self.method))


class SensitivityViolation(AssertionError):
    """A constrained layer whose operator norm exceeds its declared Lipschitz constant.

    ``records`` holds the offending :class:`AuditRecord` s.
    """

    def __init__(self, message: str, records):
        super().__init__(message)
        self.records = list(records)


@dataclass(frozen=True)
class AuditRecord:
    """Result of the audit of one constrained layer.

    Attributes:
        name: layer name.
        kind: ``"dense"`` or ``"conv2d"``.
        declared: Lipschitz constant the bound propagation relies on (the smallest
            ``C`` such that the layer's bounds need ``||A|| <= C``; 1 for every
            constrained layer of lipdp).
        measured: operator norm of the layer as used in the forward pass.
        method: ``"svd"`` (exact) or ``"fft-bound"`` (upper bound: a value above
            ``declared`` then means *not certified*, not necessarily violated).
        ok: ``measured <= declared * (1 + tolerance)``.
        input_shape: per-example input shape used for the audit (convolutions).
    """

    name: str
    kind: str
    declared: float
    measured: float
    method: str
    ok: bool
    input_shape: tuple | None = None

    @property
    def exact(self) -> bool:
        return self.method == METHOD_SVD


# --------------------------------------------------------------------------- norms
def _largest_singular_value(matrix: np.ndarray) -> float:
    """Largest singular value of a real or complex float64 matrix (or a batch)."""
    matrix = np.asarray(matrix)
    if matrix.size == 0:
        return 0.0
    m, n = matrix.shape[-2:]
    if matrix.ndim == 2 and min(m, n) > 512:
        # Gram matrix of the smaller side: sigma_max^2 is its largest eigenvalue
        # (float64 relative error ~1e-13, far below any tolerance used here) and
        # it costs much less than an SVD of a very rectangular matrix.
        gram = matrix.T @ matrix if n <= m else matrix @ matrix.T
        return float(math.sqrt(max(np.linalg.eigvalsh(gram)[-1], 0.0)))
    return float(np.max(np.linalg.svd(matrix, compute_uv=False)))


def dense_operator_norm(kernel) -> OperatorNorm:
    """Exact spectral norm of a dense kernel (any shape; its matrix view is
    ``reshape(kernel, (-1, kernel.shape[-1]))``), float64 SVD of the stored values."""
    kernel = np.asarray(kernel, dtype=np.float64)
    matrix = kernel.reshape(-1, kernel.shape[-1]) if kernel.ndim != 2 else kernel
    return OperatorNorm(_largest_singular_value(matrix), METHOD_SVD)


def _pair(value) -> tuple[int, int]:
    if isinstance(value, (int, np.integer)):
        return (int(value), int(value))
    value = tuple(int(v) for v in value)
    if len(value) != 2:
        raise ValueError(f"expected an int or a pair, got {value}.")
    return value


def _conv_geometry(size: int, k: int, s: int, padding: str) -> tuple[int, int]:
    """``(output size, padding before)`` along one axis, as ``tf.nn.conv2d`` does."""
    if padding == "same":
        out = -(-size // s)
        pad_total = max((out - 1) * s + k - size, 0)
        return out, pad_total // 2
    return -(-(size - k + 1) // s), 0


def _check_conv_args(kernel, input_shape, strides, padding):
    kernel = np.asarray(kernel, dtype=np.float64)
    if kernel.ndim != 4:
        raise ValueError(f"kernel must have shape (kh, kw, c_in, c_out), got {kernel.shape}.")
    input_shape = tuple(int(d) for d in input_shape)
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (h, w, c_in), got {input_shape}.")
    if input_shape[2] != kernel.shape[2]:
        raise ValueError(
            f"input channels {input_shape[2]} do not match the kernel's c_in={kernel.shape[2]}."
        )
    strides = _pair(strides)
    padding = padding.lower()
    if padding not in ("same", "valid"):
        raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}.")
    kh, kw = kernel.shape[:2]
    out_h, _ = _conv_geometry(input_shape[0], kh, strides[0], padding)
    out_w, _ = _conv_geometry(input_shape[1], kw, strides[1], padding)
    if out_h <= 0 or out_w <= 0:
        raise ValueError(
            f"a {kh}x{kw} 'valid' convolution has no output on inputs {input_shape[:2]}."
        )
    return kernel, input_shape, strides, padding, (out_h, out_w)


def conv_matrix(kernel, input_shape, strides=(1, 1), padding="same", batch_size=None):
    """Matrix of ``x -> conv2d(x, kernel, strides, padding)`` (float64, exact).

    Row ``i`` is the flattened output for the ``i``-th canonical basis input of
    shape ``input_shape``; the returned array has shape ``(n_in, n_out)``, i.e. it
    is the *transpose* of the operator (same singular values).

    Built in numpy, without running a convolution: output ``(p, q, o)`` reads input
    pixel ``(p sh + a - top, q sw + b - left)`` through tap ``(a, b)`` (``top``, ``left``:
    the zero padding before, as TensorFlow's and XLA's ``"same"`` put the smaller half
    there; a pixel outside the input is a zero of the padding), so entry
    ``((r, c, i), (p, q, o))`` is ``K[a, b, i, o]`` for the one tap that reads pixel
    ``(r, c)`` at ``(p, q)``, or 0. It is what a float64 ``tf.nn.conv2d`` of the basis
    gives (each output a sum of one product by 1 and zeros: exact), with no float64 or
    TensorFlow needed (JAX computes in float32 unless x64 is enabled). ``batch_size`` is
    accepted for compatibility and unused.
    """
    kernel, input_shape, strides, padding, (out_h, out_w) = _check_conv_args(
        kernel, input_shape, strides, padding
    )
    h, w, c_in = input_shape
    kh, kw, _, c_out = kernel.shape
    (sh, sw), (_, top), (_, left) = (
        strides,
        _conv_geometry(h, kh, strides[0], padding),
        _conv_geometry(w, kw, strides[1], padding),
    )
    result = np.zeros((h, w, c_in, out_h, out_w, c_out), dtype=np.float64)
    out_rows, out_cols = np.arange(out_h), np.arange(out_w)
    for a in range(kh):
        rows = out_rows * sh + a - top
        p = out_rows[(rows >= 0) & (rows < h)]
        for b in range(kw):
            cols = out_cols * sw + b - left
            q = out_cols[(cols >= 0) & (cols < w)]
            # (p, q) -> pixel (p sh + a - top, q sw + b - left): one tap per pair (a, b).
            result[
                (p * sh + a - top)[:, None], (q * sw + b - left)[None, :], :, p[:, None],
                q[None, :], :,
            ] = kernel[a, b]  # fmt: skip
    return result.reshape(h * w * c_in, out_h * out_w * c_out)


def conv_fft_bound(
    kernel, input_shape, strides=(1, 1), padding="same", chunk: int = 4096
) -> OperatorNorm:
    """Upper bound on the norm of a zero-padded, strided 2-D convolution (FFT).

    Polyphase form: write the kernel row index ``i = a * sh + r`` (``0 <= r < sh``),
    likewise for columns. The strided convolution of the zero-padded input ``x``
    is the stride-1 convolution, with kernel ``K'[a, b, (r, t, c), o] =
    K[a sh + r, b sw + t, c, o]`` (``ceil(kh/sh) x ceil(kw/sw)`` taps,
    ``sh * sw * c_in`` channels), of the polyphase signal ``z[p, q, (r, t, c)] =
    x_pad[p sh + r, q sw + t, c]``. ``x -> z`` is an isometric embedding (zeros and a
    permutation of coordinates). On a periodic grid of size ``G >= out + taps - 1``
    (and large enough to hold ``z``) no output position reads a wrapped-around
    coordinate, so the layer is a *compression* ``P C E`` of the circular
    convolution ``C`` on that grid, whose norm is the largest spectral norm over
    the grid frequencies of the ``(sh sw c_in) x c_out`` matrix ``DFT(K')(f)``.
    Hence ``||conv|| <= ||C||``. For stride 1 this is the classical bound by the
    circular convolution on a grid of size ``(h + kh - 1, w + kw - 1)``; the bound
    is tight only as the input grows (it ignores the borders). Cost
    ``O(G_h G_w (sh sw c_in) c_out min(...))``, no dependence on a materialised
    matrix.
    """
    kernel, input_shape, strides, padding, (out_h, out_w) = _check_conv_args(
        kernel, input_shape, strides, padding
    )
    kh, kw, c_in, c_out = kernel.shape
    sh, sw = strides
    ta, tb = -(-kh // sh), -(-kw // sw)  # taps of the polyphase kernel
    padded = np.zeros((ta * sh, tb * sw, c_in, c_out))
    padded[:kh, :kw] = kernel
    # (ta, sh, tb, sw, c_in, c_out) -> (ta, tb, sh, sw, c_in, c_out)
    poly = padded.reshape(ta, sh, tb, sw, c_in, c_out).transpose(0, 2, 1, 3, 4, 5)
    channels = sh * sw * c_in
    poly = poly.reshape(ta * tb, channels * c_out)
    grid = []
    for size, k, s, out, taps in (
        (input_shape[0], kh, sh, out_h, ta),
        (input_shape[1], kw, sw, out_w, tb),
    ):
        _, before = _conv_geometry(size, k, s, padding)
        grid.append(max(out + taps - 1, -(-(size + before) // s)))
    gh, gw = grid
    # Real kernel: DFT(-f) = conj(DFT(f)) has the same singular values, so half of
    # the frequencies of the second axis suffice.
    fh, fw = np.meshgrid(np.arange(gh), np.arange(gw // 2 + 1), indexing="ij")
    fh, fw = fh.ravel(), fw.ravel()
    a, b = np.meshgrid(np.arange(ta), np.arange(tb), indexing="ij")
    a, b = a.ravel(), b.ravel()
    best = 0.0
    for start in range(0, fh.size, chunk):
        sl = slice(start, start + chunk)
        phase = np.exp(-2j * np.pi * (np.outer(fh[sl], a) / gh + np.outer(fw[sl], b) / gw))
        spectrum = (phase @ poly).reshape(-1, channels, c_out)
        best = max(best, float(np.max(np.linalg.svd(spectrum, compute_uv=False))))
    return OperatorNorm(best, METHOD_FFT_BOUND)


def conv_operator_norm(
    kernel,
    input_shape,
    strides=(1, 1),
    padding="same",
    *,
    max_exact_size: int = DEFAULT_MAX_EXACT_SIZE,
    max_matrix_entries: int = DEFAULT_MAX_MATRIX_ENTRIES,
    fallback: str = "bound",
) -> OperatorNorm:
    """Operator norm of ``x -> conv2d(x, kernel, strides, padding)``.

    Args:
        kernel: ``(kh, kw, c_in, c_out)`` array (the *effective* kernel of a layer).
        input_shape: ``(h, w, c_in)`` of one example.
        strides, padding: as in ``tf.nn.conv2d`` (``"same"`` or ``"valid"``, zero
            padding).
        max_exact_size: the matrix of the map is materialised (exact float64 norm,
            method ``"svd"``) only if ``h * w * c_in <= max_exact_size`` and the
            matrix has at most ``max_matrix_entries`` entries.
        fallback: beyond those sizes, ``"bound"`` returns the Fourier upper bound
            of :func:`conv_fft_bound` (method ``"fft-bound"``; it is an *upper
            bound*, not the exact value) and ``"raise"`` raises ``ValueError``.

    Returns:
        An :class:`OperatorNorm` (a float with a ``method`` attribute).
    """
    if fallback not in ("bound", "raise"):
        raise ValueError(f"fallback must be 'bound' or 'raise', got {fallback!r}.")
    kernel, input_shape, strides, padding, (out_h, out_w) = _check_conv_args(
        kernel, input_shape, strides, padding
    )
    n_in = int(np.prod(input_shape))
    n_out = out_h * out_w * kernel.shape[3]
    if n_in <= max_exact_size and n_in * n_out <= max_matrix_entries:
        matrix = conv_matrix(kernel, input_shape, strides, padding)
        return OperatorNorm(_largest_singular_value(matrix), METHOD_SVD)
    if fallback == "raise":
        raise ValueError(
            f"input {input_shape} gives a {n_out}x{n_in} matrix, beyond max_exact_size="
            f"{max_exact_size} / max_matrix_entries={max_matrix_entries}; raise the limits "
            "or use fallback='bound' for the Fourier upper bound."
        )
    return conv_fft_bound(kernel, input_shape, strides, padding)


# --------------------------------------------------------------------------- models
def _is_conv(layer) -> bool:
    return len(layer.kernel.shape) == 4 and hasattr(layer, "effective_kernel")


def _declared_lipschitz(layer) -> float:
    """The constant ``C`` the layer's bounds rely on: for a linear map both the
    output bound ``||A x|| <= C ||x||`` and the cotangent bound ``||A^T g|| <= C ||g||``
    hold iff ``||A|| <= C``."""
    return float(min(layer.propagate_inputs(1.0), layer.backpropagate_inputs(1.0, 1.0)))


def _model_input_shape(model, input_shape):
    if input_shape is not None:
        return tuple(int(d) for d in input_shape)
    layers = model.layers_forward_order()
    candidates = [compat.declared_batch_shape(layer) for layer in layers[:2]]
    candidates.append(getattr(model, "_build_input_shape", None))
    for shape in candidates:
        if shape is not None:
            shape = tuple(shape)
            return tuple(int(d) for d in shape[1:])
    metadata = getattr(model, "dataset_metadata", None)
    if metadata is not None and getattr(metadata, "input_shape", None) is not None:
        return tuple(int(d) for d in metadata.input_shape)
    raise ValueError("Cannot infer the model's input shape: pass input_shape=(h, w, c).")


def _constrained_layers_with_inputs(model, input_shape):
    """``[(layer, per-example input shape)]`` for every constrained layer, found by a
    dummy forward pass (batch of one zero example) through the layers in order."""
    found = []
    x = np.zeros((1, *input_shape), dtype=np.float32)
    for layer in model.layers_forward_order():
        inner, inner_input = layer, x
        while isinstance(inner, DP_WrappedResidual):
            inner, inner_input = inner.block, inner_input[1]
        if isinstance(inner, ConstrainedKernelLayer):
            found.append((inner, tuple(int(d) for d in inner_input.shape[1:])))
        x = layer(x, training=False)
    return found


def audit_layer(layer, input_shape=None, tolerance=DEFAULT_TOLERANCE, **norm_kwargs) -> AuditRecord:
    """Audit one built constrained layer (``input_shape``: per-example, convs only)."""
    declared = _declared_lipschitz(layer)
    if _is_conv(layer):
        if input_shape is None:
            raise ValueError(f"auditing convolution {layer.name!r} needs its input_shape.")
        kernel = np.asarray(layer.effective_kernel())
        measured = conv_operator_norm(
            kernel, input_shape[-3:], layer.strides, layer.padding, **norm_kwargs
        )
        kind = "conv2d"
    else:
        measured = dense_operator_norm(np.asarray(layer.kernel))
        kind, input_shape = "dense", None
    ok = float(measured) <= declared * (1.0 + tolerance)
    return AuditRecord(
        name=layer.name,
        kind=kind,
        declared=declared,
        measured=float(measured),
        method=measured.method,
        ok=bool(ok),
        input_shape=None if input_shape is None else tuple(input_shape),
    )


def audit_model(
    model, input_shape=None, tolerance=DEFAULT_TOLERANCE, **norm_kwargs
) -> list[AuditRecord]:
    """Measure the operator norm of every constrained layer of a built lipdp model.

    Layers are visited in ``model.layers_forward_order()``; a
    :class:`~lipdp.clipless.layers.DP_WrappedResidual` is unwrapped to its ``block``. The
    input shape of every convolution is found by a dummy forward pass of one zero
    example (``input_shape``, per example, defaults to the shape declared by the
    model's first layer). Dense layers are audited on their kernel (their norm
    does not depend on the input shape); convolutions on ``layer.effective_kernel()``
    with the layer's strides and padding (``norm_kwargs`` go to
    :func:`conv_operator_norm`, e.g. ``max_exact_size``).

    Tolerance: ``ok`` is ``measured <= declared * (1 + tolerance)``. The measured
    value is the exact (float64) norm of the float32 weights, so the only slack
    needed is the float32 round-off of the projection that produced them:
    relative ~1e-7 per operation, a few 1e-7 after the Björck iterations.
    Orthogonal projections drive every singular value to 1, so those layers sit
    *at* 1 up to that round-off (hence a tolerance of 1e-5 rather than 0);
    layers rescaled onto the spectral ball sit near ``1 / (1 + margin)`` with
    ``margin = 1e-3``, well below 1. A measured value between 1 and
    ``1 + tolerance`` is round-off, a larger one is a projection that missed its
    feasible set (or weights set by hand and never projected).

    Returns:
        one :class:`AuditRecord` per constrained layer, in forward order.
    """
    if not model.built:
        raise ValueError("Build the model before auditing it.")
    shape = _model_input_shape(model, input_shape)
    return [
        audit_layer(layer, layer_shape, tolerance, **norm_kwargs)
        for layer, layer_shape in _constrained_layers_with_inputs(model, shape)
    ]


def format_records(records) -> str:
    lines = []
    for r in records:
        status = "ok" if r.ok else ("NOT CERTIFIED" if not r.exact else "VIOLATION")
        lines.append(
            f"{r.name} ({r.kind}{'' if r.input_shape is None else f', input {r.input_shape}'}):"
            f" measured {r.measured:.9g} [{r.method}] vs declared {r.declared:.9g} -> {status}"
        )
    return "\n".join(lines)


def assert_sound(
    model, input_shape=None, tolerance=DEFAULT_TOLERANCE, **norm_kwargs
) -> list[AuditRecord]:
    """Run :func:`audit_model` and raise :class:`SensitivityViolation` if a layer is
    not certified (exact norm above the declared constant, or an upper bound that
    does not certify it). Returns the records otherwise."""
    records = audit_model(model, input_shape, tolerance, **norm_kwargs)
    bad = [r for r in records if not r.ok]
    if bad:
        raise SensitivityViolation(
            f"{len(bad)} constrained layer(s) exceed their declared Lipschitz constant "
            f"(tolerance {tolerance:g}):\n{format_records(bad)}",
            bad,
        )
    return records
