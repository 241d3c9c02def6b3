"""Shared machinery of the layers whose kernel lives in a constraint set."""

from __future__ import annotations

import tensorflow as tf

from lipdp import projections, validation
from lipdp.layers.base import DPLayer, validate_nm_coef

#: The constraint sets a kernel (seen as a matrix) can be projected onto.
CONSTRAINTS = ("orthogonal", "spectral", "frobenius")


class ConstrainedKernelLayer(DPLayer):
    """Mixin for layers with one kernel whose matrix view is kept in a constraint set.

    Subclasses create ``self.kernel`` in ``build`` and then call
    :meth:`_build_constraint`; the matrix view is ``reshape(kernel, (-1, units))``.

    Args (consumed by :meth:`_init_constraint`):
        constraint: ``"orthogonal"`` (Björck; gradient-norm preserving),
            ``"spectral"`` (spectral ball, ``||W||_2 <= 1``) or ``"frobenius"``
            (``||W||_F <= 1``, which implies ``||W||_2 <= 1``).
        power_iterations, bjorck_iterations, margin: see :mod:`lipdp.projections`.
    """

    def _init_constraint(
        self,
        constraint,
        nm_coef,
        power_iterations=projections.DEFAULT_POWER_ITERATIONS,
        bjorck_iterations=projections.DEFAULT_BJORCK_ITERATIONS,
        margin=projections.DEFAULT_MARGIN,
    ):
        self.constraint = validation.choice("constraint", constraint, CONSTRAINTS)
        self.nm_coef = validate_nm_coef(nm_coef)
        self.power_iterations = validation.count("power_iterations", power_iterations, 1)
        self.bjorck_iterations = validation.count("bjorck_iterations", bjorck_iterations, 1)
        self.margin = validation.real("margin", margin, low=0.0, high=1.0, low_open=False)

    def _constraint_config(self) -> dict:
        return {
            "constraint": self.constraint,
            "nm_coef": self.nm_coef,
            "power_iterations": self.power_iterations,
            "bjorck_iterations": self.bjorck_iterations,
            "margin": self.margin,
        }

    def _build_constraint(self):
        units = self.kernel.shape[-1]
        # Warm-start vector of the power iteration; it is state, not a parameter.
        self.power_vector = self.add_weight(
            name="power_vector",
            shape=(1, units),
            initializer=tf.keras.initializers.RandomNormal(seed=0),
            trainable=False,
        )
        # build() may run inside a graph being traced (Model.build); the initial
        # projection must really execute, so it is lifted to the eager context.
        with tf.init_scope():
            self._assign_projection()

    def kernel_matrix(self) -> tf.Tensor:
        return tf.reshape(self.kernel, (-1, self.kernel.shape[-1]))

    def projected_matrix(self) -> tf.Tensor:
        """The projection of the current kernel matrix (also updates the warm start)."""
        matrix = self.kernel_matrix()
        if self.constraint == "frobenius":
            return projections.frobenius_ball_projection(matrix)
        if self.constraint == "spectral":
            return projections.spectral_ball_projection(matrix, margin=self.margin)
        matrix, u = projections.orthogonal_projection(
            matrix,
            self.power_vector,
            power_iterations=self.power_iterations,
            bjorck_iterations=self.bjorck_iterations,
            margin=self.margin,
        )
        self.power_vector.assign(u)
        return matrix

    def _assign_projection(self) -> None:
        self.kernel.assign(tf.reshape(self.projected_matrix(), self.kernel.shape))

    def project(self) -> None:
        # A frozen kernel was projected when built and never moves.
        if self.trainable:
            self._assign_projection()

    def has_parameters(self) -> bool:
        return bool(self.trainable)
