"""Original import path of the clipless model and its helpers (``from lipdp.model import
DP_Sequential, DP_Accountant, get_eps_delta``): the model lives in
:mod:`lipdp.clipless.model`, the accountant callback in :mod:`lipdp.core.callbacks`,
``get_eps_delta`` in :mod:`lipdp.accounting.budget`."""

from lipdp.accounting.budget import get_eps_delta
from lipdp.clipless.model import *  # noqa: F403  (the re-export is the point)
from lipdp.clipless.model import __all__ as _model_names
from lipdp.core.callbacks import DP_Accountant

__all__ = [*_model_names, "DP_Accountant", "get_eps_delta"]
