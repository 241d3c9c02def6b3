"""Original import path of ``get_max_epochs`` (``from lipdp.sensitivity import
get_max_epochs``): planning lives in :mod:`lipdp.accounting.budget`."""

from lipdp.accounting.budget import get_eps_delta, get_max_epochs

__all__ = ["get_max_epochs", "get_eps_delta"]
