r"""Ghost rules: the per-family formulas of the ghost method, registered by Keras layer class.

The engine (:mod:`lipdp.clipped.per_example.engine`) knows no layer family. For a layer
with a registered rule it records the input ``A`` and the pre-activation output ``Z``,
and asks the rule for what only the family knows; every other layer with variables goes
to the vectorised fallback (exact for any layer, materialised per row). A rule describes
a layer whose trainable variables are a kernel ``W`` and optionally a bias ``b``, with

    ``Z_i = f(A_i; W) + b`` (``b`` broadcast over positions), ``f`` linear in ``W``,

each row ``i`` on its own, then an elementwise activation. Row ``i``'s kernel gradient for
an output cotangent ``G_i`` is the vector-Jacobian product ``grad_W,i = d<f(A_i; W),
G_i>/dW`` (it does not depend on ``W``), its bias gradient ``sum_t G_it``. The pieces
(methods of a :class:`GhostRule`; ``layer`` is the Keras layer, ``a`` and ``g`` batches
of recorded inputs and output cotangents):

required
    * ``linear(layer, a)``: ``Z`` computed from :meth:`GhostRule.kernel` (and the bias),
      the same numbers as the layer's own call before its activation. The engine runs
      it in place of the layer's call and differentiates it w.r.t. the kernel for the
      clipped sum (a layer-local backward pass with cotangents ``k_i U_i``).
    * ``kernel_sq_norms(layer, a, g)``: ``(b,)`` float64, ``||grad_W,i||_F^2`` per row,
      without materialising ``grad_W,i`` where a cheaper identity exists (the *ghost*
      norm). ``g`` is the unit cotangent (entries in ``[-1, 1]``), ``a`` may be of any
      finite scale: compute in float64 so that the norm neither underflows nor overflows
      (rule S13; ``tests/clipped/test_extreme_records.py``).
    * ``shift(layer, a_new, a, g, kernel_rows)``: per row, the change of ``Z`` at the
      input ``a_new`` when the weights move by the row's gradient for ``(a, g)``:
      ``f(a'_i; grad_W,i) + grad_b,i``, shaped like ``Z``. BAM's second pass
      (:class:`lipdp.clipped.model.SharpnessAscent`) adds ``k_i`` times it to ``Z``.
      ``kernel_rows``: ``(b, *W.shape)`` per-row kernel gradients when the first pass
      materialised them (:meth:`GhostRule.kernel_rows`), else ``None``.

optional (defaults in :class:`GhostRule`)
    ``name`` (what :func:`ghost_rule` reports; default: the registered class's name in
    lower case), ``applies(layer)`` (a per-instance condition), ``kernel(layer)``,
    ``bias(layer)``, ``bias_rows(layer, g)``, ``activation(layer, z)``,
    ``kernel_rows(layer, a, g)`` (materialised ``grad_W,i`` when cheaper than the ghost
    norm; they then also give the clipped sum and BAM's shift).

backend-neutral, for the JAX step (optional: without them the rule is TensorFlow's only)
    * ``product_factors(layer, a, g)``: ``(A, G)`` of shapes ``(b, T, d)`` and ``(b, T,
      p)`` with row ``i``'s kernel gradient ``A_i^T G_i`` (the kernel reshaped to ``(d,
      p)``): the rule's kernel gradient is a sum of outer products over positions
      (``Dense``: the inputs; ``Conv2D``: the input patches). The norm formulas of such
      a gradient (``T = 1``, the Grams or the materialised rows, and their precision on
      each backend) are written once, in :mod:`lipdp.clipped.per_example.dense`.
    * ``apply_kernel(layer, a, kernel)``: ``f(A; W)`` for a kernel *value* ``W`` (the
      JAX step traces the network with its weights as arguments), without bias.

    The JAX step (:mod:`lipdp.clipped.jax.ghost`) covers a layer when its rule defines
    both; a model holding a layer whose rule does not (``Embedding``) or that has no rule
    takes the JAX step's per-row ``vmap`` for the whole step (sound for every layer;
    ghost norms and the ``vmap`` path are never mixed there).

The engine refuses, in one line, a rule whose kernel and bias are not exactly the
layer's trainable variables (a variable outside the rule would be missing from the
row's norm) and squared norms that are not float64.

**Lookup by class.** :func:`find_ghost_rule` walks the layer's class MRO to the nearest
class with a registration (a class that registers its own rule overrides its parents').
That rule applies if the layer's class *is* the registered class, or if it was
registered with ``subclasses=True`` and the layer's class does not override ``call``
(the engine runs ``linear`` and ``activation`` instead of the call: a rule cannot stand
for a call it has not seen); and if ``applies(layer)``. Otherwise the layer goes to the
fallback: the walk stops at the nearest registration. The built-in rules (``Dense``,
``Conv2D``, ``Embedding``) are registered for their exact classes (``subclasses=False``):
a subclass may change more than ``call`` -- ``build`` (another kernel parametrisation),
``convolution_op``, a ``kernel`` property -- which their formulas do not see, so a
subclass of ``Dense`` gets the fallback unless a rule is registered for it.

The lookup runs when the training step is traced: register a rule before the first
step (a step already traced keeps the rules it was traced with).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import keras

from lipdp.foundation import compat

if TYPE_CHECKING:  # annotations only: the registry imports no TensorFlow (JAX reads it)
    import tensorflow as tf

#: What :func:`ghost_rule` reports for a layer without an applicable rule.
FALLBACK = "vectorized"

#: The pieces a rule must define (module docstring).
REQUIRED_PIECES = ("linear", "kernel_sq_norms", "shift")


def stored_weights(layer) -> bool:
    """Are the layer's weights its own variables, as the built-in rules read them? Keras 3's
    ``Dense``, ``Conv`` and ``Embedding`` compute them otherwise under LoRA
    (``enable_lora``: a frozen kernel plus the product of two trainable factors) or
    quantization (integers and scales): such layers go to the fallback. (Keras 2's layers
    have neither.)"""
    lora = getattr(layer, "lora_enabled", False)
    return not lora and getattr(layer, "quantization_mode", None) is None


def rows(t, width):
    """``t`` as ``(rows, positions, width)``: the positions of each row (every axis but
    the first and the last) on one axis (either backend: a reshape, no arithmetic)."""
    if compat.keras_backend() == compat.SUPPORTED_BACKEND:
        import tensorflow as tf

        # The positions as a number when the static shape knows them (a batch of unknown
        # size, e.g. Poisson, included): the rules choose their method by it (a
        # convolution's ghost norms materialise A^T G rather than form T x T Grams).
        inner = t.shape[1:-1]
        positions = inner.num_elements() if inner.is_fully_defined() else -1
        return tf.reshape(t, [tf.shape(t)[0], positions, width])
    return compat.array_ops().reshape(t, (t.shape[0], -1, width))


class GhostRule:
    """Base class of a ghost rule: subclass it, define the required pieces
    (:meth:`linear`, :meth:`kernel_sq_norms`, :meth:`shift`) and override the optional
    ones where the defaults (a ``kernel`` attribute, a ``bias`` added along the last axis
    when ``use_bias``, the layer's ``activation``, no materialisation) do not fit. Module
    docstring: what each piece computes."""

    #: What :func:`ghost_rule` reports (``None``: the registered class's name, lower case).
    name: str | None = None

    def applies(self, layer) -> bool:
        """Does the rule cover this instance (e.g. only ``groups == 1``)? Else: fallback."""
        return True

    def kernel(self, layer) -> tf.Variable:
        """The variable ``W`` of the linear map."""
        return layer.kernel

    def bias(self, layer) -> tf.Variable | None:
        """The variable ``b`` added to ``f(A; W)``, or ``None``."""
        return layer.bias if getattr(layer, "use_bias", False) else None

    def bias_rows(self, layer, g):
        """``(b, p)``: row ``i``'s bias gradient ``sum_t G_it`` (bias along the last axis;
        either backend)."""
        return compat.array_ops().sum(rows(g, self.bias(layer).shape[-1]), axis=1)

    def activation(self, layer, z) -> tf.Tensor:
        """The layer's output from ``Z`` (elementwise, no variable)."""
        activation = getattr(layer, "activation", None)
        return z if activation is None else activation(z)

    def kernel_rows(self, layer, a, g) -> tf.Tensor | None:
        """``(b, *W.shape)``: the rows' kernel gradients, where materialising them is
        cheaper than the ghost norm; ``None``: use :meth:`kernel_sq_norms`."""
        return None

    def product_factors(self, layer, a, g):
        """Backend-neutral, optional: ``(A, G)``, ``(b, T, d)`` and ``(b, T, p)``, with row
        ``i``'s kernel gradient ``A_i^T G_i`` (module docstring); ``None``: the kernel
        gradient is not of that form (the JAX step does not cover the layer)."""
        return None

    def apply_kernel(self, layer, a, kernel):
        """Backend-neutral, optional with :meth:`product_factors`: ``f(A; W)`` for the
        kernel value ``kernel`` (no bias, no activation)."""
        raise NotImplementedError

    def linear(self, layer, a) -> tf.Tensor:
        """Required: ``Z = f(A; W) + b`` (module docstring)."""
        raise NotImplementedError

    def kernel_sq_norms(self, layer, a, g) -> tf.Tensor:
        """Required: ``(b,)`` float64 ``||grad_W,i||_F^2`` (module docstring)."""
        raise NotImplementedError

    def shift(self, layer, a_new, a, g, kernel_rows) -> tf.Tensor:
        """Required: ``f(a'_i; grad_W,i) + grad_b,i`` per row (module docstring)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Registration:
    """A rule as registered: for ``layer_class`` (and its subclasses that keep its
    ``call`` if ``subclasses``), reported as ``name``."""

    layer_class: type
    rule: GhostRule
    name: str
    subclasses: bool


_RULES: dict[type, Registration] = {}


def _check_layer_class(layer_class) -> None:
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(
            f"A ghost rule is registered for a Keras layer class (a subclass of "
            f"keras.layers.Layer), not {layer_class!r}."
        )


def _check_rule(layer_class, rule) -> None:
    if isinstance(rule, type) or not isinstance(rule, GhostRule):
        raise TypeError(
            f"The ghost rule for {layer_class.__name__} must be an instance of a GhostRule "
            f"subclass, not {rule!r}."
        )
    missing = [p for p in REQUIRED_PIECES if getattr(type(rule), p) is getattr(GhostRule, p)]
    if missing:
        raise TypeError(
            f"Ghost rule {type(rule).__name__} for {layer_class.__name__} lacks "
            f"{', '.join(missing)}: a rule defines {', '.join(REQUIRED_PIECES)}."
        )
    if rule.name is not None and (not isinstance(rule.name, str) or rule.name == FALLBACK):
        raise ValueError(
            f"Ghost rule {type(rule).__name__}'s name must be a string other than "
            f"{FALLBACK!r}, not {rule.name!r}."
        )


def register_ghost_rule(layer_class, rule, *, subclasses=False, replace=False) -> Registration:
    """Treat layers of ``layer_class`` by ``rule`` (a :class:`GhostRule` instance) in the
    ghost method; with ``subclasses``, also its subclasses that do not override ``call``
    (module docstring). A class has one rule: registering another one for it raises unless
    ``replace``. Returns the registration."""
    _check_layer_class(layer_class)
    _check_rule(layer_class, rule)
    if layer_class in _RULES and not replace:
        raise ValueError(
            f"{layer_class.__name__} already has ghost rule {_RULES[layer_class].name!r}: "
            "unregister_ghost_rule it first, or pass replace=True."
        )
    name = rule.name or layer_class.__name__.lower()
    _RULES[layer_class] = Registration(layer_class, rule, name, bool(subclasses))
    return _RULES[layer_class]


def unregister_ghost_rule(layer_class) -> Registration:
    """Remove the rule registered for exactly ``layer_class``; returns it. Its layers
    (and subclasses it covered) go to the vectorised fallback."""
    _check_layer_class(layer_class)
    if layer_class not in _RULES:
        raise KeyError(f"No ghost rule is registered for {layer_class.__name__}.")
    return _RULES.pop(layer_class)


@contextlib.contextmanager
def registered_ghost_rule(layer_class, rule, *, subclasses=False):
    """Within the block ``rule`` is ``layer_class``'s rule (replacing any); on exit the
    registry holds what it held before (that class's previous rule, or none)."""
    _check_layer_class(layer_class)
    saved = _RULES.get(layer_class)
    registration = register_ghost_rule(layer_class, rule, subclasses=subclasses, replace=True)
    try:
        yield registration
    finally:
        if saved is None:
            _RULES.pop(layer_class, None)
        else:
            _RULES[layer_class] = saved


def registered_rules() -> dict:
    """``{layer class: Registration}``: a copy of the registry."""
    return dict(_RULES)


def find_ghost_rule(layer) -> Registration | None:
    """The registration whose rule treats ``layer``, or ``None`` (the vectorised
    fallback): the nearest registered class in the MRO, if the layer's class is that
    class or, for a rule registered with ``subclasses``, keeps its ``call``; and if the
    rule :meth:`~GhostRule.applies` to the instance (module docstring)."""
    kind = type(layer)
    for cls in kind.__mro__:
        registration = _RULES.get(cls)
        if registration is None:
            continue
        inherited = cls is not kind
        if inherited and not (registration.subclasses and kind.call is cls.call):
            return None
        return registration if registration.rule.applies(layer) else None
    return None


def ghost_rule(layer) -> str:
    """How the ghost method treats ``layer``: the name of its rule (``"dense"``,
    ``"conv2d"``, ``"embedding"`` or a registered rule's) or ``"vectorized"`` (the
    fallback)."""
    registration = find_ghost_rule(layer)
    return FALLBACK if registration is None else registration.name


__all__ = [
    "FALLBACK",
    "GhostRule",
    "Registration",
    "find_ghost_rule",
    "ghost_rule",
    "register_ghost_rule",
    "registered_ghost_rule",
    "registered_rules",
    "rows",
    "stored_weights",
    "unregister_ghost_rule",
]
