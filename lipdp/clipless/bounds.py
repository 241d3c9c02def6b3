r"""The one bound pass: every norm bound of a DP network, from one walk over its layers.

For one example, with the notation of :mod:`lipdp.clipless.layers.base`:

* **forward**: ``X_0`` is set by :class:`~lipdp.clipless.layers.DP_BoundedInput`; every layer maps
  the bound on its input norm to a bound on its output norm (``propagate_inputs``), and
  the bound ``lip`` on the Lipschitz constant of the network up to its input to one up to
  its output (``propagate_lipschitz``);
* **backward**: from ``G = L`` (the Lipschitz constant of the loss w.r.t. the logits,
  ``loss.get_L()``) every layer gives the bound on the gradient of each of its trainable
  variables (``backpropagate_params(X, G)``) and on the cotangent at its input
  (``backpropagate_inputs(X, G)``).

Inside residual blocks bounds are pairs (one per path); the residual layers define how
pairs split and merge. The result, :class:`Bounds`, is what every consumer reads: the
model's sensitivities and noise (:mod:`lipdp.core.noise`), the dynamic clipping's bounds on
cotangent norms, certified radii (the Lipschitz constant), the diagnostics, the audit and
the privacy report. Nothing else in lipdp walks the layers to compute a bound.

The loop is plain Python over the layers: inside a ``tf.function`` it runs once, at
tracing time, and leaves a handful of scalar ops (clip values are variables, so bounds
that depend on them are tensors that follow their updates).

**Sensitivity of the averaged gradient.** The training loss is the mean of per-example
losses over ``b`` examples (the expected batch size under Poisson sampling), so changing
one example moves the averaged gradient of variable ``v`` by at most ``B_v / b`` in norm
(add/remove: the removed example's term, which is at most ``B_v / b``), with ``B_v`` the
per-example bound. :meth:`Bounds.sensitivities` returns ``B_v (1 + ROUNDOFF_SLACK) / b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lipdp.core.noise import ROUNDOFF_SLACK

if TYPE_CHECKING:  # annotations only: the bound pass is plain Python on every backend
    import tensorflow as tf


@dataclass(frozen=True)
class VariableBound:
    """The per-example gradient bound of one trainable variable.

    Attributes:
        variable: the variable (a Keras or ``tf.Variable``).
        layer: the DP layer that owns it (the wrapper, for a layer inside a residual block).
        key: ``"<layer name>/<variable name>"`` (:func:`variable_key`; Keras does not keep
            variable names unique across save/load; layer names are).
        bound: ``B_v``, bound on the gradient norm of one example's loss.
        nm_coef: the layer's noise-multiplier coefficient (``"per-layer"`` strategy).
    """

    variable: tf.Variable
    layer: object
    key: str
    bound: object
    nm_coef: float


@dataclass(frozen=True)
class Bounds:
    """Result of :func:`bound_pass` (lists are aligned with ``layers``, forward order).

    Attributes:
        layers: the DP layers.
        input_bounds: bound on the input norm of each layer (``None`` before the bounded
            input layer).
        output_bound: bound on the norm of the network output.
        lipschitz: bound on the ``l2 -> l2`` Lipschitz constant of the network (as a
            function: :class:`~lipdp.clipless.layers.DP_ClipGradient` counts 1).
        output_cotangent_bounds: bound on the cotangent at the output of each layer (what
            its backward pass receives); ``None`` if no loss constant was given.
        input_cotangent_bounds: bound on the cotangent at the input of each layer.
        variables: a :class:`VariableBound` per trainable variable (forward order).
    """

    layers: list
    input_bounds: list
    output_bound: object
    lipschitz: object
    output_cotangent_bounds: list | None
    input_cotangent_bounds: list | None
    variables: list

    def sensitivities(self, batch_size) -> list[tuple[VariableBound, object]]:
        """``[(VariableBound, Delta_v)]``: ``Delta_v = B_v (1 + ROUNDOFF_SLACK) / b``, the
        sensitivity of the averaged gradient (module docstring)."""
        if self.output_cotangent_bounds is None:
            raise ValueError("bound_pass was run without the loss constant: no gradient bounds.")
        scale = (1.0 + ROUNDOFF_SLACK) / float(batch_size)
        return [(entry, entry.bound * scale) for entry in self.variables]


def parameterized_variables(layers) -> list[tuple[object, tf.Variable]]:
    """``[(layer, variable)]`` of every trainable variable owned by a DP layer, forward
    order: what the bounds and the noise multipliers are indexed by."""
    return [
        (layer, variable)
        for layer in layers
        if layer.has_parameters()
        for variable in layer.trainable_variables
    ]


def variable_key(layer, variable) -> str:
    """``"<layer name>/<variable name>"``, e.g. ``"d1/kernel"`` on either Keras: Keras 2
    names a variable ``"d1/kernel:0"`` (the ``:0`` is TensorFlow's output index, not part
    of the name), Keras 3 ``"kernel"``."""
    return f"{layer.name}/{variable.name.rsplit('/', 1)[-1].split(':')[0]}"


def bound_pass(layers, loss_lipschitz=None) -> Bounds:
    """Walk ``layers`` once forward and, given ``loss_lipschitz``, once backward.

    Args:
        layers: the DP layers of a model in forward order (the first parameter-free
            layers until :class:`~lipdp.clipless.layers.DP_BoundedInput` receive ``None``).
        loss_lipschitz: ``L = loss.get_L()``; ``None`` computes the forward bounds and the
            Lipschitz constant only.
    """
    layers = list(layers)
    _call_hooks(layers, "begin_bound_pass")
    try:
        return _walk(layers, loss_lipschitz)
    finally:
        _call_hooks(layers, "end_bound_pass")


def _call_hooks(layers, hook) -> None:
    """Tell every layer (and the block a residual wrapper holds) that a pass begins or
    ends: a layer may then compute a costly quantity once per pass instead of once per
    question (the current norm of a norm-adaptive kernel, asked three times)."""
    for layer in layers:
        for member in (layer, getattr(layer, "block", None)):
            method = getattr(member, hook, None)
            if method is not None:
                method()


def _walk(layers, loss_lipschitz) -> Bounds:
    input_bounds = []
    bound, lipschitz = None, 1.0
    for layer in layers:
        input_bounds.append(bound)
        lipschitz = layer.propagate_lipschitz(bound, lipschitz)
        bound = layer.propagate_inputs(bound)
    if isinstance(lipschitz, (tuple, list)):
        raise ValueError("The model ends inside a residual block (no DP_MergeResidual).")
    if loss_lipschitz is None:
        return Bounds(layers, input_bounds, bound, lipschitz, None, None, [])
    outputs, inputs, variables = _backward(layers, input_bounds, loss_lipschitz)
    return Bounds(layers, input_bounds, bound, lipschitz, outputs, inputs, variables)


def _backward(layers, input_bounds, loss_lipschitz):
    gradient = loss_lipschitz
    outputs, inputs, variables = [None] * len(layers), [None] * len(layers), []
    for index in reversed(range(len(layers))):
        layer, x_bound = layers[index], input_bounds[index]
        outputs[index] = gradient
        if layer.has_parameters():
            variables = _variable_bounds(layer, x_bound, gradient) + variables
        gradient = layer.backpropagate_inputs(x_bound, gradient)
        inputs[index] = gradient
    return outputs, inputs, variables


def _variable_bounds(layer, x_bound, gradient) -> list[VariableBound]:
    bounds = layer.backpropagate_params(x_bound, gradient)
    bounds = list(bounds) if isinstance(bounds, (list, tuple)) else [bounds]
    owned = layer.trainable_variables
    if len(bounds) != len(owned):
        raise RuntimeError(
            f"Layer {layer.name!r} returned {len(bounds)} bounds for {len(owned)} trainable "
            "variables."
        )
    return [
        VariableBound(v, layer, variable_key(layer, v), b, float(layer.nm_coef))
        for v, b in zip(owned, bounds)
    ]


__all__ = [
    "ROUNDOFF_SLACK",
    "Bounds",
    "VariableBound",
    "bound_pass",
    "parameterized_variables",
    "variable_key",
]
