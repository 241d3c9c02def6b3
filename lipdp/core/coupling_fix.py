r"""Rule S2 repaired: :func:`fix_batch_coupling` (also ``lipdp.fix_batch_coupling``) returns
a copy of a model in which no layer couples the examples of a batch, and a report.

The checker (:mod:`lipdp.core.coupling`: which layers couple the examples of a batch; the
numerical probe of :mod:`lipdp.core.batch_independence`) refuses; this module repairs what
the checker names. A copy of a model (``Sequential``, functional, nested sub-models,
wrappers, or a list of layers) is returned with every trainable batch normalisation
replaced by a ``GroupNormalization`` (per-example statistics, :func:`group_count`
groups; gamma and beta kept, the moving statistics dropped) and every layer declaring
``couples_examples = True`` by its ``per_example_replacement()``, if it has one; a
:class:`BatchCouplingFix` lists what changed and what could not be fixed (the copy
still holds those layers, and the DP models refuse it). Imports no TensorFlow: it runs
on Keras 3's JAX backend too. The old import path
``lipdp.core.batch_independence.fix_batch_coupling`` still works (re-exported).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import keras
import numpy as np

from lipdp.core.coupling import coupling_layers, coupling_reason, is_batch_normalization
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import children

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replacement:
    """One layer replaced by :func:`fix_batch_coupling`."""

    path: str
    old_class: str
    new_class: str
    detail: str = ""

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.path}: {self.old_class} -> {self.new_class}{detail}"


@dataclass(frozen=True)
class Unfixed:
    """A coupling layer :func:`fix_batch_coupling` left in place, and why."""

    path: str
    layer_class: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.layer_class} NOT FIXED ({self.reason})"


@dataclass
class BatchCouplingFix:
    """What :func:`fix_batch_coupling` changed (``replaced``) and could not change
    (``unfixed``: the copy still holds these layers, and DP models refuse it)."""

    replaced: list = field(default_factory=list)
    unfixed: list = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """No coupling layer left."""
        return not self.unfixed

    def __str__(self) -> str:
        if not self.replaced and not self.unfixed:
            return "No layer couples the examples of a batch: nothing to fix."
        lines = [f"{len(self.replaced)} layer(s) replaced, {len(self.unfixed)} not fixed:"]
        lines += [f"  {item}" for item in [*self.replaced, *self.unfixed]]
        return "\n".join(lines)


#: Fewest values one group of a replacing ``GroupNormalization`` normalises over (per
#: example): fewer make its mean and variance degenerate (one value: the output is beta).
MIN_GROUP_VALUES = 16


def group_count(channels, positions=None, max_groups=32) -> int:
    """Groups of the ``GroupNormalization`` replacing a batch normalisation over
    ``channels`` channels with ``positions`` values per channel and example (the product
    of the spatial or time axes; ``None``: unknown, taken as large): the largest divisor
    ``G`` of ``channels`` with ``G <= max_groups`` (Wu & He 2018 use 32) and at least
    :data:`MIN_GROUP_VALUES` values per group, ``(channels / G) x positions``; 1 if none
    (one group over the features is LayerNormalization's statistic)."""

    def enough(groups):
        return positions is None or (channels // groups) * positions >= MIN_GROUP_VALUES

    divisors = range(1, min(channels, max_groups) + 1)
    return max((g for g in divisors if channels % g == 0 and enough(g)), default=1)


def _positions(shape, axis):
    """Values per channel of one example (``None`` if an axis is unknown)."""
    sizes = [d for i, d in enumerate(shape) if i not in (0, axis)]
    return None if any(d is None for d in sizes) else int(np.prod(sizes, dtype=np.int64))


def _build_shape(layer):
    """The input shape ``layer`` was built for (Keras records it when a layer is built),
    else -- a layer built directly by a wrapper -- what its ``input_spec`` states."""
    shape = compat.build_input_shape(layer)
    if callable(getattr(shape, "as_list", None)):  # Keras 2: a tf.TensorShape
        shape = shape.as_list() if shape.rank is not None else None
    if shape is not None or not layer.built:
        return shape
    spec = layer.input_spec
    spec = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    if getattr(spec, "ndim", None) is None:
        return None
    shape = [None] * spec.ndim
    for axis, size in (spec.axes or {}).items():
        shape[axis] = size
    return shape


class _Fixer:
    """The recursive copy behind :func:`fix_batch_coupling`."""

    def __init__(self, max_groups):
        self.max_groups = max_groups
        self.report = BatchCouplingFix()
        self.pairs = []  # (old, new, copy_weights) in creation order, outer first

    def copy(self, layer, path):
        reason = coupling_reason(layer)
        if reason is not None:
            return self.replace(layer, path, reason)
        if _is_model(layer):
            return self.model(layer, path)
        inner = getattr(layer, "layer", None)
        wrapped = isinstance(layer, keras.layers.Wrapper) and inner is not None
        if wrapped and coupling_layers(inner):
            if isinstance(layer, keras.layers.Bidirectional):
                return self.unfixable(layer, path, "a Bidirectional wrapper is rebuilt by hand")
            config = layer.get_config()
            config.pop("layer")
            new = type(layer)(self.copy(inner, f"{path}/{inner.name}"), **config)
            self.pairs.append((layer, new, False))
            return new
        if any(coupling_layers(child) for child in children(layer)):
            return self.unfixable(
                layer,
                path,
                "inside a custom layer whose code creates it: rebuild that layer with "
                "GroupNormalization",
            )
        return self.same(layer)

    def same(self, layer):
        """A copy of ``layer`` from its config (its weights copied by :meth:`finish`)."""
        try:
            new = type(layer).from_config(layer.get_config())
        except (NotImplementedError, TypeError):
            raise ValueError(
                f"fix_batch_coupling cannot copy layer {layer.name!r} ({type(layer).__name__}): "
                "it has no get_config(). Implement get_config, or fix the model by hand."
            ) from None
        self.pairs.append((layer, new, True))
        return new

    def model(self, model, path):
        def clone(layer):
            return self.copy(layer, f"{path}/{layer.name}")

        new = compat.clone_model(model, clone_function=clone)
        self.pairs.append((model, new, False))
        return new

    def unfixable(self, layer, path, why):
        for inner_path, inner, _ in coupling_layers(layer):
            suffix = inner_path.split("/", 1)[1] if "/" in inner_path else ""
            full = f"{path}/{suffix}" if suffix else path
            self.report.unfixed.append(Unfixed(full, type(inner).__name__, why))
        return self.same(layer)

    def replace(self, layer, path, reason):
        replacement = getattr(layer, "per_example_replacement", None)
        if not is_batch_normalization(layer):
            if callable(replacement):
                new = replacement()
                self.report.replaced.append(
                    Replacement(path, type(layer).__name__, type(new).__name__, "its own")
                )
                return new
            self.report.unfixed.append(
                Unfixed(path, type(layer).__name__, "no per_example_replacement()")
            )
            return self.same(layer)
        return self.group_norm(layer, path)

    def group_norm(self, layer, path):
        shape = _build_shape(layer)
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        if shape is None:
            self.report.unfixed.append(
                Unfixed(
                    path,
                    type(layer).__name__,
                    "not built, so its channel count is unknown: build the model first "
                    "(give its first layer an input_shape)",
                )
            )
            return self.same(layer)
        if len(axes) != 1:
            self.report.unfixed.append(
                Unfixed(path, type(layer).__name__, f"normalises over several axes {axes}")
            )
            return self.same(layer)
        axis = axes[0] % len(shape)
        channels = int(shape[axis])
        groups = group_count(channels, _positions(shape, axis), self.max_groups)
        config = layer.get_config()
        new = keras.layers.GroupNormalization(
            groups=groups,
            axis=axis,
            epsilon=config["epsilon"],
            center=config["center"],
            scale=config["scale"],
            beta_initializer=config["beta_initializer"],
            gamma_initializer=config["gamma_initializer"],
            beta_regularizer=config["beta_regularizer"],
            gamma_regularizer=config["gamma_regularizer"],
            beta_constraint=config["beta_constraint"],
            gamma_constraint=config["gamma_constraint"],
            name=f"{layer.name}_gn",
            trainable=layer.trainable,
            dtype=config.get("dtype"),
        )
        self.pairs.append((layer, new, "bn"))
        self.report.replaced.append(
            Replacement(
                path,
                type(layer).__name__,
                "GroupNormalization",
                f"groups={groups} of {channels} channels; gamma and beta kept, moving "
                "statistics dropped",
            )
        )
        return new

    def finish(self):
        """Build what the clone left unbuilt, then copy the weights."""
        for old, new, _ in self.pairs:
            shape = _build_shape(old)
            if old.built and not new.built and shape is not None:
                _build_by_calling(new, shape)
        for old, new, how in self.pairs:
            if not old.built or how is False:
                continue
            if how == "bn":
                if old.scale:
                    new.gamma.assign(old.gamma)
                if old.center:
                    new.beta.assign(old.beta)
            else:
                new.set_weights(old.get_weights())


def _build_by_calling(layer, shape) -> None:
    """Build ``layer`` for ``shape`` by calling it on a symbolic input: unlike ``build``,
    this also creates the weights of the sub-layers a custom layer calls."""
    if all(d is None or isinstance(d, int) for d in shape):
        layer(keras.Input(batch_shape=tuple(shape)))
    else:
        layer.build(shape)


def _built_for_shapes(layers) -> None:
    """Build a list's layers (through a throw-away ``Sequential``) when a batch
    normalisation in it is not built and the first layer states its input shape: the
    replacement needs the channel count."""
    unbuilt = any(not layer.built for _, layer, _ in coupling_layers(layers))
    if unbuilt and compat.declared_batch_shape(layers[0]) is not None:
        try:
            keras.Sequential(list(layers))
        except (TypeError, ValueError) as error:  # layers a Sequential cannot chain
            logger.debug("could not build the layers to read their shapes: %s", error)


def fix_batch_coupling(model, max_groups=32):
    """A copy of ``model`` in which no layer couples the examples of a batch, and a
    report of what changed.

    ``model``: a Keras ``Sequential`` or functional model (nested sub-models, wrappers
    such as ``TimeDistributed`` included), a single layer, or a list of layers (as
    :class:`lipdp.clipped.model.DPSGD_Sequential` takes). Every trainable batch normalisation
    (``BatchNormalization``, ``SyncBatchNormalization``, the v1 class) becomes a
    ``GroupNormalization`` over the same axis, with :func:`group_count` groups (the
    largest divisor of the channel count at most ``max_groups`` that leaves at least
    :data:`MIN_GROUP_VALUES` values per group and example, else 1), the same epsilon and
    gamma and
    beta (values, initialisers, regularisers, constraints); the moving statistics are
    dropped (a group normalisation has none). A frozen one (``trainable=False``) is kept:
    it runs in inference mode, a fixed affine map per example. A layer declaring
    ``couples_examples = True`` is replaced by its ``per_example_replacement()`` if it
    has one. Every other layer is copied with its weights.

    Returns ``(copy, report)``: ``report`` is a :class:`BatchCouplingFix` listing each
    replacement (path, old class, new class) and each coupling layer it could not fix
    (inside a custom layer's own code, an unbuilt batch normalisation whose channel count
    is unknown, a multi-axis one): the copy still holds those, and DP models refuse it.
    """
    fixer = _Fixer(max_groups)
    if isinstance(model, keras.layers.Layer):
        new = fixer.copy(model, model.name)
    else:
        # A keras.Input(...) in the list (as make_private takes it) stands for its InputLayer.
        layers = [compat.as_layer(item) for item in model]
        _built_for_shapes(layers)
        new = [fixer.copy(layer, layer.name) for layer in layers]
    fixer.finish()
    if fixer.report.unfixed:
        logger.warning("fix_batch_coupling left layers that couple examples:\n%s", fixer.report)
    return new, fixer.report


def _is_model(layer) -> bool:
    return isinstance(layer, keras.Sequential) or compat.is_functional(layer)


__all__ = [
    "MIN_GROUP_VALUES",
    "BatchCouplingFix",
    "Replacement",
    "Unfixed",
    "fix_batch_coupling",
    "group_count",
]
