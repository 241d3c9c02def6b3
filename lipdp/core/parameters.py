"""The parameters of a private training run, shared by both families.

:class:`DPParameters` (noise, delta, strategy, and the other releases a run declares
before training, rule S11) and :class:`DynamicClippingSpec` (what a dynamic-clipping
callback of :mod:`lipdp.clipless.dynamic` releases). Both are frozen, validated and
serialisable (:class:`lipdp.foundation.config.Config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lipdp.accounting.mechanisms import Laplace, Release, SubsampledGaussian, dynamic_clipping_label
from lipdp.accounting.tuning_cost import RandomSearch
from lipdp.core.noise import NOISIFY_STRATEGIES
from lipdp.foundation import validation
from lipdp.foundation.config import Config

__all__ = ["DPParameters", "DynamicClippingSpec"]


@dataclass(frozen=True)
class DynamicClippingSpec(Config):
    """What a dynamic-clipping callback releases, declared before training (rule S11).

    A DP model with ``DP_ClipGradient(mode="dynamic")`` layers must declare it, in
    ``DPParameters(..., dynamic_clipping=...)`` (a callback of this module, its ``spec``,
    or this object), so that every plan -- ``get_eps_delta``, ``get_max_epochs``,
    calibration, the accountant, the report -- composes the clipping releases; the
    callback refuses to run on a model that declared something else.

    Attributes:
        mode: ``"laplace"`` (:class:`LaplaceAdaptiveLossGradientClipping`) or
            ``"quantiles"`` (:class:`AdaptiveQuantileClipping`).
        patience: one round of updates every ``patience`` epochs.
        epsilon: cost of one Laplace release (``"laplace"``).
        noise_multiplier: multiplier of one Gaussian count (``"quantiles"``).
        sampling_rate: Poisson rate of the counts (``"quantiles"``; ``None``: the training
            rate ``b / N``).
        steps_per_update: releases per layer per round (``"quantiles"``).
    """

    mode: str
    patience: int = 1
    epsilon: float | None = None
    noise_multiplier: float | None = None
    sampling_rate: float | None = None
    steps_per_update: int = 1

    def __post_init__(self):
        validation.choice("dynamic clipping mode", self.mode, ("laplace", "quantiles"))
        self._set("patience", validation.count("`patience`", self.patience, 1))
        steps = validation.count("`steps_per_update`", self.steps_per_update, 1)
        self._set("steps_per_update", steps)
        if self.mode == "laplace":
            self._set("epsilon", validation.positive("`epsilon`", self.epsilon))
        else:
            sigma = validation.positive("`noise_multiplier`", self.noise_multiplier)
            self._set("noise_multiplier", sigma)
            if self.sampling_rate is not None:
                rate = validation.probability("`sampling_rate`", self.sampling_rate)
                self._set("sampling_rate", rate)

    @classmethod
    def coerce(cls, value) -> DynamicClippingSpec | None:
        """``None``, a spec, its config dict, or anything with a ``spec`` (a callback)."""
        spec = getattr(value, "spec", None)
        if isinstance(spec, cls):
            return spec
        if value is None or isinstance(value, (cls, dict)):
            return super().coerce(value)
        raise TypeError(
            "dynamic_clipping must be None, a dynamic clipping callback of "
            "lipdp.clipless.dynamic or a "
            f"DynamicClippingSpec, got {value!r}."
        )

    def release(self, nb_layers: int, training_sampling_rate: float) -> Release:
        """The releases of a model with ``nb_layers`` dynamic clip layers."""
        per_round = validation.count("nb_layers", nb_layers, 1) * self.steps_per_update
        if self.mode == "laplace":
            mechanism = Laplace(self.epsilon)
        else:
            rate = training_sampling_rate if self.sampling_rate is None else self.sampling_rate
            mechanism = SubsampledGaussian(self.noise_multiplier, rate)
        label = dynamic_clipping_label(self.mode)
        return Release(mechanism, label, per_round=per_round, patience=self.patience)


@dataclass(frozen=True)
class DPParameters(Config):
    """Privacy parameters of a training run.

    Attributes:
        noisify_strategy: ``"global"`` or ``"per-layer"``.
        noise_multiplier: ``sigma > 0``; noise std = sigma x sensitivity.
        delta: target ``delta`` in ``(0, 1)`` of the ``(epsilon, delta)`` guarantee.
        non_private: ``True`` only for a reference run without noise
            (``noise_multiplier`` must then be 0): same network, same projections,
            no privacy.
        dynamic_clipping: the dynamic-clipping updates the run releases, declared before
            training so that every privacy plan counts them (rule S11): a callback of
            :mod:`lipdp.clipless.dynamic` (e.g. ``LaplaceAdaptiveLossGradientClipping(ds, epsilon=
            0.5)``), its ``spec``, or ``None`` (no ``DP_ClipGradient(mode="dynamic")``).
        hyperparameter_search: the :class:`~lipdp.accounting.tuning_cost.RandomSearch` this run
            was selected by (a random number of runs, the best kept; every run with these
            parameters or fewer steps): its epsilon includes the search (RDP accountant).
            ``None`` (default): the run alone (a search on the same data is then not
            accounted for).

    Immutable (the model, its plan and its training step read the same values); use
    ``dataclasses.replace`` for a variant.
    """

    noisify_strategy: str
    noise_multiplier: float
    delta: float
    non_private: bool = False
    dynamic_clipping: DynamicClippingSpec | None = None
    hyperparameter_search: RandomSearch | None = None

    def __post_init__(self):
        validation.choice("noisify_strategy", self.noisify_strategy, NOISIFY_STRATEGIES)
        self._set("dynamic_clipping", DynamicClippingSpec.coerce(self.dynamic_clipping))
        self._set("hyperparameter_search", RandomSearch.coerce(self.hyperparameter_search))
        sigma = validation.non_negative("noise_multiplier", self.noise_multiplier)
        self._set("noise_multiplier", sigma)
        self._set("non_private", bool(self.non_private))
        if self.non_private:
            if self.noise_multiplier != 0:
                raise ValueError(
                    "non_private=True is for a noiseless reference: set noise_multiplier=0."
                )
        elif not self.noise_multiplier > 0:
            raise ValueError(
                f"noise_multiplier must be > 0, got {self.noise_multiplier}. For a "
                "non-private reference run pass non_private=True and noise_multiplier=0."
            )
        self._set("delta", validation.delta(self.delta))
