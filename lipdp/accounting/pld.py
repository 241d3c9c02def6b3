r"""Privacy-loss-distribution accountant (Koskela et al.; Google's ``dp_accounting``).

Tighter than RDP: 8 % smaller ``epsilon`` for the MNIST tutorial after 91 epochs (2.742 vs
2.988), far smaller for a few steps (``epsilon`` of one step of ``sigma = 1``,
``q = 0.01``: 0.20 vs 0.96). It computes exactly what ``dp_accounting.pld.PLDAccountant``
computes for :func:`lipdp.accounting.plan.dp_event` of the same terms (same PLD
constructors, ``pessimistic_estimate=True``, same ``value_discretization_interval``), with
the one-run PLDs cached so that a new count costs a single FFT self-composition.

``value_discretization_interval`` defaults to :data:`PLD_VALUE_DISCRETIZATION_INTERVAL`
``= 1e-4``: 0.1-0.3 s for 6000 steps of the MNIST tutorial configuration, and an
``epsilon`` larger than the limit of a vanishing interval by about ``3e-5`` there
(``pessimistic_estimate``: the result stays an upper bound for every interval).
"""

from __future__ import annotations

import functools

from lipdp.foundation import validation

#: Default discretisation of the privacy loss (module docstring).
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4


@functools.lru_cache(maxsize=64)
def _one_run(mechanism, interval):
    return mechanism.pld(interval)


@functools.lru_cache(maxsize=32)  # PLDs are arrays: a bisection needs about a dozen
def _composed(mechanism, count, interval):
    return _one_run(mechanism, interval).self_compose(count)


class PLDAccountant:
    """PLD composition, add/remove, pessimistic estimate."""

    name = "pld"
    description = "PLD"

    def __init__(self, value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL):
        self.value_discretization_interval = validation.positive(
            "value_discretization_interval", value_discretization_interval
        )
        self._cache = {}

    def epsilon(self, terms, delta: float) -> float:
        """``epsilon`` of the composition of ``terms`` (``(mechanism, count)`` pairs)."""
        key = (tuple(terms), float(delta))
        if key not in self._cache:
            self._cache[key] = self._compute(terms, float(delta))
        return self._cache[key]

    def _compute(self, terms, delta) -> float:
        interval = self.value_discretization_interval
        plds = [_composed(m, c, interval) for m, c in terms if c > 0]
        if not plds:
            return 0.0
        total = plds[0]
        for other in plds[1:]:
            total = total.compose(other)
        return float(total.get_epsilon_for_delta(delta))
