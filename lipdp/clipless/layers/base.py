"""The :class:`DPLayer` interface: backpropagation *of bounds*.

Notation used in every layer docstring, for ONE example:

* ``X`` — bound on the Euclidean norm of the layer input (``input_bound``);
* ``G`` — bound on the Euclidean norm of the cotangent, i.e. of the gradient of
  that example's loss with respect to the layer *output* (``gradient_bound``).

Bounds are expressed for the per-example loss; the model divides by the batch
size when it calibrates the noise of the averaged gradient. Inside a residual
block ``X`` and ``G`` are pairs (one entry per path).

A layer answers four questions:

* ``propagate_inputs(X)``: a bound on the norm of its output;
* ``backpropagate_inputs(X, G)``: a bound on the norm of the cotangent of its
  input, normally ``lip * G`` with ``lip`` its Lipschitz constant in the input;
* ``backpropagate_params(X, G)``: a bound on the Frobenius norm of the gradient
  with respect to each trainable variable (a float when the layer has one
  variable, a list aligned with ``trainable_variables`` otherwise);
* ``has_parameters()``: whether the layer owns trainable variables;
* ``propagate_lipschitz(X, lip)``: given a bound ``lip`` on the Lipschitz constant of
  the network up to the layer input, a bound up to its output. By default
  ``lip * backpropagate_inputs(X, 1)``: the cotangent bound for a unit cotangent is a
  bound on the operator norm of the Jacobian at every input of norm ``<= X``, hence a
  Lipschitz constant on that ball (the model clips its inputs into it first). Layers
  whose backward bound is not their Jacobian (``DP_ClipGradient``) and residual layers
  (pairs) override it.

Layers that clip cotangents need the loss normaliser (rows the summed loss of a batch is
divided by, :attr:`lipdp.foundation.metadata.DatasetMetadata.loss_normalizer`); they set
``uses_loss_normalizer = True`` and the model passes it to them as a call argument, so
a layer holds no state that depends on the model it is used in.

``project()`` is called after every optimizer step; constrained layers map their
weights back onto the feasible set there (rule S3: training by projection).
"""

from __future__ import annotations

import keras

from lipdp.foundation import validation


class DPLayer:
    """Mixin implemented by every layer allowed inside a DP model."""

    #: Per-layer noise-multiplier coefficient (``"per-layer"`` strategy only).
    nm_coef: float = 1.0

    #: Whether ``call`` takes ``loss_normalizer=`` (module docstring).
    uses_loss_normalizer: bool = False

    def propagate_inputs(self, input_bound):
        raise NotImplementedError

    def backpropagate_inputs(self, input_bound, gradient_bound):
        raise NotImplementedError

    def backpropagate_params(self, input_bound, gradient_bound):
        raise ValueError(f"Layer {getattr(self, 'name', self)} has no parameters.")

    def has_parameters(self) -> bool:
        return False

    def propagate_lipschitz(self, input_bound, lipschitz):
        """Bound on the Lipschitz constant up to the output (module docstring)."""
        return lipschitz * self.backpropagate_inputs(input_bound, 1.0)

    def begin_bound_pass(self) -> None:
        """Called by :func:`lipdp.clipless.bounds.bound_pass` before its walk (no-op by default);
        the weights do not change until :meth:`end_bound_pass`."""
        return None

    def end_bound_pass(self) -> None:
        """Called by :func:`lipdp.clipless.bounds.bound_pass` after its walk (no-op by default)."""
        return None

    def project(self) -> None:
        """Map the weights back onto their constraint set (no-op by default)."""
        return None  # a docstring-only body breaks AutoGraph (jit_compile=True steps)


class NonExpansiveLayer(DPLayer):
    """A parameter-free layer that is 1-Lipschitz and maps 0 to 0.

    Then ``||f(x)|| = ||f(x) - f(0)|| <= ||x||`` (output bound ``X``) and the
    Jacobian has operator norm at most 1 (cotangent bound ``G``).
    """

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound


def validate_nm_coef(nm_coef) -> float:
    """``nm_coef > 0``: it multiplies the noise of the layer's variables."""
    return validation.positive("nm_coef (it multiplies the noise)", nm_coef)


def refuse_bias(layer_name: str, use_bias: bool) -> None:
    """Constrained layers carry no bias: its norm would have to be bounded too."""
    if use_bias:
        raise ValueError(
            f"{layer_name} does not support use_bias=True: a bias must live in a bounded "
            "ball for the output bound to hold. Add `DP_AddBias(norm_max=...)` after the "
            "layer instead."
        )


def register(cls):
    """Register a layer for Keras (de)serialisation under the ``lipdp`` package."""
    return keras.utils.register_keras_serializable(package="lipdp")(cls)
