"""The attacker's soundness check: one real training step on a batch and on the same batch
minus one row, with identical noise; the released gradients may differ by at most the
declared sensitivity (rules S1, S2, S13).

:func:`released_gradient` runs ``model.train_on_batch`` -- the real step, every path of
the family's ``train_step`` -- and captures what :meth:`PrivateModel.release_step`
returns (the noisy gradient handed to the optimizer, before any projection), then
restores every variable of the model (weights, optimizer slots, step count, ledger) and
the noise generator's state, so that a second call sees the same model and draws the
same noise. :func:`remove_one_ratios` compares the step on ``B`` with the steps on
``B \\ {i}`` for the rows asked for, per declared sensitivity:

* ``"global"`` noise (one Gaussian mechanism): the norm of the whole difference over
  ``sqrt(sum Delta^2)``;
* ``"per-layer"`` noise: the norm of each mechanism's part over its own ``Delta``.

The batch must be of a Poisson-sampled model (``DatasetMetadata(sampling="poisson")``),
whose loss normaliser does not depend on the actual number of rows: removing a row is
then a legal batch. Ratios are returned, not asserted: a test asserts ``<= 1 +
ROUNDOFF_SLACK`` and, to be sure the check is not vacuous, that some ratio comes close.
"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from lipdp.core import noise
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation.variables import variable_key

#: Released differences may exceed the declared sensitivity by float32 round-off only.
TOLERANCE = ROUNDOFF_SLACK


def _snapshot(model):
    optimizer_variables = model.optimizer.variables  # a method on Keras 2, a list on Keras 3
    if callable(optimizer_variables):
        optimizer_variables = optimizer_variables()
    variables = list(model.variables) + list(optimizer_variables)
    return variables, [v.numpy() for v in variables]


def released_gradient(model, x, y) -> list[np.ndarray]:
    """The released (noisy) gradient of one real training step on ``(x, y)``, aligned
    with ``model.trainable_variables``; the model, its optimizer and the noise generator
    are left as they were before the step."""
    with _recorded_steps(model) as step:
        return step(x, y)


@contextlib.contextmanager
def _recorded_steps(model):
    """Yields ``step(x, y)``: :func:`released_gradient` for several batches of one
    unchanged model, every step from the state (variables, noise generator) the model had
    on entry. The recording step is traced once and kept until the exit (Keras' step
    function relaxes the batch dimension at the second batch size: one more trace, then
    every other batch of that size reuses it); nothing may change the model meanwhile."""
    if model.optimizer is None:
        raise ValueError("compile the model first")
    generator = noise.noise_generator()
    noise_state = generator.state.numpy()
    original = model.release_step
    captured = {}

    def recording_release_step(gradients, variables):
        released = original(gradients, variables)
        if "stores" not in captured:
            with tf.init_scope():
                captured["stores"] = [
                    tf.Variable(tf.zeros_like(v), trainable=False) for v in variables
                ]
        for store, value in zip(captured["stores"], released):
            store.assign(value)
        return released

    if hasattr(model.optimizer, "build"):  # slots exist before the snapshot
        model.optimizer.build(model.trainable_variables)
    variables, values = _snapshot(model)

    def step(x, y):
        try:
            model.train_on_batch(x, y)
        finally:
            generator.state.assign(noise_state)
            for v, value in zip(variables, values):  # metrics created by the step are left
                v.assign(value)
        return [s.numpy().astype(np.float64) for s in captured["stores"]]

    model.release_step = recording_release_step
    model.train_function = None  # traced again, with the recording step
    try:
        yield step
    finally:
        del model.release_step
        model.train_function = None


def mechanism_groups(model) -> list[tuple[float, list[int]]]:
    """``[(Delta, indices of trainable variables)]``: one group per Gaussian mechanism of
    a step, from the model's own sensitivities and noise strategy."""
    variables = model.trainable_variables
    index = {variable_key(v): i for i, v in enumerate(variables)}
    entries = model.sensitivities()
    if model.dp_parameters.noisify_strategy == "global":
        delta = float(np.sqrt(sum(float(d) ** 2 for _, d in entries)))
        return [(delta, list(range(len(variables))))]
    groups = []
    for entry, delta in entries:
        variable = getattr(entry, "variable", None)
        if variable is not None:  # the clipless family: one entry per variable
            groups.append((float(delta), [index[variable_key(variable)]]))
    if groups:
        return groups
    # The clipped family: one entry per weighted layer, in forward order.
    layers = model.weighted_layers()
    return [
        (float(delta), [index[variable_key(v)] for v in layer.trainable_variables])
        for layer, (_, delta) in zip(layers, entries)
    ]


def remove_one_ratios(model, x, y, rows=None) -> np.ndarray:
    """``ratios[k, g]``: for row ``rows[k]`` removed, the norm of mechanism ``g``'s part of
    the difference of released gradients over its sensitivity (module docstring)."""
    if not model.poisson_sampling:
        raise ValueError("remove-one needs a model with DatasetMetadata(sampling='poisson')")
    x, y = tf.nest.map_structure(np.asarray, x), np.asarray(y)  # x: one array per input
    rows = range(len(y)) if rows is None else rows
    groups = mechanism_groups(model)
    ratios = []
    with _recorded_steps(model) as step:
        full = step(x, y)
        for i in rows:
            keep = np.arange(len(y)) != i
            without = step(tf.nest.map_structure(lambda a, keep=keep: a[keep], x), y[keep])
            ratios.append(
                [
                    np.sqrt(sum(np.sum((full[j] - without[j]) ** 2) for j in indices)) / delta
                    for delta, indices in groups
                ]
            )
    return np.asarray(ratios)


def worst_ratio(model, x, y, rows=None) -> float:
    """The largest ratio of :func:`remove_one_ratios`."""
    return float(np.max(remove_one_ratios(model, x, y, rows)))


__all__ = [
    "TOLERANCE",
    "mechanism_groups",
    "released_gradient",
    "remove_one_ratios",
    "worst_ratio",
]
