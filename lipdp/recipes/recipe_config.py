"""The configuration of a run of ``lipdp train`` / ``lipdp evaluate`` without the command
line: two frozen, validated configurations (:class:`lipdp.foundation.config.Config`:
``to_config`` / ``from_config`` round-trip through plain dicts).

* :class:`ModelRecipe`, everything the compiled model reads: the data set (its public input
  bound :data:`~lipdp.recipes.defaults.INPUT_BOUNDS`), the method, the privacy parameters,
  the network's options, the optimiser, clipping and adversarial training;
* :class:`RunConfig`, a model recipe and the run around it: the budget ``epsilon``, the
  epochs, the accountant, weight averaging, the seed and where the data lives.

Every field is named after the ``lipdp train`` option of the same name (``--clip-norm`` is
``clip_norm``) and has its default; ``None`` for ``batch_size``, ``noise_multiplier``,
``learning_rate``, ``optimizer``, ``momentum``, ``weight_norm_bound``, ``scattering``,
``gradient_clip`` and ``tau`` means the default of the data set and the network for the
method (:data:`~lipdp.recipes.defaults.DEFAULTS`,
:data:`~lipdp.recipes.defaults.CLIPLESS_DEFAULTS`; :meth:`ModelRecipe.resolved`).
A setting that the recipe's network would not read is refused in one line when it differs
from its default (``clip_norm=2`` with ``method="lipdp"``), with the message of the
command line (:mod:`lipdp.recipes.method_settings` decides, once, which setting applies to
which method): a recipe never silently drops a choice.

The compiled model of a recipe is :mod:`lipdp.recipes.model_factory`'s, its training
:mod:`lipdp.recipes.runs`'. This module imports no TensorFlow: the command line validates
its arguments and answers ``--help`` without it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lipdp.foundation import validation
from lipdp.foundation.config import Config
from lipdp.recipes import defaults as D
from lipdp.recipes import method_settings


def _optional(check, name, value):
    """``check(name, value)`` unless ``value`` is ``None`` (the setting is off)."""
    return None if value is None else check(name, value)


def _positive_count(name, value) -> int:
    return validation.count(name, value, 1)


def _decay(name, value) -> float:
    """A number in ``[0, 1)``: a momentum or an averaging decay."""
    return validation.real(name, value, low=0.0, high=1.0, low_open=False)


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelRecipe(Config):
    """The compiled model of a run (module docstring; each field is the ``lipdp train``
    option of the same name).

    Attributes:
        dataset: one of :data:`~lipdp.recipes.defaults.DATASETS`.
        method: ``"lipdp"``, ``"lip-dp-sgd"`` or ``"dp-sgd"``
            (:data:`~lipdp.recipes.defaults.METHODS`).
        batch_size: expected batch size ``b``; ``None``: the data set's default.
        physical_batch_size: compute each step at most this many rows at a time, the
            logical batch of ``batch_size`` noised once (memory of the step, not its
            privacy); ``None``: whole batches.
        noise_multiplier: ``sigma > 0``; ``None``: the data set's default.
        delta: the ``delta`` of the guarantee, in ``(0, 1)``.
        strategy: ``"global"`` (one Gaussian mechanism) or ``"per-layer"``.
        sampling: ``"poisson"`` (batches of rate ``b / N``, what the accountant analyses) or
            ``"shuffle"`` (fixed-size batches; the remainder is dropped, rule S5).
        non_private: a noiseless reference (``noise_multiplier`` must then be unset).
        learning_rate: step of the optimiser; ``None``: the default of the network
            (clipless, :func:`~lipdp.recipes.defaults.clipless_defaults`; an SGD network's
            rate is not Adam's: give one with ``optimizer="adam"``) or of the data set
            (dp-sgd).
        optimizer: ``"adam"`` or ``"sgd"``; ``momentum`` in ``[0, 1)`` (SGD only); ``None``:
            the network's default (clipless), Adam (dp-sgd); momentum: the network's with
            its own optimiser, else 0.
        weight_norm_bound: ``C``, the radius of every kernel's ball (clipless methods);
            ``None``: the network's default.
        group_norm, group_norm_alpha: groups and ``alpha`` of a group normalisation after
            each hidden layer (clipless; with ``scattering``, the groups of its
            normalisation, whose alpha is fixed).
        scattering: a scattering front-end (images only); ``None``: the data set's default
            for the method (:func:`~lipdp.recipes.defaults.default_scattering`).
        gradient_clip: clip each example's logit gradient at this norm (clipless); ``None``:
            the network's default (:data:`~lipdp.recipes.defaults.CLIPLESS_DEFAULTS`),
            ``math.inf``: no clipping.
        tau: temperature of the clipless loss ``DP_TauCategoricalCrossentropy(tau)``;
            ``None``: the network's default.
        clipping, clip_norm, clip_threshold, gradient_method, bam, dp_sat: clipped DP-SGD's
            per-example clipping (:class:`lipdp.clipped.model.Clipping`), its gradient
            norms and its ascent step (:class:`lipdp.clipped.model.SharpnessAscent`).
        adversarial_radius, adversarial_norm, adversarial_steps, adversarial_mix, trades:
            PGD adversarial training (:class:`lipdp.core.adversarial.PGD`), off when the
            radius is ``None``.
    """

    argument_name = "model"
    optional = False

    dataset: str = "digits"
    method: str = "lipdp"
    batch_size: int | None = None
    physical_batch_size: int | None = None
    noise_multiplier: float | None = None
    delta: float = 1e-5
    strategy: str = "global"
    sampling: str = "poisson"
    non_private: bool = False
    learning_rate: float | None = None
    optimizer: str | None = None
    momentum: float | None = None
    weight_norm_bound: float | None = None
    group_norm: int | None = None
    group_norm_alpha: float = 1.0
    scattering: bool | None = None
    gradient_clip: float | None = None
    tau: float | None = None
    clipping: str = "flat"
    clip_norm: float = 1.0
    clip_threshold: float | None = None
    gradient_method: str = "ghost"
    bam: float | None = None
    dp_sat: float | None = None
    adversarial_radius: float | None = None
    adversarial_norm: str = "l2"
    adversarial_steps: int = 10
    adversarial_mix: float = 1.0
    trades: float | None = None

    def __post_init__(self):
        self._check_choices()
        self._check_numbers()
        self._check_adversarial_numbers()
        self._check_combinations()
        _refuse_unused_settings(self)

    def _check_choices(self):
        validation.choice("dataset", self.dataset, D.DATASETS)
        validation.choice("method", self.method, D.METHODS)
        validation.choice("strategy", self.strategy, D.NOISE_STRATEGIES)
        validation.choice("sampling", self.sampling, D.SAMPLINGS)
        if self.optimizer is not None:
            validation.choice("optimizer", self.optimizer, D.OPTIMIZERS)
        validation.choice("clipping", self.clipping, D.CLIPPING_MODES)
        validation.choice("gradient_method", self.gradient_method, D.GRADIENT_METHODS)
        validation.choice("adversarial_norm", self.adversarial_norm, D.ADVERSARIAL_NORMS)
        self._set("non_private", bool(self.non_private))
        if self.scattering is not None:
            self._set("scattering", bool(self.scattering))

    def _check_numbers(self):
        self._set("batch_size", _optional(_positive_count, "batch_size", self.batch_size))
        physical = _optional(_positive_count, "physical_batch_size", self.physical_batch_size)
        self._set("physical_batch_size", physical)
        sigma = _optional(validation.positive, "noise_multiplier", self.noise_multiplier)
        self._set("noise_multiplier", sigma)
        self._set("delta", validation.delta(self.delta))
        rate = _optional(validation.positive, "learning_rate", self.learning_rate)
        self._set("learning_rate", rate)
        self._set("momentum", _optional(_decay, "momentum", self.momentum))
        bound = _optional(validation.positive, "weight_norm_bound", self.weight_norm_bound)
        self._set("weight_norm_bound", bound)
        self._set("group_norm", _optional(_positive_count, "group_norm", self.group_norm))
        self._set(
            "group_norm_alpha", validation.positive("group_norm_alpha", self.group_norm_alpha)
        )
        if self.gradient_clip != math.inf:  # math.inf: no clipping (off, not a bound)
            clip = _optional(validation.positive, "gradient_clip", self.gradient_clip)
            self._set("gradient_clip", clip)
        self._set("tau", _optional(validation.positive, "tau", self.tau))
        self._set("clip_norm", validation.positive("clip_norm", self.clip_norm))
        threshold = _optional(validation.positive, "clip_threshold", self.clip_threshold)
        self._set("clip_threshold", threshold)
        self._set("bam", _optional(validation.positive, "bam", self.bam))
        self._set("dp_sat", _optional(validation.positive, "dp_sat", self.dp_sat))

    def _check_adversarial_numbers(self):
        radius = _optional(validation.positive, "adversarial_radius", self.adversarial_radius)
        self._set("adversarial_radius", radius)
        self._set("adversarial_steps", _positive_count("adversarial_steps", self.adversarial_steps))
        mix = validation.real(
            "adversarial_mix", self.adversarial_mix, low=0.0, high=1.0, high_open=False
        )
        self._set("adversarial_mix", mix)
        self._set("trades", _optional(validation.positive, "trades", self.trades))

    def _check_combinations(self):
        if self.scattering and self.dataset not in D.IMAGE_DATASETS:
            raise ValueError(f"scattering needs images; {self.dataset} is tabular.")
        if self.non_private and self.noise_multiplier is not None:
            raise ValueError(
                "non_private=True is a noiseless reference: leave noise_multiplier unset."
            )
        if self.bam is not None and self.dp_sat is not None:
            raise ValueError("bam and dp_sat are two ascent steps: give one of them.")
        needs_threshold = self.method == "dp-sgd" and self.clipping == "global"
        if needs_threshold and self.clip_threshold is None:
            raise ValueError(
                "clipping='global' needs clip_threshold=Z (the norm above which an example's "
                "gradient is dropped)."
            )

    def resolved(self) -> ModelRecipe:
        """This recipe with the defaults in place of ``None``: the network (scattering or
        not), the batch size, the noise multiplier (still ``None`` for a non-private
        reference, whose noise is 0), the optimiser, its learning rate and momentum and,
        for the clipless methods, the kernels' radius, the logit-gradient clip and the
        temperature (:func:`~lipdp.recipes.defaults.clipless_defaults` of the network,
        then the data set's :data:`~lipdp.recipes.defaults.DEFAULTS`). Idempotent."""
        scattering = method_settings.scattering(self)
        if self.method == "dp-sgd":
            default = D.DEFAULTS[self.dataset]
            return self._filled(scattering, default, "adam", 0.0, default.learning_rate)
        net = D.clipless_defaults(self.dataset, scattering)
        clip = net.gradient_clip if self.gradient_clip is None else self.gradient_clip
        own = self.optimizer in (None, net.optimizer)
        # An SGD rate scales the (tiny) clipped gradients; Adam's step ignores their scale,
        # so the published SGD rate of 16 would be a step of 16 per coordinate: refused.
        # (An Adam network's rate has always served SGD as well.)
        if self.learning_rate is None and net.optimizer == "sgd" and not own:
            raise ValueError(
                f"learning_rate: the default {net.learning_rate:g} is for optimizer "
                f"{net.optimizer!r} of this network on {self.dataset}; give learning_rate "
                f"with optimizer={self.optimizer!r}."
            )
        filled = self._filled(
            scattering, net, net.optimizer, net.momentum if own else 0.0, net.learning_rate
        )
        bound = self.weight_norm_bound or net.weight_norm_bound
        return dataclasses.replace(
            filled, weight_norm_bound=bound, gradient_clip=clip, tau=self.tau or net.tau
        )

    def _filled(self, scattering, default, optimizer, momentum, learning_rate) -> ModelRecipe:
        """The settings both families resolve: ``default`` holds ``batch_size`` and
        ``noise_multiplier`` (``None``: the data set's)."""
        dataset = D.DEFAULTS[self.dataset]
        sigma = self.noise_multiplier or default.noise_multiplier or dataset.noise_multiplier
        optimizer = self.optimizer or optimizer
        sgd = optimizer == "sgd"
        return dataclasses.replace(
            self,
            scattering=scattering,
            batch_size=self.batch_size or default.batch_size or dataset.batch_size,
            noise_multiplier=None if self.non_private else sigma,
            optimizer=optimizer,
            momentum=(momentum if self.momentum is None else self.momentum) if sgd else None,
            learning_rate=self.learning_rate or learning_rate,
        )


def _refuse_unused_settings(recipe) -> None:
    """The first setting of ``recipe`` that differs from its default and that the recipe's
    network would not read (:func:`lipdp.recipes.method_settings.inapplicable_settings`)."""
    defaults = {f.name: f.default for f in dataclasses.fields(recipe)}
    for name, message in method_settings.inapplicable_settings(recipe).items():
        if getattr(recipe, name) != defaults[name]:
            raise ValueError(message)


# ----------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class RunConfig(Config):
    """A training run: a :class:`ModelRecipe` and what the training loop reads.

    Attributes:
        model: the :class:`ModelRecipe` (or its config dict).
        epsilon: the budget; training stops before exceeding it (``DP_Accountant``).
        epochs: ``None``: the most epochs within the budget (``get_max_epochs``).
        accountant: ``"rdp"``, ``"pld"`` or ``"gdp"`` (the last is an approximation).
        averaging: decay of an exponential moving average of the weights, evaluated at
            the end (post-processing); ``None``: none.
        seed: the seed of the initial weights (Python, NumPy and TensorFlow); the noise and
            the Poisson batches draw from the operating system's entropy regardless.
        data_dir: ``fashion_mnist`` only: the directory of its IDX files.
        cache_features: a network that opens with a fixed front-end (the scattering
            transform and its per-example normalisation: no weights, no statistic of the
            data) trains its head on the front-end's outputs, computed once, instead of
            recomputing them at every step (:func:`fit`); the same mechanism, the same
            model. Not with adversarial training (its attack needs the whole network).
    """

    argument_name = "run"
    optional = False

    model: ModelRecipe = field(default_factory=ModelRecipe)
    epsilon: float = 3.0
    epochs: int | None = None
    accountant: str = "rdp"
    averaging: float | None = None
    seed: int = 0
    data_dir: str | None = None
    cache_features: bool = True

    def __post_init__(self):
        self._set("model", ModelRecipe.coerce(self.model))
        self._set("epsilon", validation.positive("epsilon", self.epsilon))
        self._set("epochs", _optional(_positive_count, "epochs", self.epochs))
        validation.choice("accountant", self.accountant, D.ACCOUNTANTS)
        self._set("averaging", _optional(_decay, "averaging", self.averaging))
        self._set("seed", validation.count("seed", self.seed, 0))
        self._set("cache_features", bool(self.cache_features))
        if self.data_dir is not None and self.model.dataset != "fashion_mnist":
            raise ValueError(
                f"data_dir applies to dataset='fashion_mnist' only ({self.model.dataset} is "
                "bundled)."
            )


__all__ = ["ModelRecipe", "RunConfig"]
