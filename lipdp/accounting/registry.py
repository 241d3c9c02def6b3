"""Accountants by name: ``get_accountant("rdp")``, ``register_accountant(name, accountant)``.

An accountant is any object with ``name`` and ``epsilon(terms, delta) -> float``, where
``terms`` is a sequence of ``(mechanism, count)`` pairs (:mod:`lipdp.accounting.mechanisms`)
and ``epsilon`` is an upper bound on the privacy loss of their composition (add/remove
one example) -- except for accountants with ``approximate = True`` (``"gdp"``, the
central-limit approximation of :mod:`lipdp.accounting.gdp`), whose epsilon the privacy
report and the accountant callback flag as not a proven guarantee. Every entry point that
takes ``accountant="..."`` resolves it here.
"""

from __future__ import annotations

from lipdp.accounting import pld, rdp
from lipdp.accounting.gdp import GDPAccountant
from lipdp.accounting.pld import PLDAccountant
from lipdp.accounting.rdp import RDPAccountant

_REGISTRY = {"rdp": RDPAccountant(), "pld": PLDAccountant(), "gdp": GDPAccountant()}


def is_approximate(accountant) -> bool:
    """Whether ``accountant``'s epsilon is an approximation rather than an upper bound."""
    return bool(getattr(get_accountant(accountant), "approximate", False))


def register_accountant(name: str, accountant) -> None:
    """Make ``accountant`` available as ``accountant=name`` everywhere."""
    if not callable(getattr(accountant, "epsilon", None)):
        raise TypeError(f"an accountant needs epsilon(terms, delta); got {accountant!r}.")
    _REGISTRY[str(name)] = accountant


def get_accountant(name="rdp"):
    """The accountant registered as ``name`` (an accountant object is returned as is)."""
    if not isinstance(name, str) and callable(getattr(name, "epsilon", None)):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"accountant must be one of {tuple(_REGISTRY)}, got {name!r}.")
    return _REGISTRY[name]


def clear_caches(results_only=False) -> None:
    """Forget cached results (and, unless ``results_only``, the cached one-run RDP
    curves and PLDs): for benchmarks that time cold starts."""
    for accountant in _REGISTRY.values():
        cache = getattr(accountant, "_cache", None)
        if isinstance(cache, dict):
            cache.clear()
    if not results_only:
        rdp.rdp_curve.cache_clear()
        pld._one_run.cache_clear()
        pld._composed.cache_clear()
