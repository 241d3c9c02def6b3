"""2-D convolutions that are 1-Lipschitz, trained by projection.

Let ``K`` be the kernel (``kh x kw x c_in x c_out``), ``M`` its matrix view
(``kh*kw*c_in x c_out``) and ``s = (sh, sw)`` the strides. Output position ``p``
computes ``y_p = M^T P_p(x)`` where ``P_p(x)`` is the (zero-padded) patch under the
kernel. A given input pixel lies in at most

    n = ceil(kh / sh) * ceil(kw / sw)

patches, whatever the padding ("same" or "valid"): for the row index, the
positions ``p`` with ``p * sh <= r + pad < p * sh + kh`` number at most
``ceil(kh / sh)``. Hence ``sum_p ||P_p(x)||^2 <= n ||x||^2`` (zero padding adds
only zeros). The layer uses the effective kernel ``K_eff = K / sqrt(n)`` and keeps
``||M||_2 <= 1`` by projection (RKO: reshaped kernel orthogonalisation), so

* output bound: ``||y||^2 = sum_p ||M_eff^T P_p(x)||^2 <= ||M_eff||_2^2 sum_p
  ||P_p(x)||^2 <= n ||M_eff||_2^2 ||x||^2 = ||M||_2^2 ||x||^2`` — the convolution (linear)
  has operator norm at most ``||M||_2 <= c`` (``c = 1`` by default; the radius ``C`` or the
  current certified norm, :mod:`lipdp.clipless.layers.constrained`): ``X -> c X``;
* cotangent bound: the adjoint has the same norm, ``G -> c G``;
* parameter bound: ``dL/dM_eff = sum_p P_p(x) g_p^T`` has Frobenius norm at most
  ``sum_p ||P_p(x)|| ||g_p|| <= sqrt(n) ||x|| ||g||``; the chain rule through the
  constant factor ``1/sqrt(n)`` gives ``||dL/dM|| <= X * G`` for the stored kernel.

For stride 1, ``n = kh * kw``: the factor ``sqrt(n)`` is the ``sqrt(h' w')`` of Lip-DP-SGD
(Barczewski & Ramon, Appendix B.1: ``||conv_theta|| <= sqrt(h' w') ||theta||_F``), written
here into the effective kernel so that the stored kernel's norm bounds the operator norm
directly; with a Frobenius ball ``||M||_F <= C`` the operator norm is at most ``C``.

The factor ``1/sqrt(n)`` is a worst case, valid for every input size. deel-lip's
stride-1 factor (``_compute_conv_lip_factor``) averages the border effect over
the image instead; it is larger than ``1/sqrt(kh*kw)`` and lets a smooth kernel
reach an operator norm above one on inputs concentrated in the interior, so it is
not used here (see ``tests/clipless/test_projections.py``). Dilation would change
``n`` and is refused; so are paddings other than zero padding (reflection
duplicates pixels).
"""

from __future__ import annotations

import math

import keras

from lipdp.clipless import projections
from lipdp.clipless.layers.base import refuse_bias, register
from lipdp.clipless.layers.constrained import ConstrainedKernelLayer
from lipdp.foundation import compat, validation


def patch_overlap(kernel_size, strides) -> int:
    """Largest number of output positions whose patch contains one input pixel."""
    return math.ceil(kernel_size[0] / strides[0]) * math.ceil(kernel_size[1] / strides[1])


class _ConstrainedConv2D(keras.layers.Layer, ConstrainedKernelLayer):
    _default_bjorck_iterations = projections.DEFAULT_BJORCK_ITERATIONS

    def __init__(
        self,
        filters,
        kernel_size,
        strides=(1, 1),
        padding="same",
        use_bias=False,
        nm_coef=1.0,
        kernel_initializer="orthogonal",
        constraint="orthogonal",
        power_iterations=projections.DEFAULT_POWER_ITERATIONS,
        bjorck_iterations=None,
        margin=projections.DEFAULT_MARGIN,
        dilation_rate=(1, 1),
        data_format=None,
        weight_norm_bound=1.0,
        adaptive_norm=False,
        **kwargs,
    ):
        name = type(self).__name__
        refuse_bias(name, use_bias)
        if validation.int_pair("dilation_rate", dilation_rate) != (1, 1):
            raise ValueError(f"{name} does not support dilation (got {dilation_rate}).")
        if data_format not in (None, "channels_last"):
            raise ValueError(f"{name} supports data_format='channels_last' only.")
        padding = padding.lower()
        if padding not in ("same", "valid"):
            raise ValueError(
                f"{name} supports padding 'same' or 'valid' (zero padding), got {padding!r}."
            )
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = validation.int_pair("kernel_size", kernel_size)
        self.strides = validation.int_pair("strides", strides)
        self.padding = padding
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self._init_constraint(
            constraint,
            nm_coef,
            power_iterations,
            bjorck_iterations or self._default_bjorck_iterations,
            margin,
            weight_norm_bound,
            adaptive_norm,
        )
        #: The constant factor between the stored and the effective kernel.
        self.correction = 1.0 / math.sqrt(patch_overlap(self.kernel_size, self.strides))

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(f"{self.name} expects inputs (batch, h, w, c), got {input_shape}.")
        self._add_constrained_kernel(
            (*self.kernel_size, int(input_shape[-1]), self.filters), self.kernel_initializer
        )
        super().build(input_shape)

    def effective_kernel(self):
        return self.kernel * self.correction

    def call(self, inputs):
        # ``ops.conv``: tf.nn.conv2d on TensorFlow (same zero padding, "same" puts the
        # smaller half before, as lax.conv_general_dilated does on JAX).
        return compat.array_ops().conv(
            inputs, self.effective_kernel(), strides=self.strides, padding=self.padding
        )

    def compute_output_shape(self, input_shape):
        h, w = input_shape[1], input_shape[2]
        if self.padding == "same":
            out = [_ceil_div(h, self.strides[0]), _ceil_div(w, self.strides[1])]
        else:
            out = [
                _ceil_div(h - self.kernel_size[0] + 1, self.strides[0]),
                _ceil_div(w - self.kernel_size[1] + 1, self.strides[1]),
            ]
        return (input_shape[0], *out, self.filters)

    def backpropagate_params(self, input_bound, gradient_bound):
        # correction * sqrt(n) == 1 (module docstring).
        return (
            self.correction
            * math.sqrt(patch_overlap(self.kernel_size, self.strides))
            * (input_bound * gradient_bound)
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters,
            kernel_size=self.kernel_size,
            strides=self.strides,
            padding=self.padding,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            **self._constraint_config(),
        )
        return config


def _ceil_div(a, b):
    return None if a is None else -(-a // b)


@register
class DP_SpectralConv2D(_ConstrainedConv2D):
    """Convolution with orthogonal reshaped kernel, 1-Lipschitz (module docstring).

    Bounds: ``X -> X``, ``G -> G``, parameters ``X * G``.
    """


@register
class DP_QuickSpectralConv2D(_ConstrainedConv2D):
    """Like :class:`DP_SpectralConv2D` with a cheaper warm-started projection.

    Three Björck steps per training step by default (each keeps ``||M||_2 <= 1``);
    ``constraint="spectral"`` only rescales kernels leaving the unit ball. Same
    bounds.
    """

    _default_bjorck_iterations = 3
