"""How a row's gradient is clipped: the four modes of :class:`Clipping` (flat, per-layer,
automatic, global) and their factors ``C_i``; every mode bounds the norm of a row's scaled
gradient ``C_i g_i`` by ``R``, the sensitivity the noise of :mod:`lipdp.clipped.model`
is calibrated on.

The rule is written once, for both backends: :meth:`Clipping.factors` and
:meth:`Clipping.layer_factors` compute in the array namespace of
:func:`lipdp.foundation.compat.array_ops` (``keras.ops``; a TensorFlow shim on Keras 2), on the
norms' own dtype: float64 from the TensorFlow engine (:mod:`lipdp.clipped.per_example`),
float32 from the JAX step (:mod:`lipdp.clipped.jax.per_example`, whose norms are an upper
bound computed without overflow or underflow). Importing this module imports neither
TensorFlow nor JAX."""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation import compat, validation
from lipdp.foundation.config import Config

#: Clipping modes (per-example factor rules, :class:`Clipping`).
CLIPPING_MODES = ("flat", "per-layer", "automatic", "global")


@dataclass(frozen=True)
class Clipping(Config):
    r"""How per-example gradients ``g_i`` are scaled, ``C_i g_i``, and why every scaled
    gradient has norm at most ``R`` (the sensitivity of the sum):

    * ``"flat"`` (Abadi et al. 2016): ``C_i = min(1, R / ||g_i||)``;
      ``||C_i g_i|| = min(||g_i||, R) <= R``.
    * ``"per-layer"`` (McMahan et al. 2018): each layer ``l`` with variables is clipped
      to its own radius, ``C_il = min(1, R_l / ||g_il||)`` with ``R_l = R s_l /
      ||s||`` for the ``layer_shares`` ``s`` (equal by default, ``R / sqrt(K)`` for ``K``
      layers). The row's whole clipped gradient has norm
      ``sqrt(sum_l min(||g_il||, R_l)^2) <= sqrt(sum_l R_l^2) = R``; with
      ``noisify_strategy="per-layer"`` each layer is its own Gaussian mechanism of
      sensitivity ``R_l``.
    * ``"automatic"`` (Bu et al. 2022, normalisation): ``C_i = R / (||g_i|| + gamma)``;
      ``||C_i g_i|| = R ||g_i|| / (||g_i|| + gamma) < R``.
    * ``"global"`` (Bu et al. 2021, *On the convergence and calibration of deep learning
      with differential privacy*, Appendix C.8): ``C_i = R / Z`` if ``||g_i|| <= Z``,
      else ``0``; ``||C_i g_i|| <= (R / Z) Z = R``. Every kept gradient is scaled by the
      same factor, which keeps the per-sample gradients' relative sizes (their
      calibration argument); examples with gradients above ``Z`` are dropped from the step.
      Choose ``Z`` above the typical per-example norm of *your* network at
      initialisation: with ``Z`` below it most rows are dropped, the step is almost pure
      noise and training collapses (Fashion-MNIST CNN: median norm 8 at initialisation,
      ``Z = 5`` stayed at chance, ``Z = 20`` trained; ``benchmarks/README.md``).

    Attributes:
        mode: one of :data:`CLIPPING_MODES`.
        clip_norm: ``R > 0``.
        gamma: ``gamma > 0`` of ``"automatic"`` (0.01, as the paper).
        threshold: ``Z > 0`` of ``"global"`` (required there, refused elsewhere).
        layer_shares: positive relative radii of the weighted layers, forward order, for
            ``"per-layer"`` (default: equal).
    """

    argument_name = "clipping"
    optional = False

    mode: str = "flat"
    clip_norm: float = 1.0
    gamma: float = 0.01
    threshold: float | None = None
    layer_shares: tuple | None = None

    def __post_init__(self):
        validation.choice("clipping mode", self.mode, CLIPPING_MODES)
        self._set("clip_norm", validation.positive("clip_norm", self.clip_norm))
        self._set("gamma", validation.positive("gamma", self.gamma))
        if (self.mode == "global") != (self.threshold is not None):
            raise ValueError(
                "threshold=Z is required with mode='global' (examples whose gradient norm "
                "exceeds Z are dropped) and only then."
            )
        if self.threshold is not None:
            self._set("threshold", validation.positive("threshold", self.threshold))
        if self.layer_shares is not None:
            if self.mode != "per-layer":
                raise ValueError("layer_shares applies to mode='per-layer' only.")
            shares = tuple(validation.positive("layer share", s) for s in self.layer_shares)
            self._set("layer_shares", shares)

    def per_example_bound(self) -> float:
        """Norm bound on one row's scaled gradient: ``R`` in every mode (class docstring)."""
        return self.clip_norm

    def sensitivities(self, batch_size: int, layer_names=None) -> list[tuple]:
        """``[(ClippedGradientBound, Delta)]`` of a step that releases the sum of
        ``batch_size`` clipped rows divided by ``b``: ``Delta = bound (1 + ROUNDOFF_SLACK) /
        b``, where ``bound`` is what one row's clipped gradient can move the sum by (``R``,
        :meth:`per_example_bound`) and ``ROUNDOFF_SLACK`` covers the float32 round-off of
        the clip factors and the sum (:data:`lipdp.core.noise.ROUNDOFF_SLACK`). One entry
        for the whole gradient; given ``layer_names`` (per-layer noise, the weighted layers
        in order), one per layer of bound ``R_l`` (:meth:`layer_radii`). The one rule of
        every backend's clipped model."""
        slack = (1.0 + ROUNDOFF_SLACK) / float(batch_size)
        if layer_names is not None:
            radii = self.layer_radii(len(layer_names))
            return [
                (ClippedGradientBound(f"{name} (per-layer clipping)", r), r * slack)
                for name, r in zip(layer_names, radii)
            ]
        bound = self.per_example_bound()
        entry = ClippedGradientBound(f"all variables ({self.mode} clipping)", bound)
        return [(entry, bound * slack)]

    def layer_radii(self, layers: int) -> list[float]:
        """``R_l`` of ``"per-layer"`` clipping for ``layers`` weighted layers."""
        shares = self.layer_shares or (1.0,) * layers
        if len(shares) != layers:
            raise ValueError(
                f"layer_shares has {len(shares)} entries but the model has {layers} layers "
                "with trainable variables: give one share per such layer."
            )
        scale = self.clip_norm / math.sqrt(sum(s * s for s in shares))
        return [s * scale for s in shares]

    def layer_factors(self, sq_norms) -> list:
        """``C_il`` for every weighted layer ``l`` from the rows' squared gradient norms
        per layer (float64, :mod:`lipdp.clipped.per_example`: the sum over layers cannot
        overflow): one factor from the total norm, or one per layer (``"per-layer"``).
        The layers' squares are added left to right (as ``tf.add_n`` does)."""
        ops = compat.array_ops()
        if self.mode == "per-layer":
            radii = self.layer_radii(len(sq_norms))
            return [_capped(ops.sqrt(sq), r) for sq, r in zip(sq_norms, radii)]
        total = functools.reduce(operator.add, list(sq_norms))
        return [self.factors(ops.sqrt(total))] * len(sq_norms)

    def factors(self, norms):
        """``C_i`` from the per-example gradient norms (class docstring; for
        ``"per-layer"``, see :meth:`layer_factors`), in the norms' dtype, on either backend
        (module docstring). A NaN norm gives a NaN or 0 factor: the callers drop the rows
        whose norm is not finite."""
        if self.mode == "per-layer":
            raise ValueError("per-layer clipping has one factor per layer: layer_factors().")
        ops = compat.array_ops()
        r = ops.cast(self.clip_norm, norms.dtype)
        if self.mode == "flat":
            return _capped(norms, self.clip_norm)
        if self.mode == "automatic":
            return r / (norms + ops.cast(self.gamma, norms.dtype))
        z = ops.cast(self.threshold, norms.dtype)
        return ops.where(norms <= z, r / z, ops.zeros_like(norms))


@dataclass(frozen=True)
class ClippedGradientBound:
    """The sensitivity entry of a clipped model: one bound for the whole gradient (or one
    layer's, under per-layer clipping)."""

    key: str
    bound: float
    nm_coef: float = 1.0


def _capped(norms, radius):
    """``min(1, r / ||g||)``, 1 for a zero gradient (:func:`lipdp.foundation.compat.array_ops`)."""
    ops = compat.array_ops()
    r = ops.cast(radius, norms.dtype)
    return r / ops.maximum(norms, r)


__all__ = ["CLIPPING_MODES", "ClippedGradientBound", "Clipping"]
