"""The 2-D wavelet scattering transform as a DP layer with no trainable weights."""

from __future__ import annotations

import functools

import keras
import numpy as np

from lipdp.clipless import wavelets
from lipdp.clipless.layers.base import DPLayer, register
from lipdp.foundation import compat, validation

#: Relative slack on the certified constant for float32 round-off in the FFTs (their
#: relative error is ~1e-6; the certificate itself is computed in float64).
FFT_ROUNDOFF = 1e-4

# Complex values are (real, imaginary) pairs of real arrays, as ``keras.ops.fft2`` takes
# and gives them: the same code runs on TensorFlow and JAX (and under ``jax.jit``). The
# filters are real (real parts of DFTs, :func:`lipdp.clipless.wavelets.morlet_filter_bank`),
# so a product with a filter is the product of each part.


def _each(function, z):
    """``function`` applied to both parts of the pair ``z``."""
    return function(z[0]), function(z[1])


def _fft2(z):
    return compat.array_ops().fft2(z)


def _ifft2(z):
    """Inverse 2-D DFT of the pair ``z`` over its last two axes (``keras.ops.ifft2``; the
    K2 shim and Keras 3 on TensorFlow compute it as ``conj(fft2(conj(z))) / (n m)``)."""
    return compat.array_ops().ifft2(z)


def _modulus(z):
    """``|z|``, with the zero sub-gradient where ``z = 0`` (``sqrt`` alone gives NaN there;
    zero-padded and blank image regions make exact zeros common)."""
    ops = compat.array_ops()
    squared = ops.square(z[0]) + ops.square(z[1])
    positive = squared > 0
    safe = ops.where(positive, squared, ops.ones_like(squared))
    return ops.where(positive, ops.sqrt(safe), ops.zeros_like(squared))


def _as_complex(x):
    """``x + 0i``."""
    ops = compat.array_ops()
    x = ops.cast(x, "float32")
    return x, ops.zeros_like(x)


def _decimate(z, k):
    """Spatial decimation by ``k`` of ``z`` (rows, n, m) given in the Fourier domain:
    the mean of the ``k^2`` aliases of each frequency."""
    if k == 1:
        return z
    ops = compat.array_ops()
    n, m = z[0].shape[-2], z[0].shape[-1]
    return _each(
        lambda part: ops.mean(ops.reshape(part, (-1, k, n // k, k, m // k)), axis=(1, 3)), z
    )


def _filter_rows(z, filters):
    """Every row of ``z`` (rows, n, m) times every real filter (F, n, m): (rows * F, n, m),
    row ``r * F + f``."""
    ops = compat.array_ops()
    n, m = z[0].shape[-2], z[0].shape[-1]
    return _each(lambda part: ops.reshape(part[:, None] * filters[None], (-1, n, m)), z)


@functools.lru_cache(maxsize=16)
def _certified_bank(image_shape, J, L, max_order, padding):
    """Filter bank and certified constant of one configuration (the certificate takes
    about a second for 28 x 28 images; layers of the same configuration share it)."""
    padded = tuple(wavelets.padded_length(n, J) for n in image_shape)
    bank = wavelets.morlet_filter_bank(padded, J, L)
    return bank, wavelets.scattering_lipschitz(bank, image_shape, max_order, padding)


@register
class DP_ScatteringTransform(keras.layers.Layer, DPLayer):
    r"""Wavelet scattering transform (Kymatio's, ``J`` scales, ``L`` angles) of each
    channel of an image: a fixed, weightless feature extractor (Tramer & Boneh, ICLR
    2021, reach 89.7 % on Fashion-MNIST at epsilon = 3 with a linear model on it).

    Input ``(h, w, c)`` images, output ``(h', w', c K)`` with ``h' = floor(h / 2^J)``
    (Kymatio's padded length / 2^J - 2) and ``K = 1 + J L + L^2 J (J - 1) / 2``
    coefficients per channel (81 for ``J = 2``, ``L = 8``), channel ``c K + k`` holding
    Kymatio's coefficient ``k`` of input channel ``c``.

    Bounds (derivation and certificate in :mod:`lipdp.clipless.wavelets`): the transform is
    ``Lip``-Lipschitz with ``Lip`` certified at build time from the filter bank (the
    float64 largest eigenvalue of the explicit Gram matrix of each decimated filter bank on
    real inputs, the padding inside the first one, composed through the moduli), times
    ``1 + FFT_ROUNDOFF``; the Jacobian autodiff
    uses (moduli replaced by their derivatives, the zero sub-gradient at 0) is bounded by
    the same product. Channels are transformed separately, so the constant of the layer is
    that of one channel. With ``S(0) = 0``:

    * output bound ``X -> Lip * X``; cotangent bound ``G -> Lip * G``.

    For ``J = 2``, ``L = 8`` on 28 x 28 images ``Lip = 0.4925`` with reflection padding and
    ``0.2550`` with zero padding (reflection copies a corner pixel 4 times). On
    Fashion-MNIST (zero padding) ``||S x|| / ||x||`` is 0.18-0.24 (median 0.23), but
    ``||x||`` itself varies from image to image: a normalisation after the layer
    (:class:`~lipdp.clipless.layers.DP_GroupNormalization`, per example, no statistics of the data)
    is what makes the next layer's input bound tight for every example.

    Args:
        J: number of scales (the output is decimated by ``2^J``).
        L: number of angles.
        max_order: 1 or 2.
        padding: ``"reflect"`` (Kymatio's) or ``"zeros"`` (a constant half as large).
    """

    def __init__(self, J=2, L=8, max_order=2, padding="reflect", **kwargs):
        super().__init__(**kwargs)
        self.J = validation.count("J", J, 1)
        self.L = validation.count("L", L, 1)
        self.max_order = validation.choice("max_order", max_order, (1, 2))
        self.padding = validation.choice("padding", padding, wavelets.PADDINGS)
        self.lipschitz = None
        self._bank = None

    # ---------------------------------------------------------------------- build
    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(
                f"{self.name} takes images (batch, height, width, channels); got shape "
                f"{tuple(input_shape)}. Reshape the input with DP_Reshape first."
            )
        height, width = int(input_shape[1]), int(input_shape[2])
        self._pads = [wavelets.padding_amounts(n, self.J) for n in (height, width)]
        for axis, length, pads in zip(("height", "width"), (height, width), self._pads):
            if wavelets.output_length(length, self.J) < 1:
                raise ValueError(
                    f"{self.name}: {axis} {length} is smaller than 2^J = {2**self.J}: the "
                    "output would be empty; use a smaller J."
                )
            if self.padding == "reflect" and max(pads) >= length:
                raise ValueError(
                    f"{self.name}: {axis} {length} is too small to pad by reflection for "
                    f"J={self.J} ({max(pads)} pixels); use padding='zeros' or a smaller J."
                )
        self._bank, certified = _certified_bank(
            (height, width), self.J, self.L, self.max_order, self.padding
        )
        self.lipschitz = certified * (1.0 + FFT_ROUNDOFF)
        self._make_filter_constants()
        super().build(input_shape)

    def _make_filter_constants(self):
        def constant(values):
            return np.asarray(values, dtype=np.float32)

        bank = self._bank
        # numpy constants (real: the filters are real parts of DFTs), which every backend
        # embeds in its graph or jit trace as constants.
        self._phi = [constant(level) for level in bank.phi]
        # _psi[j][res]: the L wavelets of scale j at resolution res, stacked.
        self._psi = [
            [constant([w.levels[res] for w in bank.psi if w.j == j]) for res in range(j + 1)]
            for j in range(self.J)
        ]

    # ----------------------------------------------------------------------- call
    def call(self, inputs):
        ops = compat.array_ops()
        height, width, channels = inputs.shape[1], inputs.shape[2], inputs.shape[3]
        images = ops.reshape(ops.transpose(inputs, (0, 3, 1, 2)), (-1, height, width))
        mode = "reflect" if self.padding == "reflect" else "constant"
        images = ops.pad(images, [[0, 0], list(self._pads[0]), list(self._pads[1])], mode=mode)
        spectrum = _fft2(_as_complex(images))
        coefficients = self._scatter(spectrum)  # (batch * channels, K, h', w')
        per_channel = wavelets.coefficients_per_channel(self.J, self.L, self.max_order)
        per_example = ops.reshape(
            coefficients, (-1, channels * per_channel, *coefficients.shape[-2:])
        )
        return ops.cast(ops.transpose(per_example, (0, 2, 3, 1)), inputs.dtype)

    def _low_pass(self, spectrum, res):
        """Order-``res`` output: low-pass, decimate to scale ``2^J``, real part, crop."""
        phi = self._phi[res][None]
        averaged = _decimate(_each(lambda part: part * phi, spectrum), 2 ** (self.J - res))
        return _ifft2(averaged)[0][:, 1:-1, 1:-1]

    def _band_pass(self, spectrum, j, res):
        """``FFT |(u * psi_{j, .}) down 2^(j - res)|`` for a signal at resolution ``res``:
        (rows * L, n, m), row ``r * L + theta``."""
        filtered = _decimate(_filter_rows(spectrum, self._psi[j][res]), 2 ** (j - res))
        return _fft2(_as_complex(_modulus(_ifft2(filtered))))

    def _scatter(self, spectrum):
        ops = compat.array_ops()
        J, L = self.J, self.L
        out = tuple(self._out_shape)
        order0 = [self._low_pass(spectrum, 0)[:, None]]
        order1, order2 = [], []
        for j1 in range(J):
            first = self._band_pass(spectrum, j1, 0)  # (rows * L, ...)
            order1.append(ops.reshape(self._low_pass(first, j1), (-1, L, *out)))
            if self.max_order < 2:
                continue
            by_scale = []
            for j2 in range(j1 + 1, J):
                second = self._band_pass(first, j2, j1)  # (rows * L * L, ...)
                by_scale.append(
                    ops.reshape(self._low_pass(second, j2), (-1, L, 1, L, out[0] * out[1]))
                )
            if by_scale:  # Kymatio's order: (theta1, j2, theta2) for each j1
                block = ops.concatenate(by_scale, axis=2)
                order2.append(ops.reshape(block, (-1, L * len(by_scale) * L, *out)))
        return ops.concatenate(order0 + order1 + order2, axis=1)

    @property
    def _out_shape(self):
        return [n // 2**self.J - 2 for n in self._bank.shape]

    def compute_output_shape(self, input_shape):
        height, width = (wavelets.output_length(int(n), self.J) for n in input_shape[1:3])
        channels = int(input_shape[3]) * wavelets.coefficients_per_channel(
            self.J, self.L, self.max_order
        )
        return (input_shape[0], height, width, channels)

    # --------------------------------------------------------------------- bounds
    def _certified(self):
        if self.lipschitz is None:
            raise ValueError(f"{self.name}: build the model before computing bounds.")
        return self.lipschitz

    def propagate_inputs(self, input_bound):
        if input_bound is None:
            return None
        return self._certified() * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._certified() * gradient_bound

    def get_config(self):
        config = super().get_config()
        config.update(J=self.J, L=self.L, max_order=self.max_order, padding=self.padding)
        return config
