r"""Certified radii of a network with a group normalisation, from its local slope.

Why a second certificate
------------------------
:func:`lipdp.evaluation.robustness.lipschitz_constant` multiplies the layers' global
constants. A :class:`~lipdp.clipless.layers.DP_GroupNormalization` contributes
``1 / alpha``: its worst case, reached only by inputs whose groups have a standard
deviation near ``alpha``. In the scattering network of ``lipdp train`` (``alpha = 1e-4``)
this makes the constant w.r.t. the raw pixels about 2 500 on Fashion-MNIST, and the
global certificate ``margin / (sqrt(2) L)`` certifies nothing at any useful radius, while
around a real image the layer's slope is ``sqrt(n_q) / ||z_q||``, thousands of times
smaller. This module certifies with that slope, soundly: the slope is bounded on the
whole ball, not measured at the centre.

The bound
---------
Write the network ``f = h o N o g``: ``g`` the layers before the normalisation
(``L_g``-Lipschitz on the whole input space: the model starts with
:class:`~lipdp.clipless.layers.DP_BoundedInput`, a projection), ``N`` the normalisation,
``h`` the layers after it (``L_h``-Lipschitz). For group ``q`` (``n_q`` values) let
``z_q(x)`` be the centred group of ``g(x)`` and ``a = alpha sqrt(n_q)``. The layer maps
``z -> (1 / alpha) P_a(z)`` with ``P_t`` the projection onto the ball of radius ``t``; for
``||z|| >= t >= a`` it is ``sqrt(n_q) z / ||z|| = (sqrt(n_q) / t) P_t(z)``, so on
``{||z|| >= t}`` it is ``sqrt(n_q) / t``-Lipschitz (a projection onto a convex set is
1-Lipschitz).

For every ``x'`` with ``||x' - x|| <= rho``: centring is an orthogonal projection, so
``||z_q(x') - z_q(x)|| <= ||g(x') - g(x)|| <= L_g rho`` and ``||z_q(x')|| >= s - L_g rho``
with ``s = min_q ||z_q(x)||``. With ``t(rho) = max(a, s - L_g rho)`` every group of ``x``
and ``x'`` lies in ``{||z|| >= t(rho)}`` (or ``t = a`` and the global ``1 / alpha =
sqrt(n_q) / a`` applies), hence, summing the disjoint groups,

``||f(x') - f(x)|| <= L_h sqrt(n_q) / t(rho) * L_g * ||x' - x||``   on the ball,

and every logit difference moves by at most ``sqrt(2)`` times that (``1`` for a
single-logit model). The decision at ``x`` cannot change within ``rho`` if

``c L_g L_h sqrt(n_q) rho / t(rho) < m``   (``m`` the margin, ``c = sqrt(2)`` or 1).

Dividing by ``c L_g L_h sqrt(n_q)``, the condition is ``rho / t(rho) < k`` with
``k = m / (c L_g L_h sqrt(n_q))``; its left side increases with ``rho``, so the certified
radius is the root, in closed form. Let ``rho_0 = (s - a) / L_g``, where ``t`` reaches its
floor ``a``. If ``s <= a`` or ``rho_0 < k a`` the root lies where ``t = a``: ``k a``, the
global certificate ``m / (c L_g L_h / alpha)``. Otherwise it lies where
``t = s - L_g rho``: ``rho / (s - L_g rho) = k`` gives ``k s / (1 + k L_g)``, at most
``rho_0`` and at least ``k a`` (there ``t >= a``): never below the global certificate.

Scope: a model whose top-level layers hold exactly one ``DP_GroupNormalization``, with
equal groups (the layer's own rule); otherwise :func:`local_certified_radius` returns
``None`` and the global certificate is the one to use. Like the global certificate, the
bound holds for the float64 function of the model's weights (provided they satisfy their
constraints, :func:`lipdp.clipless.audit.audit_model`); the logits are the model's
float32 ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lipdp.clipless.bounds import bound_pass
from lipdp.evaluation.outputs import predict_logits
from lipdp.foundation import validation

SQRT2 = math.sqrt(2.0)


@dataclass(frozen=True)
class GroupNormSplit:
    """A model cut at its group normalisation: ``f = h o N o g``.

    Attributes:
        index: position of the normalisation in ``model.layers_forward_order()``.
        layer: the :class:`~lipdp.clipless.layers.DP_GroupNormalization`.
        before: ``L_g``, the Lipschitz constant of the layers before it.
        after: ``L_h``, that of the layers after it.
        lipschitz: the model's global constant, ``L_g L_h / alpha``.
    """

    index: int
    layer: object
    before: float
    after: float
    lipschitz: float


def group_norm_split(model) -> GroupNormSplit | None:
    """The cut of ``model`` at its one top-level group normalisation, ``None`` when the
    model has none, several, or one inside a residual path (the global certificate
    applies then)."""
    from lipdp.clipless.layers import DP_GroupNormalization

    layers = list(model.layers_forward_order())
    found = [i for i, layer in enumerate(layers) if isinstance(layer, DP_GroupNormalization)]
    if len(found) != 1:
        return None
    index = found[0]
    try:
        before = bound_pass(layers[:index]).lipschitz if index else 1.0
        total = bound_pass(layers).lipschitz
    except ValueError:  # the cut falls inside a residual block
        return None
    if isinstance(before, (tuple, list)) or isinstance(total, (tuple, list)):
        return None
    layer = layers[index]
    before, total = float(before), float(total)
    # The walk multiplies along the single path: the layers after the normalisation
    # contribute total / (before / alpha).
    after = total * layer.alpha / before
    return GroupNormSplit(index, layer, before, after, total)


def _centred_group_norms(layer, features) -> np.ndarray:
    """``||z_q||`` for every example and group (``(n, groups)``), in float64."""
    features = np.asarray(features, dtype=np.float64)
    n, channels = features.shape[0], features.shape[-1]
    grouped = features.reshape(n, -1, layer.groups, channels // layer.groups)
    centred = grouped - grouped.mean(axis=(1, 3), keepdims=True)
    return np.sqrt(np.sum(centred**2, axis=(1, 3)))


def _features(model, split, x, batch_size) -> np.ndarray:
    """The inputs of the normalisation, ``g(x)``, batch by batch."""
    layers = list(model.layers_forward_order())[: split.index]
    parts = []
    for start in range(0, len(x), batch_size):
        h = x[start : start + batch_size]
        for layer in layers:
            h = layer(h, training=False)
        parts.append(np.asarray(h, dtype=np.float64))
    return np.concatenate(parts, axis=0)


def radius_from_slopes(margins, smallest_group_norms, before, after, alpha, group_size, factor):
    """The closed-form certified radius of the module docstring, one per example.

    Args:
        margins: ``m`` (top-1 minus top-2 logit, or ``|f|`` for one logit).
        smallest_group_norms: ``s = min_q ||z_q(x)||``.
        before, after: ``L_g`` and ``L_h``.
        alpha: the normalisation's floor.
        group_size: ``n_q``.
        factor: ``c``, ``sqrt(2)`` for several logits, 1 for one.
    """
    margins = np.asarray(margins, dtype=np.float64)
    s = np.asarray(smallest_group_norms, dtype=np.float64)
    a = alpha * math.sqrt(group_size)
    k = margins / (factor * before * after * math.sqrt(group_size))
    floor_radius = k * a  # the global certificate
    rho0 = (s - a) / before
    sloped = k * s / (1.0 + k * before)
    use_slope = (s > a) & (rho0 >= floor_radius)
    return np.where(use_slope, sloped, floor_radius)


def local_certified_radius(model, x, batch_size: int = 512):
    """Certified ``l2`` radius of each example of ``x`` (raw inputs, as fed to the model)
    from the local slope of the model's group normalisation; ``None`` when the model is
    outside this certificate's scope (:func:`group_norm_split`)."""
    batch_size = validation.count("batch_size", batch_size, 1)
    split = group_norm_split(model)
    if split is None:
        return None
    x = np.asarray(x)
    features = _features(model, split, x, batch_size)
    norms = _centred_group_norms(split.layer, features)
    group_size = features[0].size // split.layer.groups
    logits = np.asarray(predict_logits(model, x, batch_size), dtype=np.float64)
    if logits.ndim == 1 or logits.shape[1] == 1:
        margins, factor = np.abs(logits.reshape(-1)), 1.0
    else:
        top2 = np.sort(logits, axis=1)[:, -2:]
        margins, factor = top2[:, 1] - top2[:, 0], SQRT2
    return radius_from_slopes(
        margins, norms.min(axis=1), split.before, split.after, split.layer.alpha, group_size, factor
    )


__all__ = ["GroupNormSplit", "group_norm_split", "local_certified_radius", "radius_from_slopes"]
