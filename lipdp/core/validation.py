"""Moved to :mod:`lipdp.foundation.validation` (issue 38: the foundation sits below
:mod:`lipdp.accounting`, the private model above it). This former path still imports it:
it *is* that module (same object, so a patch of one patches the other)."""

import sys

from lipdp.foundation import validation as _moved

sys.modules[__name__] = _moved
