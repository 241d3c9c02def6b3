"""Which setting of a run applies to which method, decided once: the recipes
(:class:`~lipdp.recipes.recipe_config.ModelRecipe`) and the command line
(:mod:`lipdp.cli.arguments`) refuse a setting the run's network would not read with the
same one-line message, from :func:`inapplicable_settings`.

Two tables:

* :data:`METHOD_SCOPES`, setting -> the methods whose network reads it (the settings of
  one family: clipped DP-SGD's clipping and ascent steps, the clipless networks' kernel
  balls, logit-gradient clip, temperature and group normalisation). A setting not in it
  applies to every method.
* :data:`CONDITIONS`, the settings that need another setting whatever the method
  (``clip_threshold`` needs ``clipping="global"``, ``momentum`` needs SGD, the adversarial
  options need ``adversarial_radius``, ...).

A run is read through the fields both interfaces share (``dataset``, ``method``,
``scattering``, ``optimizer``, ``clipping``, ``group_norm``, ``adversarial_radius``,
``trades``): a :class:`~lipdp.recipes.recipe_config.ModelRecipe` or the ``argparse``
namespace of ``lipdp train`` (each option's ``dest`` is the recipe field it sets).
A message names the setting by its field and its option (``clip_norm (--clip-norm)``), so
that it reads the same from either interface. This module imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from lipdp.recipes import defaults as D

#: The clipless methods (Lipschitz networks, sensitivities from their bounds).
CLIPLESS = ("lipdp", "lip-dp-sgd")
#: The clipped method (per-example clipping).
CLIPPED = ("dp-sgd",)


class Scope(NamedTuple):
    """The methods whose network reads a setting.

    Attributes:
        methods: the methods whose plain network (CNN or MLP) reads it.
        why: what the other methods' plain networks do instead (the parenthesis of the
            refusal); ``{method}`` is replaced by the run's method.
        scattering: the methods whose scattering network reads it; ``None``: ``methods``.
        why_scattering: why the scattering network does not read it (``scattering``
            given and not every method's).
    """

    methods: tuple
    why: str
    scattering: tuple | None = None
    why_scattering: str = ""

    def reads(self, method: str, scattering: bool) -> bool:
        """Whether the network of ``method`` (with ``scattering`` or not) reads it."""
        on_scattering = self.methods if self.scattering is None else self.scattering
        return method in (on_scattering if scattering else self.methods)


_NO_CLIPPING = (
    "method {method} clips no gradient: its sensitivities come from the layers' Lipschitz bounds"
)
_NO_ASCENT = "the clipless methods have no sharpness-aware step"
_NO_GROUP_NORM = "dp-sgd's plain network has no group normalisation"

#: Setting -> the methods whose network reads it (the others refuse it). Settings not
#: listed apply to every method.
METHOD_SCOPES = {
    "clipping": Scope(CLIPPED, _NO_CLIPPING),
    "clip_norm": Scope(CLIPPED, _NO_CLIPPING),
    "clip_threshold": Scope(CLIPPED, _NO_CLIPPING),
    "gradient_method": Scope(CLIPPED, _NO_CLIPPING),
    "bam": Scope(CLIPPED, _NO_ASCENT),
    "dp_sat": Scope(CLIPPED, _NO_ASCENT),
    "trades": Scope(
        CLIPPED,
        "the gradient of the TRADES KL term with respect to the clean logits has no bound "
        "in a clipless network",
    ),
    "gradient_clip": Scope(
        CLIPLESS, "dp-sgd clips each example's parameter gradient at clip_norm instead"
    ),
    "tau": Scope(
        CLIPLESS,
        "the temperature of the clipless loss DP_TauCategoricalCrossentropy; dp-sgd trains "
        "with the cross-entropy of the logits",
    ),
    "weight_norm_bound": Scope(
        CLIPLESS,
        "dp-sgd's layers have unconstrained kernels; their gradients are clipped at clip_norm",
    ),
    # The scattering network of every method has a group normalisation, of a fixed alpha.
    "group_norm": Scope(CLIPLESS, _NO_GROUP_NORM, scattering=D.METHODS),
    "group_norm_alpha": Scope(
        CLIPLESS,
        _NO_GROUP_NORM,
        scattering=(),
        why_scattering="its group normalisation has its own alpha, "
        "lipdp.recipes.zoo.SCATTERING_ALPHA",
    ),
}


class Condition(NamedTuple):
    """Settings that apply only when ``holds(run)``; ``message`` completes the refusal
    after the setting's name (``{clipping}`` is replaced by the run's clipping)."""

    settings: tuple
    holds: Callable
    message: str


#: The settings that need another setting, whatever the method (checked after
#: :data:`METHOD_SCOPES`; the first that fails gives the message).
CONDITIONS = (
    Condition(
        ("clip_threshold",),
        lambda run: run.clipping == "global",
        "applies to clipping global only ({clipping} clipping drops no example): drop it or "
        "set clipping global",
    ),
    Condition(
        ("group_norm_alpha",),
        lambda run: run.group_norm is not None,
        "needs group_norm (without it the network has no group normalisation): set "
        "group_norm or drop it",
    ),
    Condition(
        ("momentum",),
        lambda run: optimizer(run) == "sgd",
        "applies to optimizer sgd only (Adam keeps its own moment estimates): drop it or set "
        "optimizer sgd",
    ),
    Condition(
        ("adversarial_norm", "adversarial_steps", "adversarial_mix", "trades"),
        lambda run: run.adversarial_radius is not None,
        "needs adversarial_radius (the ball of its attack; without it there is no "
        "adversarial training): set adversarial_radius or drop it",
    ),
    Condition(
        ("adversarial_mix",),
        lambda run: run.trades is None,
        "does not apply with trades (the TRADES loss replaces the mixed loss): drop one of them",
    ),
)


def scattering(run) -> bool:
    """The run's ``scattering``, or its data set's default for its method."""
    if run.scattering is not None:
        return bool(run.scattering)
    return D.default_scattering(run.dataset, run.method)


def optimizer(run) -> str:
    """The run's optimiser, or its network's default (Adam for dp-sgd)."""
    return run.optimizer or D.default_optimizer(run.dataset, run.method, scattering(run))


def label(setting: str) -> str:
    """``"clip_norm (--clip-norm)"``: the setting as both interfaces name it."""
    return f"{setting} (--{setting.replace('_', '-')})"


def _methods_text(methods) -> str:
    if tuple(methods) == CLIPLESS:
        return "the clipless methods (lipdp, lip-dp-sgd)"
    return "method " + " or ".join(methods)


def _scope_message(setting: str, scope: Scope, method: str, on_scattering: bool) -> str:
    """The refusal of ``setting`` by the network of ``method`` (``on_scattering``)."""
    if on_scattering and scope.scattering is not None:
        return (
            f"{label(setting)} does not apply to the scattering network "
            f"({scope.why_scattering}): drop it."
        )
    why = scope.why.format(method=method)
    if method in (scope.scattering or ()):  # its scattering network reads it
        return (
            f"{label(setting)} applies to {_methods_text(scope.methods)} and to the scattering "
            f"network only ({why}): drop it or set scattering."
        )
    return (
        f"{label(setting)} applies to {_methods_text(scope.methods)} only ({why}): drop it or "
        f"set method {' or '.join(scope.methods)}."
    )


def inapplicable_settings(run) -> dict:
    """``{setting: one-line message}`` for every setting the network of ``run`` does not
    read (whether set or not: the caller refuses the ones the user chose), in the order of
    :data:`METHOD_SCOPES` then :data:`CONDITIONS`; a setting refused twice keeps its first
    message."""
    on_scattering = scattering(run)
    refusals = {}
    for setting, scope in METHOD_SCOPES.items():
        if not scope.reads(run.method, on_scattering):
            refusals[setting] = _scope_message(setting, scope, run.method, on_scattering)
    for condition in CONDITIONS:
        if condition.holds(run):
            continue
        text = condition.message.format(clipping=run.clipping)
        for setting in condition.settings:
            refusals.setdefault(setting, f"{label(setting)} {text}.")
    return refusals


__all__ = [
    "CLIPLESS",
    "CLIPPED",
    "CONDITIONS",
    "METHOD_SCOPES",
    "Condition",
    "Scope",
    "inapplicable_settings",
    "label",
    "optimizer",
    "scattering",
]
