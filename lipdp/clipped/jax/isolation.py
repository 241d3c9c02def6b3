"""Moved to :mod:`lipdp.core.jax.isolation` (issue 38 item 5: the JAX trainer of both families).
This former path still imports it: it *is* that module (same object, so a patch of one
patches the other)."""

import sys

from lipdp.core.jax import isolation as _moved

sys.modules[__name__] = _moved
