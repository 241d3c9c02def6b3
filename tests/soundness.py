"""Independent checks of the bound propagation (rule S1) with autodiff.

For a DP model and a batch, :func:`measure` computes with ``tf.GradientTape``:

* the per-example gradient norm of every trainable variable, divided by the
  bound the library declares for one example;
* the norm of every layer's input, divided by the forward bound;
* the norm of the per-example cotangent at every layer input, divided by the
  backward bound.

:func:`adversarial_search` then runs gradient ascent on the inputs and on the
weights (projected back after every step, as in training) to push the largest
gradient ratio up. A sound library keeps every ratio <= 1 (up to float32
round-off, ``TOLERANCE``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation.variables import variable_key

#: The noise is calibrated for the bound times (1 + ROUNDOFF_SLACK): float32
#: round-off may exceed the exact bound by that much, not more.
TOLERANCE = ROUNDOFF_SLACK


@dataclass
class Ratios:
    gradient: dict = field(default_factory=dict)  # variable name -> max ratio
    activation: float = 0.0
    cotangent: float = 0.0

    @property
    def worst_gradient(self) -> float:
        return max(self.gradient.values(), default=0.0)

    def merge(self, other: Ratios) -> Ratios:
        names = set(self.gradient) | set(other.gradient)
        return Ratios(
            {n: max(self.gradient.get(n, 0.0), other.gradient.get(n, 0.0)) for n in names},
            max(self.activation, other.activation),
            max(self.cotangent, other.cotangent),
        )

    def assert_sound(self, tolerance: float = TOLERANCE):
        assert self.worst_gradient <= 1 + tolerance, f"gradient bound violated: {self.gradient}"
        assert self.activation <= 1 + tolerance, f"activation bound violated: {self.activation}"
        assert self.cotangent <= 1 + tolerance, f"cotangent bound violated: {self.cotangent}"


def _norms(tensor) -> tf.Tensor:
    """Per-example Euclidean norms of a batch tensor (or a pair of them)."""
    if isinstance(tensor, (tuple, list)):
        return tf.stack([_norms(t) for t in tensor], axis=0)
    flat = tf.reshape(tensor, (tf.shape(tensor)[0], -1))
    return tf.norm(flat, axis=1)


def _as_pair_array(bound):
    if isinstance(bound, (tuple, list)):
        return np.array([float(b) for b in bound])[:, None]
    return float(bound)


def per_example_losses(model, x, y):
    """Loss of each example alone (the loss' ``call`` returns one value per example)."""
    y_pred = model(x, training=True)
    return model.loss.call(tf.convert_to_tensor(y), y_pred)


def measure(model, x, y) -> Ratios:
    """Largest ratios measured/declared on the batch ``(x, y)``.

    Declared bounds come from the model's one bound pass (``model.bounds()``); the
    measurements from autodiff through the model's own forward loop.
    """
    x = tf.convert_to_tensor(x)
    y = tf.convert_to_tensor(y)
    declared = model.bounds()
    bounds = {variable_key(e.variable): (e.key, float(e.bound)) for e in declared.variables}
    ratios = Ratios()
    count = len(model.dp_layers)

    # Forward pass, keeping every layer input for the cotangents.
    inputs = []
    with tf.GradientTape(persistent=True) as tape:

        def watched(h):
            # Fresh tensors per path: after DP_SplitResidual both entries of the pair
            # are one tensor, whose gradient would sum the two paths.
            h = tf.nest.map_structure(tf.identity, h)
            tape.watch(tf.nest.flatten(h))
            inputs.append(h)
            return h

        h = model.forward(
            watched(x),
            training=True,
            observe=lambda index, out: watched(out) if index + 1 < count else out,
        )
        # The contribution of each example to the *mean* loss, as in training (the
        # cotangent clipping of DP_ClipGradient is calibrated for the loss normaliser);
        # norms are multiplied back by it to compare with per-example bounds.
        batch = model.loss_normalizer or x.shape[0]
        contributions = model.loss.call(y, h) / batch
        total = tf.reduce_sum(contributions)

    for layer_input, bound in zip(inputs, declared.input_bounds):
        if bound is not None:
            ratios.activation = max(
                ratios.activation, float(tf.reduce_max(_norms(layer_input) / _as_pair_array(bound)))
            )
    for layer_input, g_bound in zip(inputs, declared.input_cotangent_bounds):
        cot = tape.gradient(total, layer_input)
        if cot is None or (isinstance(cot, (list, tuple)) and any(c is None for c in cot)):
            continue
        ratio = float(tf.reduce_max(batch * _norms(cot) / _as_pair_array(g_bound)))
        ratios.cotangent = max(ratios.cotangent, ratio)

    variables = model.trainable_variables
    # A row loop, not pfor: in eager mode pfor traces a new function at every call, which
    # costs several times the few backward passes of a test batch.
    jacobians = tape.jacobian(contributions, variables, experimental_use_pfor=False)
    for v, jac in zip(variables, jacobians):
        name, bound = bounds[variable_key(v)]
        per_example = batch * _norms(jac)
        ratios.gradient[name] = float(tf.reduce_max(per_example)) / bound
    return ratios


def _gradient_ratio_objective(model, x, y):
    """Sum over examples and variables of (per-example gradient norm / bound)^2.

    The bounds are recomputed here, under the caller's tape: with norm-adaptive layers
    they depend on the weights, and the ascent must see that dependence too."""
    bounds = {variable_key(e.variable): e.bound for e in model.bounds().variables}
    total = 0.0
    b = model.loss_normalizer  # DP_ClipGradient clips at C / b
    for i in range(x.shape[0]):
        with tf.GradientTape() as inner:
            li = per_example_losses(model, x[i : i + 1], y[i : i + 1])[0] / b
        grads = inner.gradient(li, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            total += tf.reduce_sum(tf.square(b * g)) / bounds[variable_key(v)] ** 2
    return total


def adversarial_search(model, x, y, steps=15, step_size=0.3, attack_weights=True) -> Ratios:
    """Gradient ascent on inputs (and weights) to maximise gradient-norm / bound.

    Inputs move freely (the model's DP_BoundedInput clips them); weights are
    projected back onto their constraint sets after every ascent step, so they
    stay in the set the bounds are proven for. Returns the worst ratios seen.
    """
    x = tf.Variable(tf.convert_to_tensor(x))
    y = tf.convert_to_tensor(y)
    worst = measure(model, x, y)
    for _ in range(steps):
        targets = [x] + (list(model.trainable_variables) if attack_weights else [])
        with tf.GradientTape() as tape:
            objective = _gradient_ratio_objective(model, x, y)
        grads = tape.gradient(objective, targets)
        for target, g in zip(targets, grads):
            if g is None:
                continue
            scale = tf.norm(target) + 1e-6
            target.assign_add(step_size * scale * g / (tf.norm(g) + 1e-12))
        model.project()
        worst = worst.merge(measure(model, x, y))
    return worst
