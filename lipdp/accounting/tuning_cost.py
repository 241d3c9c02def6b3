r"""The privacy cost of a hyper-parameter search: a random number of runs, the best kept.

Papernot & Steinke (*Hyperparameter Tuning with Renyi Differential Privacy*, ICLR 2022):
run the training ``K`` times (each run a DP mechanism ``M`` with its own randomly drawn
hyper-parameters), release only the best run. If ``K`` is fixed the cost grows like ``K``;
if ``K`` is *random* with a suitable law, the cost is that of one run plus a small
overhead. With ``K`` drawn from the truncated negative binomial law ``D_{eta, gamma}``,

    ``P(K = k) = (1 - gamma)^k C(k + eta - 1, k) gamma^eta / (1 - gamma^eta)``, ``k >= 1``

(``eta = 1``: geometric on ``{1, 2, ...}`` with mean ``1 / gamma``; ``eta = 0``:
logarithmic, ``P(K = k) = (1 - gamma)^k / (k log(1 / gamma))``), and ``M`` being
``(lambda, eps(lambda))``-RDP at every order, their Theorem 2 makes the search
``(lambda, eps'(lambda))``-RDP with

    ``eps'(lambda) = eps(lambda) + (1 + eta) min_{mu >= 1} [(1 - 1/mu) eps(mu)
    + log(1/gamma) / mu] + log(E[K]) / (lambda - 1)``,

``E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta))`` (``(1 - gamma) / (gamma log(1 /
gamma))`` for ``eta = 0``). :meth:`RandomSearch.rdp` applies it on a grid of orders (the
minimum over ``mu`` taken on the grid: an upper bound on the exact minimum), then the RDP
monotonicity in the order (``eps'(lambda) <= eps'(lambda')`` for ``lambda <= lambda'``);
:func:`search_epsilon` converts to ``(epsilon, delta)`` with the conversion of the RDP
accountant (:mod:`lipdp.accounting.rdp`).

Conditions the guarantee rests on (stated in the privacy report): ``K`` is drawn from the
law, independently of the data; every run is the same mechanism or one whose RDP curve is
below ``eps`` (same noise multiplier, sampling rate and number of steps, or fewer steps);
only the selected run's output (and its score) is released — not the other runs' models,
scores or the number ``K``. The law's parameters are public.

The overhead is checked against dp-accounting's ``RepeatAndSelectDpEvent`` (the same
theorem, implemented independently) and against a hand-computed case
(``tests/accounting/test_tuning_cost.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lipdp.foundation import validation
from lipdp.foundation.config import Config


@dataclass(frozen=True)
class RandomSearch(Config):
    """A hyper-parameter search of ``K ~ D_{eta, gamma}`` runs (module docstring).

    Attributes:
        mean: ``E[K] >= 1``, the expected number of runs (``gamma`` is derived from it).
        shape: ``eta >= 0``: 1 (default) geometric, 0 logarithmic, other values the
            truncated negative binomial. Smaller ``eta`` costs less privacy for the same
            mean, with a heavier tail of long searches.
    """

    argument_name = "search"

    mean: float
    shape: float = 1.0

    def __post_init__(self):
        mean = validation.real("RandomSearch mean", self.mean, low=1.0, low_open=False)
        self._set("mean", mean)
        self._set("shape", validation.non_negative("RandomSearch shape", self.shape))

    # ---------------------------------------------------------------- the law of K
    @property
    def gamma(self) -> float:
        """``gamma`` of ``D_{eta, gamma}`` with mean :attr:`mean` (bisection on the mean,
        rounded down: a smaller ``gamma`` only lengthens the searches)."""
        if self.mean == 1.0:
            return 1.0
        if self.shape == 1.0:
            return 1.0 / self.mean
        low, high = 0.0, 1.0
        for _ in range(200):
            middle = (low + high) / 2
            if middle == low or middle == high:
                break
            if truncated_negative_binomial_mean(middle, self.shape) < self.mean:
                high = middle
            else:
                low = middle
        return low

    def sample(self, rng: np.random.Generator) -> int:
        """A number of runs ``K >= 1`` drawn from the law (``rng``: numpy's generator)."""
        gamma = self.gamma
        if gamma >= 1.0:
            return 1
        if self.shape == 0.0:
            return int(rng.logseries(1.0 - gamma))
        while True:  # the negative binomial conditioned on K >= 1
            k = int(rng.negative_binomial(self.shape, gamma))
            if k >= 1:
                return k

    # ------------------------------------------------------------------ privacy
    def rdp(self, orders, rdp) -> np.ndarray:
        """The search's RDP at ``orders`` from one run's RDP ``rdp`` at the same orders
        (Theorem 2 of Papernot & Steinke; ``inf`` at orders ``<= 1``)."""
        orders = np.asarray(orders, dtype=np.float64)
        rdp = np.asarray(rdp, dtype=np.float64)
        if orders.shape != rdp.shape:
            raise ValueError("orders and rdp must have the same length.")
        gamma = self.gamma
        usable = orders >= 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            overhead = (1.0 - 1.0 / orders) * rdp + math.log(1.0 / gamma) / orders
        constant = (1.0 + self.shape) * float(np.min(overhead[usable]))
        out = np.full_like(orders, np.inf)
        above = orders > 1.0
        out[above] = rdp[above] + constant + math.log(self.mean) / (orders[above] - 1.0)
        # Renyi divergences grow with the order: a bound at a larger order holds below it.
        return np.minimum.accumulate(out[::-1])[::-1]

    def describe(self) -> str:
        law = {0.0: "logarithmic", 1.0: "geometric"}.get(
            self.shape, f"truncated negative binomial (eta = {self.shape:g})"
        )
        return f"random search: K ~ {law} with E[K] = {self.mean:g} (gamma = {self.gamma:.4g})"


def truncated_negative_binomial_mean(gamma: float, shape: float) -> float:
    """``E[K]`` of ``D_{eta, gamma}`` (module docstring)."""
    if gamma >= 1.0:
        return 1.0
    if shape == 0.0:
        return (1.0 - gamma) / (gamma * math.log(1.0 / gamma))
    return shape * (1.0 - gamma) / (gamma * -math.expm1(shape * math.log(gamma)))


#: Orders at which a search's RDP is evaluated: those of the RDP accountant up to 1024.
def _orders() -> np.ndarray:
    from lipdp.accounting.rdp import _GRID

    return _GRID[_GRID <= 1024]


def search_epsilon(terms, delta: float, search: RandomSearch) -> float:
    """``epsilon`` of ``search`` over runs that each compose ``terms`` (``(mechanism,
    count)`` pairs), with the RDP accountant's curves and its RDP -> DP conversion."""
    from lipdp.accounting.rdp import RDPAccountant, _bbghs

    orders = _orders()
    one_run = RDPAccountant().rdp(terms, orders)
    eps = _bbghs(orders, search.rdp(orders, one_run), float(delta))
    return float(np.min(eps))


__all__ = ["RandomSearch", "search_epsilon", "truncated_negative_binomial_mean"]
