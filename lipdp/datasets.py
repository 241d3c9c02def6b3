"""Former home of the offline raw loaders, now :mod:`lipdp.data.sources`.

Every public name is re-exported, so ``from lipdp.datasets import load_digits`` and
``lipdp.datasets.load_fashion_mnist()`` keep working. Module-level settings are read by
:mod:`lipdp.data.sources`: to change one (e.g. ``DEBIAN_FASHION_MNIST`` in a test),
set it there, not here.
"""

from lipdp.data import sources
from lipdp.data.sources import *  # noqa: F403  (the re-export is the point)

__all__ = list(sources.__all__)
