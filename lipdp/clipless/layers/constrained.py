r"""Shared machinery of the layers whose kernel lives in a constraint set.

**Radius.** A kernel lives in a set of radius ``C`` (``weight_norm_bound``, 1 by
default): the spectral ball ``||M||_2 <= C``, ``C`` times the orthogonal matrices, or the
Frobenius ball ``||M||_F <= C`` (``M``: the matrix view of the stored kernel). Every
constrained layer is then ``c``-Lipschitz with ``c`` a bound on ``||M||_2`` (for a
convolution, :mod:`lipdp.clipless.layers.convolution` shows the operator norm is at most
``||M||_2``), so for one example:

* output bound ``X -> c X``; cotangent bound ``G -> c G``;
* parameter bound ``X G`` (it does not depend on the weights).

**Two ways to choose** ``c`` (:meth:`ConstrainedKernelLayer.operator_norm_bound`):

* ``adaptive_norm=False`` (fixed-norm training, the original lipdp, "Fix-Lip-DP-SGD"):
  ``c = C``, a constant;
* ``adaptive_norm=True`` (Lip-DP-SGD, Barczewski & Ramon): ``c = min(C, ||M||)`` with
  ``||M||`` a certified upper bound on the spectral norm of the *current* kernel
  (:func:`lipdp.clipless.projections.certified_operator_norm`: exact ``sigma_max`` for the
  spectral and orthogonal sets, ``||M||_F`` for the Frobenius ball), evaluated in-graph
  at every step. A layer whose weights shrink then passes smaller bounds to the layers
  around it, and every gradient gets less noise.

**Why the adaptive bound costs no privacy.** The kernel a step reads is the output of the
previous noisy steps and of the projection -- both already released -- so any function
of it, its norm included, is post-processing (DP is closed under post-processing). No
quantity computed from the current batch enters the bound: the input bound of a layer is
the public ``X_0`` of :class:`~lipdp.clipless.layers.DP_BoundedInput` pushed through the current
``c_i`` of the layers before it. (Lip-DP-SGD as published divides by the largest input
norm *in the batch*; one example can move that statistic, see ``docs/lip_dp_sgd.md``.)

**Why** ``min(C, .)`` **is sound.** Weights are projected into the ball of radius ``C``
after every step and on every path that sets them (``fit``, ``train_on_batch``,
``set_weights``, ``load_weights``; rule S12), the same assumption fixed-norm training
makes when it uses ``C``; the ``min`` only makes the two modes agree exactly when the
norm is at the radius.
"""

from __future__ import annotations

import keras

from lipdp.clipless import projections
from lipdp.clipless.layers.base import DPLayer, validate_nm_coef
from lipdp.foundation import compat, validation

#: The constraint sets a kernel (seen as a matrix) can be projected onto.
CONSTRAINTS = ("orthogonal", "spectral", "frobenius")


class ConstrainedKernelLayer(DPLayer):
    """Mixin for layers with one kernel whose matrix view is kept in a constraint set.

    Subclasses create ``self.kernel`` in ``build`` with :meth:`_add_constrained_kernel`;
    the matrix view is ``reshape(kernel, (-1, units))``.

    Args (consumed by :meth:`_init_constraint`):
        constraint: ``"orthogonal"`` (Björck; ``C`` times a gradient-norm preserving
            map), ``"spectral"`` (spectral ball, ``||W||_2 <= C``) or ``"frobenius"``
            (``||W||_F <= C``, which implies ``||W||_2 <= C``).
        weight_norm_bound: the radius ``C > 0``.
        adaptive_norm: bounds from the current weight norm (module docstring).
        power_iterations, bjorck_iterations, margin: see :mod:`lipdp.clipless.projections`.
    """

    def _init_constraint(
        self,
        constraint,
        nm_coef,
        power_iterations=projections.DEFAULT_POWER_ITERATIONS,
        bjorck_iterations=projections.DEFAULT_BJORCK_ITERATIONS,
        margin=projections.DEFAULT_MARGIN,
        weight_norm_bound=1.0,
        adaptive_norm=False,
    ):
        self.constraint = validation.choice("constraint", constraint, CONSTRAINTS)
        self.weight_norm_bound = validation.positive("weight_norm_bound", weight_norm_bound)
        if not isinstance(adaptive_norm, bool):
            raise ValueError(f"adaptive_norm must be True or False, got {adaptive_norm!r}.")
        self.adaptive_norm = adaptive_norm
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
            "weight_norm_bound": self.weight_norm_bound,
            "adaptive_norm": self.adaptive_norm,
        }

    def _add_constrained_kernel(self, shape, initializer) -> None:
        """Create ``self.kernel`` (shape ``shape``, matrix view ``(-1, shape[-1])``) inside
        the constraint set, and the warm start of the power iteration.

        The kernel's initial value is the projection of ``initializer``'s draw, computed
        *by the variable's initializer*, not assigned after the variable is created: Keras 3
        builds the layers of a model during a symbolic call, inside a ``StatelessScope``
        where a new variable gets its value only when the scope exits and an ``assign`` is
        recorded in the scope and then dropped. An assigned projection would silently leave
        the raw draw in the kernel -- outside the set, so the bounds (which assume the set,
        or read ``min(C, ||M||)``) would be too small, and a frozen kernel is never
        projected again. An initializer runs whenever and wherever the value is created.
        """
        units = shape[-1]
        # Warm-start vector of the power iteration; it is state, not a parameter.
        warm_start = keras.initializers.RandomNormal(seed=0)

        def projected_initializer(shape, dtype=None):
            ops = compat.array_ops()
            matrix = ops.reshape(initializer(shape, dtype=dtype), (-1, units))
            projected, _ = self._project(matrix, warm_start((1, units), dtype=dtype))
            return ops.reshape(projected, shape)

        self.kernel = self.add_weight(
            name="kernel", shape=shape, initializer=projected_initializer, trainable=True
        )
        self.power_vector = self.add_weight(
            name="power_vector", shape=(1, units), initializer=warm_start, trainable=False
        )

    def kernel_matrix(self):
        return compat.array_ops().reshape(self.kernel, (-1, self.kernel.shape[-1]))

    def _project(self, matrix, warm_start):
        """``(projection of matrix onto the constraint set, next warm start)``."""
        radius = self.weight_norm_bound
        if self.constraint == "frobenius":
            return projections.frobenius_ball_projection(matrix, radius=radius), warm_start
        if self.constraint == "spectral":
            projected = projections.spectral_ball_projection(
                matrix, margin=self.margin, radius=radius
            )
            return projected, warm_start
        return projections.orthogonal_projection(
            matrix,
            warm_start,
            power_iterations=self.power_iterations,
            bjorck_iterations=self.bjorck_iterations,
            margin=self.margin,
            radius=radius,
        )

    def projected_values(self, kernel, power_vector):
        """``(kernel, power_vector)`` after the projection, as a pure function of the values
        (any array of the kernel's shape, e.g. a jit step's state): the kernel's matrix view
        projected by :meth:`_project` and reshaped back, and the next warm start (unchanged
        unless the constraint is orthogonal). :meth:`project` assigns exactly this."""
        ops = compat.array_ops()
        matrix = ops.reshape(kernel, (-1, kernel.shape[-1]))
        projected, u = self._project(matrix, power_vector)
        if self.constraint != "orthogonal":
            u = power_vector
        return ops.reshape(projected, kernel.shape), u

    def projected_matrix(self):
        """The projection of the current kernel matrix (also updates the warm start)."""
        matrix, u = self._project(self.kernel_matrix(), self.power_vector)
        if self.constraint == "orthogonal":
            self.power_vector.assign(u)
        return matrix

    def _assign_projection(self) -> None:
        ops = compat.array_ops()
        self.kernel.assign(ops.reshape(self.projected_matrix(), self.kernel.shape))

    def project(self) -> None:
        # A frozen kernel was projected when built and never moves.
        if self.trainable:
            self._assign_projection()

    def has_parameters(self) -> bool:
        return bool(self.trainable)

    def operator_norm_bound(self):
        """``c``, the bound on the layer's Lipschitz constant the bounds use (module
        docstring): the float ``C``, or (``adaptive_norm``) the tensor
        ``min(C, certified ||M||)`` of the current kernel -- computed once per bound pass
        (the pass asks for it three times; the kernel does not change during a pass)."""
        if not self.adaptive_norm:
            return self.weight_norm_bound
        memo = getattr(self, "_pass_memo", None)
        if memo:
            return memo[0]
        norm = "frobenius" if self.constraint == "frobenius" else "spectral"
        current = projections.certified_operator_norm(self.kernel_matrix(), norm)
        ops = compat.array_ops()
        value = ops.minimum(ops.cast(self.weight_norm_bound, current.dtype), current)
        if memo is not None:
            memo.append(value)
        return value

    # The memo is a plain list set with object.__setattr__: Keras does not track it, and it
    # exists only between the two hooks, so no tensor outlives the pass (or its graph).
    def begin_bound_pass(self) -> None:
        object.__setattr__(self, "_pass_memo", [])

    def end_bound_pass(self) -> None:
        object.__setattr__(self, "_pass_memo", None)

    def propagate_inputs(self, input_bound):
        if input_bound is None:  # before DP_BoundedInput: nothing is bounded yet
            return None
        return self.operator_norm_bound() * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self.operator_norm_bound() * gradient_bound
