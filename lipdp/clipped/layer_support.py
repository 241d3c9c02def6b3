"""Which Keras layers clipped DP-SGD trains, checked over every nested layer (rules S2, S13),
on both backends.

:func:`check_keras_layers` is the one check of a clipped model's layers, run by the
TensorFlow models (:class:`lipdp.clipped.model.DPSGD_Model`, when built) and by the JAX
model (:func:`lipdp.clipped.jax.model.check_network`, at construction and before every
fit), with the same messages: the layers that couple the examples of a batch
(:func:`lipdp.core.coupling.refuse_coupling_layers`, rule S2), activity regularisers, and
:func:`check_layer_support` below. It imports no TensorFlow.

Per-example clipping (:mod:`lipdp.clipped.per_example`) trains any layer whose forward pass
treats each example on its own and whose variables change only through the released
gradient: ghost norms for ``Dense``, ``Conv2D`` and ``Embedding`` (inside nested
``Sequential`` and chain-shaped functional models too), the vectorised per-example
fallback for every other layer with weights (``docs/keras_layers.md`` lists what was
tried). :func:`check_layer_support` refuses, when the model is built, what it
cannot train soundly, walking nested models and wrappers and naming the path to the
layer (``'backbone/lstm_1'``):

* a **stateful** recurrent layer: its state carries one batch's rows into the next
  step, so an example's influence does not end with its own clipped gradient;
* an **activity regulariser** (``activity_regularizer=...`` or ``ActivityRegularization``):
  a loss computed from the activations, outside the clipped per-example losses (weight
  regularisers are supported: a penalty of the weights alone is added to the released
  gradient, :meth:`lipdp.core.private_model.PrivateModel.penalty_gradients`);
* ``SpectralNormalization``: it rewrites its wrapped kernel in every training call, an
  assignment the per-example fallback would repeat once per row.

What only a forward pass reveals is refused when the training step is first traced,
before any step runs: a layer reading another layer's variable without tracking it
(:func:`lipdp.clipped.per_example.refuse_untracked_reads`, ghost norms) and ``add_loss`` of a
tensor computed in a call
(:meth:`~lipdp.core.private_model.PrivateModel.refuse_data_dependent_losses`).
Layers that couple the examples of a batch (batch normalisation, ``couples_examples``)
are refused by :func:`check_keras_layers`.
"""

from __future__ import annotations

import keras

from lipdp.core.coupling import refuse_coupling_layers
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import nested_layers


def _stateful(layer) -> bool:
    """The layer's own stateful flag: Keras 2's ``_stateful`` (its ``stateful`` property
    looks inside sub-layers: it would name the container), Keras 3's ``stateful``
    attribute (recurrent layers and their wrappers; Keras 3 layers have no generic one)."""
    if compat.keras_3():
        return getattr(layer, "stateful", False) is True
    return bool(getattr(layer, "_stateful", False))


def _refusal(path, layer) -> str | None:
    """Why ``layer`` cannot be trained with per-example clipping, or ``None``."""
    kind = type(layer).__name__
    if _stateful(layer):
        return (
            f"Layer {path!r} ({kind}) is stateful: its state carries one batch's rows into "
            "the next step, beyond their clipped gradients. Use stateful=False."
        )
    if getattr(layer, "activity_regularizer", None) is not None:
        return (
            f"Layer {path!r} ({kind}) has an activity regulariser: a loss computed from the "
            "activations, outside the clipped per-example losses. Remove it (weight "
            "regularisers are supported)."
        )
    if isinstance(layer, keras.layers.SpectralNormalization):
        return (
            f"Layer {path!r} (SpectralNormalization) rewrites its kernel in every training "
            "call, which per-example gradients would repeat per row. Use a kernel_constraint "
            "or the clipless family (lipdp.clipless.layers.DP_SpectralDense, DP_SpectralConv2D)."
        )
    return None


def check_layer_support(layers) -> None:
    """Refuse, with one line naming the path and the fix, any nested layer that
    per-example clipping cannot train soundly (module docstring)."""
    for path, layer in nested_layers(layers):
        reason = _refusal(path, layer)
        if reason is not None:
            raise ValueError(reason)


def check_keras_layers(layers) -> None:
    """Refuse what per-example clipping cannot handle, with the fix in the message."""
    layers = list(layers)
    if not layers:
        raise ValueError("A DP-SGD model needs at least one layer.")
    seen = set()
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"{layer!r} is not a Keras layer.")
        refuse_coupling_layers(layer)  # at any depth (rule S2)
        if id(layer) in seen:
            raise ValueError(f"Layer {layer.name!r} appears twice; use two layers.")
        seen.add(id(layer))
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"Layer {layer.name!r} has an activity_regularizer: a loss term outside the "
                "clipped per-example losses. Remove it."
            )
    check_layer_support(layers)  # every nested layer: stateful RNNs, ...


__all__ = ["check_keras_layers", "check_layer_support"]
