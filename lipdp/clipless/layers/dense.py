"""Dense layers with a kernel of bounded spectral norm.

For one example ``x`` (any rank; the kernel acts on the last axis, token by token)
the layer computes ``y_t = W^T x_t``. With ``||W||_2 <= c`` (``c = 1`` by default; the
radius ``C`` or the current norm, :mod:`lipdp.clipless.layers.constrained`):

* output bound: ``||y||^2 = sum_t ||W^T x_t||^2 <= c^2 sum_t ||x_t||^2``, so ``X -> c X``;
* cotangent bound: ``dL/dx_t = W g_t``, so ``||dL/dx|| <= c G``;
* parameter bound: ``dL/dW = sum_t x_t g_t^T``, whose Frobenius norm is at most
  ``sum_t ||x_t|| ||g_t|| <= ||x|| ||g||`` (Cauchy-Schwarz), so ``X * G``.

The gradient is taken with respect to ``W`` itself (no in-graph normalisation,
rule S3) and ``W`` is projected after every optimizer step.
"""

from __future__ import annotations

import keras

from lipdp.clipless import projections
from lipdp.clipless.layers.base import refuse_bias, register
from lipdp.clipless.layers.constrained import ConstrainedKernelLayer
from lipdp.foundation import compat, validation


class _ConstrainedDense(keras.layers.Layer, ConstrainedKernelLayer):
    _default_constraint = "orthogonal"
    _default_bjorck_iterations = projections.DEFAULT_BJORCK_ITERATIONS

    def __init__(
        self,
        units,
        use_bias=False,
        nm_coef=1.0,
        kernel_initializer="orthogonal",
        constraint=None,
        power_iterations=projections.DEFAULT_POWER_ITERATIONS,
        bjorck_iterations=None,
        margin=projections.DEFAULT_MARGIN,
        weight_norm_bound=1.0,
        adaptive_norm=False,
        **kwargs,
    ):
        refuse_bias(type(self).__name__, use_bias)
        super().__init__(**kwargs)
        self.units = validation.count("units", units, 1)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self._init_constraint(
            constraint or self._default_constraint,
            nm_coef,
            power_iterations,
            bjorck_iterations or self._default_bjorck_iterations,
            margin,
            weight_norm_bound,
            adaptive_norm,
        )

    def build(self, input_shape):
        self._add_constrained_kernel((int(input_shape[-1]), self.units), self.kernel_initializer)
        super().build(input_shape)

    def call(self, inputs):
        return compat.array_ops().tensordot(inputs, self.kernel, axes=[[-1], [0]])

    def compute_output_shape(self, input_shape):
        return (*tuple(input_shape)[:-1], self.units)

    def backpropagate_params(self, input_bound, gradient_bound):
        return input_bound * gradient_bound

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            **self._constraint_config(),
        )
        return config


@register
class DP_SpectralDense(_ConstrainedDense):
    """Dense layer with orthogonal kernel (gradient-norm preserving).

    After each step the kernel is orthogonalised (spectral normalisation then
    Björck iterations, :func:`lipdp.clipless.projections.orthogonal_projection`). Bounds:
    ``X -> X``, ``G -> G``, parameters ``X * G`` (module docstring).
    """


@register
class DP_QuickSpectralDense(_ConstrainedDense):
    """Dense layer with kernel of spectral norm at most one, cheap projection.

    Orthogonal by default like :class:`DP_SpectralDense` but with fewer Björck
    iterations per step: the kernel was orthogonal before the step and moved
    little, so a warm-started re-orthogonalisation converges in a few steps; every
    Björck step keeps the spectral norm at most one whatever the count, so the
    bounds do not depend on convergence. ``constraint="spectral"`` only rescales
    kernels that leave the unit spectral ball.
    """

    _default_bjorck_iterations = 3


@register
class DP_QuickFrobeniusDense(_ConstrainedDense):
    """Dense layer with kernel in the unit Frobenius ball (exact projection).

    ``||W||_2 <= ||W||_F <= 1``, hence the same bounds as the spectral layers.
    """

    _default_constraint = "frobenius"
