"""Fixed features: run a weightless front-end once, train a head on its outputs.

A front-end without weights (:class:`~lipdp.clipless.layers.DP_ScatteringTransform`, a per-example
normalisation) maps each record to its features by a fixed function: no statistic of the
data set enters it. Training a head on ``f(x_i)`` with neighbouring data sets differing in
one record differs in one feature row, so the head's (epsilon, delta) is the guarantee
for the records (post-processing does the rest). Recomputing the front-end at every epoch
would give the same model at a much higher cost: :func:`fixed_features` computes it once
and returns the public bound on the features' norm, the input bound of the head::

    features, bound = fixed_features(zoo.scattering_net(meta)[:3], x_train)
    head = DP_Sequential([DP_BoundedInput(features.shape[1:], bound), DP_Flatten(), ...])

:func:`fixed_front_end` finds such a front-end at the start of a network (``lipdp train``
trains the head of its scattering networks on cached features,
:mod:`lipdp.recipes.runs`).
"""

from __future__ import annotations

import keras
import numpy as np

from lipdp.clipless.bounds import bound_pass
from lipdp.clipless.layers import (
    DP_BoundedInput,
    DP_GroupNormalization,
    DP_InputLayer,
    DP_ScatteringTransform,
    DPLayer,
)
from lipdp.foundation import compat

#: Layers that map one example to its output by a fixed function: no variables, no
#: randomness, no statistic of the batch. An allow-list of exact types: a weightless layer
#: is not enough (a dropout has no weights), nor is a subclass (its ``call`` may differ).
FIXED_LAYER_TYPES = (DP_InputLayer, DP_BoundedInput, DP_ScatteringTransform, DP_GroupNormalization)


def _is_fixed(layer) -> bool:
    if isinstance(layer, keras.layers.InputLayer):  # (the framework's own placeholder)
        return True
    return type(layer) in FIXED_LAYER_TYPES and not layer.weights


def fixed_front_end(layers) -> int:
    """How many leading layers of ``layers`` form a fixed front-end worth computing once:
    the longest run of input layers and :data:`FIXED_LAYER_TYPES` without weights, if it
    holds a :class:`~lipdp.clipless.layers.DP_ScatteringTransform`; else 0 (an input
    layer alone is not worth a cache)."""
    length = 0
    for layer in layers:
        if not _is_fixed(layer):
            break
        length += 1
    scattering = any(isinstance(layer, DP_ScatteringTransform) for layer in layers[:length])
    return length if scattering else 0


def front_end_bound(dp_layers) -> float:
    """Public bound on the norm of the front-end's output: the output bound of the one
    bound pass (:func:`lipdp.clipless.bounds.bound_pass`) from the
    :class:`~lipdp.clipless.layers.DP_BoundedInput` that must open it."""
    if not dp_layers or not isinstance(dp_layers[0], DP_BoundedInput):
        raise ValueError(
            "a front-end must start with DP_BoundedInput: the bound on its outputs starts "
            "from the public bound on one input."
        )
    for layer in dp_layers:
        if not isinstance(layer, DPLayer):
            raise ValueError(f"{layer.name} is not a DP layer: its output norm is not bounded.")
    return float(bound_pass(dp_layers).output_bound)


def fixed_features(dp_layers, x, batch_size=256) -> tuple[np.ndarray, float]:
    """``(features, bound)``: the weightless DP layers ``dp_layers`` applied to ``x``
    (one pass, in batches) and the public bound on each feature row's norm.

    Refuses a layer with variables: trained (or data-dependent) weights would make the
    features depend on other records.
    """
    features = apply_front_end(dp_layers, x, batch_size)  # builds the layers the bound reads
    return features, front_end_bound(dp_layers)


def apply_front_end(layers, x, batch_size=256) -> np.ndarray:
    """The weightless ``layers`` applied to ``x`` (one pass, in batches), as ``float32``.
    Refuses a layer with variables (see :func:`fixed_features`)."""
    model = keras.Sequential(list(layers))
    model.build((None, *np.shape(x)[1:]))
    holding = [layer.name for layer in model.layers if layer.weights]
    if holding:
        raise ValueError(
            f"fixed features need weightless layers; {holding} hold variables. Train them "
            "in the model instead."
        )
    compute = _compiled(model.call)
    parts = [
        np.asarray(compute(x[start : start + batch_size])) for start in range(0, len(x), batch_size)
    ]
    return np.concatenate(parts).astype(np.float32)


def _compiled(call):
    """``call`` compiled for the backend: ``jax.jit`` on JAX (the layers hold no variables,
    so the call is a pure function of its input), ``tf.function`` on TensorFlow."""
    if compat.keras_backend() == "jax":
        import jax

        return jax.jit(call)
    import tensorflow as tf

    compiled = tf.function(call)
    return lambda chunk: compiled(tf.constant(chunk))
