r"""The mechanisms a training run releases, as values the accountants understand.

A mechanism is a frozen (hashable) description; every accountant maps it to its own
object in *one* place, here: :meth:`autodp` (autodp's RDP), :meth:`dp_event`
(``dp_accounting`` events) and :meth:`pld` (privacy loss distributions).

* :class:`SubsampledGaussian` ``(sigma, q)``: a Gaussian mechanism with noise multiplier
  ``sigma`` (noise standard deviation / L2 sensitivity) on a Poisson subsample of rate
  ``q`` (``q = 1``: the whole data set). One noisy gradient step is this mechanism with
  ``q = b / N`` (the ``"per-layer"`` strategy's ``K`` Gaussians on disjoint coordinates
  compose into one Gaussian with ``sigma_eff = (sum_k sigma_k^-2)^(-1/2)``,
  :func:`effective_noise_multiplier`).
* :class:`Laplace` ``(epsilon)``: a Laplace mechanism with ``scale / L1 sensitivity =
  1 / epsilon`` (pure ``epsilon``-DP). The RDP path composes it as a generic
  ``epsilon``-DP mechanism (autodp's ``PureDP_Mechanism``, valid for *any* ``epsilon``-DP
  mechanism, as the original package did); the PLD path uses the Laplace privacy loss
  itself, valid because the releases of :mod:`lipdp.clipless.dynamic` *are* Laplace mechanisms on
  queries of L1 sensitivity 1 after normalisation.

A :class:`Release` says how many times a mechanism runs as a function of the number of
epochs (gradient steps every step, clipping updates every ``patience`` epochs).
Neighbouring relation everywhere: add/remove one example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lipdp.foundation import validation
from lipdp.foundation.config import Config

DYNAMIC_MODES = ("laplace", "quantiles")


def effective_noise_multiplier(noise_multipliers) -> float:
    """``(sum_k sigma_k^-2)^(-1/2)``: ``K`` Gaussian mechanisms on disjoint coordinates as
    one (the arithmetic of autodp's ``ComposeGaussian``). A single value is returned
    unchanged."""
    sigmas = noise_multiplier_list(noise_multipliers)
    if len(sigmas) == 1:
        return sigmas[0]
    return math.sqrt(1.0 / sum(sigma**-2 for sigma in sigmas))


def noise_multiplier_list(noise_multipliers) -> list[float]:
    """A number or a sequence of numbers ``> 0`` as a list of floats."""
    if isinstance(noise_multipliers, (list, tuple, np.ndarray)):
        sigmas = list(np.asarray(noise_multipliers, dtype=object).ravel())
    else:
        sigmas = [noise_multipliers]
    if not sigmas:
        raise ValueError("noise_multipliers is empty: at least one Gaussian mechanism is needed.")
    return [validation.positive("each noise multiplier", s) for s in sigmas]


@dataclass(frozen=True)
class SubsampledGaussian(Config):
    """Gaussian mechanism (``noise_multiplier``) on a Poisson subsample (``sampling_rate``)."""

    noise_multiplier: float
    sampling_rate: float = 1.0

    def __post_init__(self):
        sigma = validation.positive("noise_multiplier", self.noise_multiplier)
        rate = validation.probability("sampling_rate", self.sampling_rate)
        self._set("noise_multiplier", sigma)
        self._set("sampling_rate", rate)

    def autodp(self):
        """autodp: ``AmplificationBySampling(PoissonSampling=True)`` of a Gaussian, with the
        tight bound for Gaussians (``improved_bound_flag=True``)."""
        from autodp import mechanism_zoo

        return subsample_autodp(mechanism_zoo.GaussianMechanism(sigma=self.noise_multiplier), self)

    def dp_event(self):
        from dp_accounting import dp_event

        gaussian = dp_event.GaussianDpEvent(self.noise_multiplier)
        return dp_event.PoissonSampledDpEvent(self.sampling_rate, gaussian)

    def pld(self, value_discretization_interval: float):
        from dp_accounting.pld import privacy_loss_distribution as pld

        return pld.from_gaussian_mechanism(
            standard_deviation=self.noise_multiplier,
            sampling_prob=self.sampling_rate,
            value_discretization_interval=value_discretization_interval,
        )

    def describe(self) -> str:
        return (
            f"Gaussian (noise multiplier {self.noise_multiplier:.4g}), "
            f"Poisson rate {self.sampling_rate:.4g}"
        )


@dataclass(frozen=True)
class Laplace(Config):
    """Pure ``epsilon``-DP Laplace mechanism (``scale / sensitivity = 1 / epsilon``)."""

    epsilon: float

    def __post_init__(self):
        self._set("epsilon", validation.positive("epsilon", self.epsilon))

    def autodp(self):
        from autodp import mechanism_zoo

        return mechanism_zoo.PureDP_Mechanism(eps=self.epsilon, name="Laplace")

    def dp_event(self):
        from dp_accounting import dp_event

        return dp_event.LaplaceDpEvent(1.0 / self.epsilon)

    def pld(self, value_discretization_interval: float):
        from dp_accounting.pld import privacy_loss_distribution as pld

        return pld.from_laplace_mechanism(
            parameter=1.0 / self.epsilon,
            value_discretization_interval=value_discretization_interval,
        )

    def describe(self) -> str:
        return f"Laplace ({self.epsilon:.4g}-DP)"


def subsample_autodp(base, gaussian: SubsampledGaussian):
    """autodp's Poisson-subsampled version of ``base`` at the rate of ``gaussian``."""
    from autodp import transformer_zoo

    # rate 1: autodp takes log(1 - rate) = -inf on the way (harmless).
    with np.errstate(divide="ignore", invalid="ignore"):
        return transformer_zoo.AmplificationBySampling(PoissonSampling=True)(
            base, gaussian.sampling_rate, improved_bound_flag=True
        )


@dataclass(frozen=True)
class Release(Config):
    """A mechanism run ``count(epochs)`` times in a training run of ``epochs`` epochs:

    ``epochs * per_epoch + (epochs // patience) * per_round + fixed``.

    Gradient steps are ``per_epoch`` releases; dynamic clipping updates are ``per_round``
    releases every ``patience`` epochs; ``fixed`` is for a count given once and for all
    (the legacy ``{"num_updates": n}`` configurations).
    """

    mechanism: SubsampledGaussian | Laplace
    label: str
    per_epoch: int = 0
    per_round: int = 0
    patience: int = 1
    fixed: int = 0

    def __post_init__(self):
        for name in ("per_epoch", "per_round", "fixed"):
            self._set(name, validation.count(name, getattr(self, name)))
        self._set("patience", validation.count("patience", self.patience, 1))

    def count(self, epochs: int) -> int:
        epochs = validation.count("epochs", epochs)
        return epochs * self.per_epoch + (epochs // self.patience) * self.per_round + self.fixed


def dynamic_clipping_label(mode: str) -> str:
    """The label of the releases of a dynamic clipping mode (plans, ledgers, reports)."""
    return f"dynamic clipping ({mode})"


def release_from_config(config, sampling_rate) -> Release | None:
    """The legacy dynamic-clipping dict as a :class:`Release` with a fixed count.

    ``{"mode": "laplace", "epsilon": e, "num_updates": n}`` or ``{"mode": "quantiles",
    "noise_multiplier": s, "num_updates": n, "sampling_rate": q}`` (``q`` defaults to
    ``sampling_rate``, the training rate); ``None``, ``{"mode": "fixed"}`` and
    ``num_updates = 0`` mean no release.
    """
    if config is None:
        return None
    if not isinstance(config, dict) or "mode" not in config:
        raise ValueError(
            "dynamic_clipping must be None or a dict with a 'mode' key "
            f"({DYNAMIC_MODES}), got {config!r}."
        )
    mode = config["mode"]
    if mode in (None, "fixed"):
        return None
    validation.choice("dynamic_clipping['mode']", mode, DYNAMIC_MODES)
    if "num_updates" not in config:
        raise ValueError(f"dynamic_clipping config {config!r} has no 'num_updates'.")
    updates = validation.count("dynamic_clipping['num_updates']", config["num_updates"])
    if mode == "laplace":
        if "epsilon" not in config:
            raise ValueError(f"laplace dynamic_clipping config {config!r} has no 'epsilon'.")
        mechanism = Laplace(config["epsilon"])
    else:
        if "noise_multiplier" not in config:
            raise ValueError(
                f"quantiles dynamic_clipping config {config!r} has no 'noise_multiplier'."
            )
        rate = config.get("sampling_rate", sampling_rate)
        mechanism = SubsampledGaussian(config["noise_multiplier"], rate)
    if updates == 0:
        return None
    return Release(mechanism, dynamic_clipping_label(mode), fixed=updates)


__all__ = [
    "DYNAMIC_MODES",
    "Laplace",
    "Release",
    "SubsampledGaussian",
    "dynamic_clipping_label",
    "effective_noise_multiplier",
    "noise_multiplier_list",
    "release_from_config",
]
