"""Original import path of the dynamic-clipping callbacks (``from lipdp.dynamic import
AdaptiveQuantileClipping``); they live in :mod:`lipdp.clipless.dynamic`."""

from lipdp.clipless.dynamic import *  # noqa: F403  (the re-export is the point)
from lipdp.clipless.dynamic import __all__  # noqa: F401
