"""Original import path of ``get_max_epochs`` (``from lipdp.sensitivity import
get_max_epochs``): planning lives in :mod:`lipdp.accounting.planning`."""

from lipdp.accounting.planning import get_eps_delta, get_max_epochs

__all__ = ["get_max_epochs", "get_eps_delta"]
