"""Compatibility aliases of the prototype's JAX twins (no mathematics here any more).

The slice's layer calls, projections and losses are now written once for every backend
with :func:`lipdp.foundation.compat.array_ops` (the layers' own ``call``,
:meth:`lipdp.clipless.layers.constrained.ConstrainedKernelLayer.projected_values`,
:meth:`lipdp.clipless.losses.DP_Loss.call`); the JAX-only custom gradient lives in
:mod:`lipdp.clipless.jax.gradients`. These two names are kept for code written against the
prototype (``lipdp.clipless.jax.step``) and go when it no longer uses them.
"""

from __future__ import annotations


def projected_kernel(layer, kernel, u):
    """``layer.projected_values(kernel, u)``."""
    return layer.projected_values(kernel, u)


def tau_cce_rows(tau, y_true, y_pred):
    """Per-row ``DP_TauCategoricalCrossentropy(tau)`` (its ``call``: rule S9 included)."""
    from lipdp.clipless.losses import DP_TauCategoricalCrossentropy

    return DP_TauCategoricalCrossentropy(tau, reduction="none").call(y_true, y_pred)
