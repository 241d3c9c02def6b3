"""Original import path of the Lipschitz losses (``from lipdp import losses``); they live
in :mod:`lipdp.clipless.losses`."""

from lipdp.clipless.losses import *  # noqa: F403  (the re-export is the point)
from lipdp.clipless.losses import __all__  # noqa: F401
