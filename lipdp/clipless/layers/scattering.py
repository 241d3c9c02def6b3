"""The 2-D wavelet scattering transform as a DP layer with no trainable weights."""

from __future__ import annotations

import functools

import keras
import numpy as np
import tensorflow as tf

from lipdp.clipless import wavelets
from lipdp.clipless.layers.base import DPLayer, register
from lipdp.foundation import validation

#: Relative slack on the certified constant for float32 round-off in the FFTs (their
#: relative error is ~1e-6; the certificate itself is computed in float64).
FFT_ROUNDOFF = 1e-4


def _modulus(z):
    """``|z|``, with the zero sub-gradient where ``z = 0`` (``tf.abs`` gives NaN there;
    zero-padded and blank image regions make exact zeros common)."""
    squared = tf.square(tf.math.real(z)) + tf.square(tf.math.imag(z))
    positive = squared > 0
    safe = tf.where(positive, squared, tf.ones_like(squared))
    return tf.where(positive, tf.sqrt(safe), tf.zeros_like(squared))


def _as_complex(x):
    """``x + 0i`` (``tf.cast`` to complex warns in its gradient, which drops the
    imaginary part; ``tf.complex`` has the same gradient without the warning)."""
    x = tf.cast(x, tf.float32)
    return tf.complex(x, tf.zeros_like(x))


def _decimate(z, k):
    """Spatial decimation by ``k`` of ``z`` (rows, n, m) given in the Fourier domain:
    the mean of the ``k^2`` aliases of each frequency."""
    if k == 1:
        return z
    n, m = z.shape[-2], z.shape[-1]
    aliases = tf.reshape(z, [-1, k, n // k, k, m // k])
    return tf.reduce_mean(aliases, axis=[1, 3])


def _filter_rows(z, filters):
    """Every row of ``z`` (rows, n, m) times every filter (F, n, m): (rows * F, n, m),
    row ``r * F + f``."""
    n, m = z.shape[-2], z.shape[-1]
    return tf.reshape(z[:, None] * filters[None], [-1, n, m])


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
            return tf.constant(np.asarray(values, dtype=np.complex64))

        bank = self._bank
        # Eager constants, reused by every call: Keras 3 builds a model's layers inside a
        # graph traced for shapes only, whose tensors a later call could not use.
        with tf.init_scope():
            self._phi = [constant(level) for level in bank.phi]
            # _psi[j][res]: the L wavelets of scale j at resolution res, stacked.
            self._psi = [
                [constant([w.levels[res] for w in bank.psi if w.j == j]) for res in range(j + 1)]
                for j in range(self.J)
            ]

    # ----------------------------------------------------------------------- call
    def call(self, inputs):
        batch = tf.shape(inputs)[0]
        height, width, channels = inputs.shape[1], inputs.shape[2], inputs.shape[3]
        images = tf.reshape(tf.transpose(inputs, [0, 3, 1, 2]), [-1, height, width])
        mode = "REFLECT" if self.padding == "reflect" else "CONSTANT"
        images = tf.pad(images, [[0, 0], list(self._pads[0]), list(self._pads[1])], mode=mode)
        spectrum = tf.signal.fft2d(_as_complex(images))
        coefficients = self._scatter(spectrum)  # (batch * channels, K, h', w')
        per_channel = wavelets.coefficients_per_channel(self.J, self.L, self.max_order)
        per_example = tf.reshape(
            coefficients, [batch, channels * per_channel, *coefficients.shape[-2:]]
        )
        return tf.cast(tf.transpose(per_example, [0, 2, 3, 1]), inputs.dtype)

    def _low_pass(self, spectrum, res):
        """Order-``res`` output: low-pass, decimate to scale ``2^J``, real part, crop."""
        averaged = _decimate(spectrum * self._phi[res][None], 2 ** (self.J - res))
        return tf.math.real(tf.signal.ifft2d(averaged))[:, 1:-1, 1:-1]

    def _band_pass(self, spectrum, j, res):
        """``FFT |(u * psi_{j, .}) down 2^(j - res)|`` for a signal at resolution ``res``:
        (rows * L, n, m), row ``r * L + theta``."""
        filtered = _decimate(_filter_rows(spectrum, self._psi[j][res]), 2 ** (j - res))
        return tf.signal.fft2d(_as_complex(_modulus(tf.signal.ifft2d(filtered))))

    def _scatter(self, spectrum):
        rows = tf.shape(spectrum)[0]
        J, L = self.J, self.L
        order0 = [self._low_pass(spectrum, 0)[:, None]]
        order1, order2 = [], []
        for j1 in range(J):
            first = self._band_pass(spectrum, j1, 0)  # (rows * L, ...)
            order1.append(tf.reshape(self._low_pass(first, j1), [rows, L, *self._out_shape]))
            if self.max_order < 2:
                continue
            by_scale = []
            for j2 in range(j1 + 1, J):
                second = self._band_pass(first, j2, j1)  # (rows * L * L, ...)
                by_scale.append(tf.reshape(self._low_pass(second, j2), [rows, L, 1, L, -1]))
            if by_scale:  # Kymatio's order: (theta1, j2, theta2) for each j1
                block = tf.concat(by_scale, axis=2)
                order2.append(tf.reshape(block, [rows, -1, *self._out_shape]))
        return tf.concat(order0 + order1 + order2, axis=1)

    @property
    def _out_shape(self):
        return [n // 2**self.J - 2 for n in self._bank.shape]

    def compute_output_shape(self, input_shape):
        height, width = (wavelets.output_length(int(n), self.J) for n in input_shape[1:3])
        channels = int(input_shape[3]) * wavelets.coefficients_per_channel(
            self.J, self.L, self.max_order
        )
        return tf.TensorShape([input_shape[0], height, width, channels])

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
