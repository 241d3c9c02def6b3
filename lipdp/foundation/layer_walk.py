"""Every layer reachable from a model's layers, with its path (one walk for every check).

Sub-models (``Sequential``, functional, subclassed), wrappers (``TimeDistributed``,
``Bidirectional``, anything holding a ``layer``, ``forward_layer`` or
``backward_layer``), lipdp's residual blocks and the sub-layers a custom layer tracks:
the batch-independence walk (:mod:`lipdp.core.batch_independence`), the layer-support checks
of clipped DP-SGD (:mod:`lipdp.clipped.layer_support`) and the check of losses added in a call
all name a layer by the path this walk gives, e.g. ``"backbone/block2/bn"``. Imports
nothing else of lipdp.
"""

from __future__ import annotations

import keras


def children(layer) -> list:
    """The layers ``layer`` tracks directly (Keras 2's ``_flatten_layers``: sub-models'
    layers, wrapped layers, a custom layer's attributes) and the wrapped layers named by
    the usual attributes, in case a wrapper does not track them."""
    children = []
    flatten = getattr(layer, "_flatten_layers", None)
    if callable(flatten):
        children = list(flatten(include_self=False, recursive=False))
    for attribute in ("layer", "forward_layer", "backward_layer", "block"):
        child = getattr(layer, attribute, None)
        if isinstance(child, keras.layers.Layer) and all(child is not c for c in children):
            children.append(child)
    return children


def nested_layers(layers):
    """``(path, layer)`` for every layer reachable from ``layers`` (a layer or a list),
    depth-first, each once; the path joins the layers' names, e.g.
    ``"backbone/block2/batch_normalization_3"``."""
    layers = [layers] if isinstance(layers, keras.layers.Layer) else list(layers)
    seen = set()

    def visit(layer, path):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        yield path, layer
        for child in children(layer):
            yield from visit(child, f"{path}/{child.name}")

    for layer in layers:
        yield from visit(layer, layer.name)


__all__ = ["children", "nested_layers"]
