r"""Morlet filter banks of the 2-D scattering transform, and its certified Lipschitz constant.

The scattering transform (Mallat 2012; Bruna & Mallat 2013) of an image ``x`` is the tree

* order 0: ``S_0 x = (x * phi) down 2^J``;
* order 1: ``U_1 = |(x * psi_{j1,t1}) down 2^j1|``, ``S_1 x = (U_1 * phi) down 2^(J-j1)``;
* order 2: ``U_2 = |(U_1 * psi_{j2,t2}) down 2^(j2-j1)|`` for ``j2 > j1``,
  ``S_2 x = (U_2 * phi) down 2^(J-j2)``;

with Morlet wavelets ``psi_{j,t}`` (scale ``2^j``, ``L`` angles ``t``) and a Gaussian
low-pass ``phi`` of scale ``2^J``. The filters are those of Kymatio 0.3 (Andreux et al.,
2020), which Tramer & Boneh (ICLR 2021) use for private learning (``J = 2``, ``L = 8`` on
28 x 28 images): the image is padded to ``padded_length`` (a multiple of ``2^J``), every
convolution is circular and computed in the Fourier domain, decimation ``down k`` keeps
one pixel in ``k`` per axis (in the Fourier domain: the mean of the ``k^2`` aliases), a
filter used on a decimated signal is the full-resolution filter restricted to the low
frequencies (Kymatio's ``periodize_filter_fft``), and the outputs are cropped by one
pixel on each side. Kymatio itself is not a dependency: version 0.3.0 fails to import
next to SciPy >= 1.15 (its 3-D module imports the removed ``scipy.special.sph_harm``);
``tests/clipless/test_scattering.py`` compares these filters and the transform with it.

**Certified Lipschitz constant** (:func:`scattering_lipschitz`). Every node of the tree is
a *decimated filter bank* ``T x = (sqrt(w_i) (E x * h_i) down s_i)_i`` (``E`` the padding
at the root, the identity inside) followed by moduli. The complex modulus is 1-Lipschitz
(``||a| - |b|| <= |a - b|``; its derivative, or the zero sub-gradient used at 0, is a
contraction), taking the real part and cropping are coordinate projections, and the
branches of a node are disjoint, so the tree is bounded from the leaves up:

    ``c_2(j2) = ||phi down 2^(J-j2)||`` on the grid of scale ``j2``;
    ``c_1(j1) = ||(phi down 2^(J-j1), c_2(j2) psi_{j2} down 2^(j2-j1))_{j2 > j1}||``;
    ``Lip(S) <= ||(phi down 2^J, c_1(j1) psi_{j1} down 2^j1)_{j1} o E||``

(the weights ``w_i`` of a node are the squared constants of its children). Every input
of a node is real (an image, or a modulus), so each norm is taken over real inputs:
:func:`real_bank_norm` forms the node's Gram matrix ``K = T^T T`` explicitly (one column
per input pixel, through the DFT and Parseval's identity on each decimated output grid;
with the unnormalised DFT, decimation by ``s`` averages the ``s^2`` aliases of each
frequency) and takes ``sqrt(lambda_max(K))`` from ``numpy.linalg.eigvalsh`` in float64
(backward stable: exact for ``K + F`` with ``||F|| ~ d eps ||K||``), plus
``1e-9 ||K||_F``. The padding is inside ``K``, so reflection's copies are counted
exactly where the filters see them. On grids of more than :data:`DENSE_LIMIT` pixels,
:func:`decimated_bank_norm` replaces it: the exact norm over *complex* inputs from the
``s^2 x s^2`` alias blocks of each coset (larger or equal), times the padding's norm.
Both are checked against SVDs of explicit operator matrices in
``tests/clipless/test_scattering.py``;
the certificate uses the float32 filters the layer multiplies by. Since ``S(0) = 0``,
``||S x|| <= Lip(S) ||x||`` as well. For ``J = 2``, ``L = 8`` on 28 x 28 images:
``Lip = 0.2550`` (zero padding; gradient ascent on pairs reaches 0.2497) and ``0.4925``
(reflection; reached 0.369).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from lipdp.foundation import validation

#: Kymatio's Morlet design constants: width ``0.8 * 2^j``, centre frequency
#: ``(3 pi / 4) / 2^j``, slant ``4 / L``.
SIGMA0 = 0.8
XI0 = 0.75 * math.pi
#: Added to each computed ``lambda_max``, relative to ``||M||_F`` (eigensolver error).
EIGEN_MARGIN = 1e-9
PADDINGS = ("reflect", "zeros")


def padded_length(n: int, J: int) -> int:
    """Length after padding (Kymatio's rule): a multiple of ``2^J`` with at least
    ``2^(J-1)`` pixels on each side."""
    step = 2**J
    return ((n + step) // step + 1) * step


def padding_amounts(n: int, J: int) -> tuple[int, int]:
    """Pixels added before and after an axis of length ``n``."""
    extra = padded_length(n, J) - n
    return extra // 2, (extra + 1) // 2


def output_length(n: int, J: int) -> int:
    """Length of the output along an axis: ``padded_length / 2^J - 2`` (cropped)."""
    return padded_length(n, J) // 2**J - 2


def _gabor(shape, sigma, theta, xi, slant=1.0) -> np.ndarray:
    """Periodised 2-D Gabor filter in space: an anisotropic Gaussian envelope (axes
    ``sigma`` and ``sigma / slant``, rotated by ``theta``) times ``exp(i xi <u, e_theta>)``,
    summed over the 5 x 5 nearest periods, normalised by ``2 pi sigma^2 / slant``."""
    rows, cols = shape
    cos, sin = math.cos(theta), math.sin(theta)
    rotation = np.array([[cos, -sin], [sin, cos]])
    curvature = rotation @ np.diag([1.0, slant * slant]) @ rotation.T / (2.0 * sigma * sigma)
    total = np.zeros(shape, dtype=np.complex128)
    for shift_r in range(-2, 3):
        u = (np.arange(rows) + shift_r * rows)[:, None].astype(np.float64)
        for shift_c in range(-2, 3):
            v = (np.arange(cols) + shift_c * cols)[None, :].astype(np.float64)
            quadratic = curvature[0, 0] * u * u + 2 * curvature[0, 1] * u * v
            quadratic = quadratic + curvature[1, 1] * v * v
            total += np.exp(-quadratic + 1j * xi * (u * cos + v * sin))
    return total * slant / (2.0 * math.pi * sigma * sigma)


def _morlet(shape, sigma, theta, xi, slant) -> np.ndarray:
    """Morlet wavelet: the Gabor filter minus the multiple of its envelope that makes its
    mean exactly zero."""
    wave = _gabor(shape, sigma, theta, xi, slant)
    envelope = _gabor(shape, sigma, theta, 0.0, slant)
    return wave - (wave.sum() / envelope.sum()) * envelope


def low_frequencies(filter_f: np.ndarray, res: int) -> np.ndarray:
    """The filter for a signal decimated by ``2^res``: its Fourier coefficients at the
    ``n / 2^res`` lowest frequencies of each axis (the others are dropped)."""
    if res == 0:
        return filter_f
    half_r = filter_f.shape[0] >> (res + 1)
    half_c = filter_f.shape[1] >> (res + 1)
    rows = np.concatenate([filter_f[:half_r], filter_f[-half_r:]], axis=0)
    return np.concatenate([rows[:, :half_c], rows[:, -half_c:]], axis=1)


@dataclasses.dataclass(frozen=True)
class Wavelet:
    """One band-pass filter: scale ``j``, angle index ``theta``, and its Fourier
    coefficients at resolutions ``0..j`` (``levels[res]`` on the grid decimated by
    ``2^res``)."""

    j: int
    theta: int
    levels: tuple


@dataclasses.dataclass(frozen=True)
class FilterBank:
    """The filters of a scattering transform on a padded ``shape``, in the Fourier
    domain, as float32 values (those the layer multiplies by) stored in float64."""

    J: int
    L: int
    shape: tuple
    phi: tuple  # the low-pass at resolutions 0..J-1
    psi: tuple  # Wavelet, ordered by scale then angle


def _as_float32(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(np.float64)


def morlet_filter_bank(shape, J: int, L: int = 8) -> FilterBank:
    """Kymatio's filters for a padded ``shape`` (each axis a multiple of ``2^J``):
    ``J * L`` Morlet wavelets (angle ``(L/2 - 1 - t) pi / L``) and the Gaussian
    low-pass of width ``0.8 * 2^(J-1)``, real parts of their DFTs."""
    J = validation.count("J", J, 1)
    L = validation.count("L", L, 1)
    shape = tuple(int(n) for n in shape)
    if any(n % 2**J for n in shape):
        raise ValueError(f"the padded shape {shape} must be a multiple of 2^J = {2**J}.")
    psi = []
    for j in range(J):
        for theta in range(L):
            angle = (int(L - L / 2 - 1) - theta) * math.pi / L
            spatial = _morlet(shape, SIGMA0 * 2**j, angle, XI0 / 2**j, 4.0 / L)
            full = _as_float32(np.real(np.fft.fft2(spatial)))
            levels = tuple(low_frequencies(full, res) for res in range(j + 1))
            psi.append(Wavelet(j, theta, levels))
    low_pass = _as_float32(np.real(np.fft.fft2(_gabor(shape, SIGMA0 * 2 ** (J - 1), 0.0, 0.0))))
    phi = tuple(low_frequencies(low_pass, res) for res in range(J))
    return FilterBank(J, L, shape, phi, tuple(psi))


def decimated_bank_norm(filters, factors, weights) -> float:
    """Certified upper bound on the operator norm of
    ``u -> (sqrt(w_i) (u * h_i) down s_i)_i`` over complex ``u`` on one ``n``-pixel grid.

    Decimation by ``s`` averages aliases (``hat{(v down s)}(w) = s^-2 sum_a hat v(w + a n /
    s)``), so with ``s`` the largest factor ``||T u||^2 = n^-1 sum_cosets z^* M z``, ``z``
    holding ``hat u`` on one coset ``{w + a n / s}`` (``s^2`` frequencies) and
    ``M = sum_i w_i / s_i^2 sum_c conj(g_c) g_c^T`` with ``g_c = hat h_i`` on the sub-coset
    ``c`` (frequencies equal modulo ``n / s_i``), 0 elsewhere. As ``||u||^2 = n^-1 sum_w
    |hat u(w)|^2``, ``||T||`` is exactly the ``max`` over cosets of ``sqrt(lambda_max(M))``
    (the Littlewood-Paley sum ``sum_i w_i |hat h_i|^2`` when every ``s_i = 1``); computed
    by ``eigvalsh`` in float64 plus ``1e-9 ||M||_F``.

    Args:
        filters: Fourier coefficients ``hat h_i``, all of the grid's shape.
        factors: decimation factors ``s_i``, powers of 2 dividing the grid.
        weights: ``w_i >= 0``.
    """
    rows, cols = filters[0].shape
    s = max(factors)
    if rows % s or cols % s:
        raise ValueError(f"decimation {s} does not divide the grid {rows} x {cols}.")
    member_r, member_c = np.divmod(np.arange(s * s), s)
    blocks = np.zeros((rows // s, cols // s, s * s, s * s), dtype=np.complex128)
    for h, k, w in zip(filters, factors, weights):
        # values[p, q, a * s + b] = h[p + a rows / s, q + b cols / s]
        values = np.asarray(h, dtype=np.complex128).reshape(s, rows // s, s, cols // s)
        values = values.transpose(1, 3, 0, 2).reshape(rows // s, cols // s, s * s)
        period = s // k  # members in the same sub-coset differ by multiples of it
        same = ((member_r[:, None] - member_r[None, :]) % period == 0) & (
            (member_c[:, None] - member_c[None, :]) % period == 0
        )
        blocks += (w / k**2) * np.conj(values)[..., :, None] * values[..., None, :] * same
    largest = np.linalg.eigvalsh(blocks)[..., -1]
    margin = EIGEN_MARGIN * np.linalg.norm(blocks, axis=(-2, -1))
    return float(math.sqrt(max(float(np.max(largest + margin)), 0.0)))


def _basis_spectra(image_shape, pads, mode) -> np.ndarray:
    """DFTs of the embedded (padded) images of the canonical basis: ``(d, n_r, n_c)``."""
    size = int(np.prod(image_shape))
    basis = np.eye(size).reshape(size, *image_shape)
    numpy_mode = "reflect" if mode == "reflect" else "constant"
    return np.fft.fft2(np.pad(basis, ((0, 0), *pads), mode=numpy_mode))


def real_bank_norm(spectra, filters, factors, weights) -> float:
    """Certified upper bound on the norm of ``x -> (sqrt(w_i) (E x * h_i) down s_i)_i``
    over *real* ``x``, with ``E`` the embedding whose basis images have DFTs ``spectra``:
    ``sqrt(lambda_max(K))`` for the explicit Gram matrix (Parseval on each output grid)

        ``K = sum_i w_i s_i^2 / n^2 Re(conj(Y_i) Y_i^T)``,  ``Y_i = (hat h_i hat(E e_k)) down s_i``.

    Exact for real inputs (tighter than :func:`decimated_bank_norm`, which allows complex
    ones and bounds ``E`` separately); ``d x n^2`` memory for ``d`` input pixels."""
    count, rows, cols = spectra.shape
    gram = np.zeros((count, count))
    undecimated = np.zeros((rows, cols))  # s_i = 1: the Littlewood-Paley weights
    for h, k, w in zip(filters, factors, weights):
        if k == 1:
            undecimated += w * np.abs(h) ** 2
            continue
        outputs = (spectra * h).reshape(count, k, rows // k, k, cols // k).mean(axis=(1, 3))
        outputs = outputs.reshape(count, -1)
        gram += w * k * k / (rows * cols) * np.real(np.conj(outputs) @ outputs.T)
    if undecimated.any():
        flat = spectra.reshape(count, -1)
        gram += np.real((np.conj(flat) * undecimated.reshape(1, -1)) @ flat.T) / (rows * cols)
    largest = np.linalg.eigvalsh(gram)[-1] + EIGEN_MARGIN * np.linalg.norm(gram)
    return float(math.sqrt(max(largest, 0.0)))


#: Grids larger than this many pixels use the complex coset bound (the explicit Gram
#: matrix would need ``pixels^2`` memory).
DENSE_LIMIT = 4096


def _node_norm(image_shape, pads, mode, filters, factors, weights) -> float:
    """Norm bound of one node of the tree on real inputs of ``image_shape``."""
    grid = filters[0].shape
    if grid[0] * grid[1] <= DENSE_LIMIT:
        spectra = _basis_spectra(image_shape, pads, mode)
        return real_bank_norm(spectra, filters, factors, weights)
    return padding_norm(image_shape, pads, mode) * decimated_bank_norm(filters, factors, weights)


def padding_norm(image_shape, pads, mode) -> float:
    """Operator norm of the padding: each output pixel copies one input pixel, so it is
    ``sqrt`` of the largest number of copies of a pixel (1 for zero padding)."""
    if mode == "zeros":
        return 1.0
    copies = 1
    for length, (before, after) in zip(image_shape, pads):
        copies *= np.bincount(np.pad(np.arange(length), (before, after), mode="reflect")).max()
    return float(math.sqrt(copies))


def scattering_lipschitz(bank: FilterBank, image_shape, max_order=2, padding="reflect") -> float:
    """Certified Lipschitz constant (Euclidean norms) of the scattering transform of a
    real ``image_shape`` image padded by ``padding`` to ``bank.shape`` (module docstring):
    every node's norm on real inputs from :func:`real_bank_norm` (or
    :func:`decimated_bank_norm` on large grids), composed from the leaves up."""
    J = bank.J
    pads = [padding_amounts(int(n), J) for n in image_shape]

    def inner(res, filters, factors, weights):
        grid = tuple(n >> res for n in bank.shape)
        return _node_norm(grid, [(0, 0), (0, 0)], "zeros", filters, factors, weights)

    second = {j2: inner(j2, [bank.phi[j2]], [2 ** (J - j2)], [1.0]) for j2 in range(1, J)}
    first = {}
    for j1 in range(J):
        filters, factors, weights = [bank.phi[j1]], [2 ** (J - j1)], [1.0]
        if max_order >= 2:
            for wavelet in bank.psi:
                if wavelet.j > j1:
                    filters.append(wavelet.levels[j1])
                    factors.append(2 ** (wavelet.j - j1))
                    weights.append(second[wavelet.j] ** 2)
        first[j1] = inner(j1, filters, factors, weights)
    filters = [bank.phi[0]] + [wavelet.levels[0] for wavelet in bank.psi]
    factors = [2**J] + [2**wavelet.j for wavelet in bank.psi]
    weights = [1.0] + [first[wavelet.j] ** 2 for wavelet in bank.psi]
    return _node_norm(tuple(image_shape), pads, padding, filters, factors, weights)


def coefficients_per_channel(J: int, L: int, max_order: int = 2) -> int:
    """Number of scattering coefficients per input channel: ``1 + J L`` (+ ``L^2 J (J-1) / 2``
    at order 2)."""
    count = 1 + J * L
    if max_order >= 2:
        count += L * L * J * (J - 1) // 2
    return count
