r"""The Gaussian-DP (mu-GDP) central-limit accountant of Bu, Dong, Long & Su (2020), the one
Bu et al. use for global clipping. **An approximation, not an upper bound.**

For ``T`` steps of a Gaussian mechanism of multiplier ``sigma`` on Poisson subsamples of
rate ``q``, the central limit theorem of Dong, Roth & Su (2019) gives, as ``T -> inf``
with ``q sqrt(T)`` fixed, ``mu``-GDP with

    mu = q sqrt(T (exp(1 / sigma^2) - 1)),

and GDP composes exactly: ``mu = sqrt(sum_i mu_i^2)`` over the terms of a plan. A
``mu``-GDP mechanism is ``(epsilon, delta)``-DP for every ``epsilon`` with

    delta(epsilon) = Phi(-epsilon / mu + mu / 2) - exp(epsilon) Phi(-epsilon / mu - mu / 2).

The limit is asymptotic: for finite ``T`` (and small ``q sqrt(T)`` or small ``sigma``) it
can **under-estimate** the privacy loss (Dong, Roth & Su discuss its accuracy; it is known
to be optimistic in some regimes). lipdp therefore marks it ``approximate``: the privacy
report and the accountant callback say that its epsilon is not a proven guarantee. Use
``"rdp"`` or ``"pld"`` for a bound. Subsampled Gaussians only (a plan with Laplace
releases is refused).
"""

from __future__ import annotations

import math

from scipy import optimize, stats

from lipdp.accounting.mechanisms import SubsampledGaussian


def mu_of(mechanism: SubsampledGaussian, count: int) -> float:
    """``mu = q sqrt(T (exp(1 / sigma^2) - 1))`` of ``count`` steps (module docstring)."""
    if not isinstance(mechanism, SubsampledGaussian):
        raise ValueError(
            f"the GDP accountant handles subsampled Gaussians only, got {mechanism!r}; use "
            "accountant='rdp' or 'pld'."
        )
    sigma, q = mechanism.noise_multiplier, mechanism.sampling_rate
    return q * math.sqrt(count * math.expm1(1.0 / sigma**2))


def delta_of(epsilon: float, mu: float) -> float:
    """``delta(epsilon)`` of a ``mu``-GDP mechanism."""
    return stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(
        -epsilon / mu - mu / 2
    )


def epsilon_of(mu: float, delta: float) -> float:
    """The smallest ``epsilon >= 0`` with ``delta(epsilon) <= delta`` (0 if ``mu = 0``)."""
    if mu == 0 or delta_of(0.0, mu) <= delta:
        return 0.0
    high = 1.0
    while delta_of(high, mu) > delta:
        high *= 2.0
    return float(optimize.brentq(lambda e: delta_of(e, mu) - delta, 0.0, high, xtol=1e-12))


class GDPAccountant:
    """``mu``-GDP by the central limit theorem; **approximate** (module docstring)."""

    name = "gdp"
    description = "GDP (central-limit approximation)"
    #: Read by the privacy report and the accountant callback: epsilon is not a bound.
    approximate = True

    def mu(self, terms) -> float:
        """``sqrt(sum mu_i^2)`` over the ``(mechanism, count)`` terms."""
        return math.sqrt(sum(mu_of(m, c) ** 2 for m, c in terms if c))

    def epsilon(self, terms, delta: float) -> float:
        return epsilon_of(self.mu(terms), float(delta))


__all__ = ["GDPAccountant", "delta_of", "epsilon_of", "mu_of"]
