"""Original import path of the DP layers (``from lipdp import layers``); they live in
:mod:`lipdp.clipless.layers`, one module per layer family."""

from lipdp.clipless.layers import *  # noqa: F403  (the re-export is the point)
from lipdp.clipless.layers import __all__  # noqa: F401
