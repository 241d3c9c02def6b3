r"""Which layers couple the examples of a batch: the structural walk of rule S2, one
function for every backend and both families.

Both families release ``sum_i g_i / n`` (``g_i``: the gradient of row ``i``'s loss) with
noise calibrated to one row's share; a layer that uses a statistic of the batch in
training lets one row move every other row's gradient. :func:`refuse_coupling_layers`
walks every layer reachable from a model's layers
(:func:`lipdp.foundation.layer_walk.nested_layers`:
sub-models, wrappers, lipdp's residual blocks, the sub-layers a custom layer tracks) and
refuses, naming its path and the fix:

* a batch normalisation of any Keras class (matched by class name anywhere in the
  layer's class hierarchy: ``BatchNormalization``, its base, the v1 and v2 classes,
  ``SyncBatchNormalization``, and other packages' copies) unless it runs in inference
  mode (:func:`runs_in_inference_mode`: a frozen one, ``trainable = False``, not Keras
  2's v1 class): in training it normalises with the batch's statistics *and* updates its
  moving statistics from the private batch, saved with the model and never noised;
* a layer declaring ``couples_examples = True`` (:data:`COUPLES_EXAMPLES`, on the class or
  the instance): how users mark their own layers.

The walk runs on the TensorFlow models (both families, :mod:`lipdp.core.batch_independence`
adds the numerical probe there) and on Keras 3's JAX backend
(:func:`lipdp.clipped.jax.model.check_network`), with the same messages. It imports no
TensorFlow. :func:`lipdp.fix_batch_coupling` (:mod:`lipdp.core.coupling_fix`) replaces
what it refuses.
"""

from __future__ import annotations

from lipdp.foundation import compat
from lipdp.foundation.layer_walk import nested_layers

#: The attribute by which a layer declares that it couples the examples of a batch in
#: training: ``couples_examples = True`` on the class or the instance. Such a layer is
#: refused (:func:`refuse_coupling_layers`); if it also has a method
#: ``per_example_replacement()`` returning an equivalent layer that treats each example
#: on its own, :func:`lipdp.fix_batch_coupling` uses it.
COUPLES_EXAMPLES = "couples_examples"

#: Names of the Keras classes that normalise with batch statistics (the base class, the
#: v2 and v1 classes, the synchronised one), matched anywhere in a layer's class
#: hierarchy so that subclasses and other Keras packages' copies are caught.
_BATCH_NORMALIZATION_CLASSES = frozenset(
    {
        "BatchNormalizationBase",
        "BatchNormalization",
        "BatchNormalizationV1",
        "BatchNormalizationV2",
        "SyncBatchNormalization",
    }
)

_FIX = (
    "lipdp.fix_batch_coupling(model) replaces it with GroupNormalization (or use "
    "GroupNormalization or LayerNormalization yourself)"
)


def is_batch_normalization(layer) -> bool:
    """Whether ``layer`` is a Keras batch normalisation (any of its classes)."""
    return any(cls.__name__ in _BATCH_NORMALIZATION_CLASSES for cls in type(layer).__mro__)


def runs_in_inference_mode(layer) -> bool:
    """A frozen Keras ``BatchNormalization``: with ``trainable = False`` it runs in
    inference mode even when called with ``training=True`` (moving statistics, not
    updated; documented by Keras). Keras 2's v1 class keeps batch statistics, so it is
    not (:func:`lipdp.foundation.compat.frozen_batch_norm_in_inference_mode`)."""
    return compat.frozen_batch_norm_in_inference_mode(layer)


def coupling_reason(layer) -> str | None:
    """Why ``layer`` itself couples the examples of a batch in training, or ``None``."""
    if getattr(layer, COUPLES_EXAMPLES, False) is True:
        return "declares couples_examples = True (it mixes the examples of a batch)"
    if is_batch_normalization(layer) and not runs_in_inference_mode(layer):
        return (
            "normalises with batch statistics in training and updates its moving "
            "statistics from the private batch without noise"
        )
    return None


def coupling_layers(layers) -> list:
    """``[(path, layer, reason)]``: the layers of :func:`nested_layers` that couple the
    examples of a batch in training (:func:`coupling_reason`)."""
    found = []
    for path, layer in nested_layers(layers):
        reason = coupling_reason(layer)
        if reason is not None:
            found.append((path, layer, reason))
    return found


def refuse_coupling_layers(layers) -> None:
    """Refuse the first layer, at any depth, that couples the examples of a batch in
    training (rule S2), naming its path and the fix."""
    for path, layer, reason in coupling_layers(layers):
        if is_batch_normalization(layer):
            fix = f"{_FIX}, or freeze it (trainable=False: inference mode)"
        else:
            fix = (
                "Replace it by a layer that treats each example on its own (the fixer uses "
                "its per_example_replacement() if it has one)"
            )
        raise ValueError(
            f"Layer {path!r} ({type(layer).__name__}) {reason}: one example changes every "
            f"other example's gradient (rule S2). {fix}."
        )


__all__ = [
    "COUPLES_EXAMPLES",
    "coupling_layers",
    "coupling_reason",
    "is_batch_normalization",
    "refuse_coupling_layers",
    "runs_in_inference_mode",
]
