"""Sharpness-aware variants of clipped DP-SGD: where the per-example gradients are taken
(:class:`SharpnessAscent`: BAM, DP-SAT)."""

from __future__ import annotations

from dataclasses import dataclass

from lipdp.foundation import validation
from lipdp.foundation.config import Config

#: Ascent steps before the clipped gradient (:class:`SharpnessAscent`).
ASCENT_MODES = ("bam", "dp-sat")


@dataclass(frozen=True)
class SharpnessAscent(Config):
    r"""A sharpness-aware ascent step before the per-example gradients are taken.

    * ``"bam"`` (Knolle et al., *Bias-Aware Minimisation*, Algorithm 2): row ``i``'s
      gradient is taken at ``theta_i' = theta + lambda g_i / ||g_i||``, its own ascent
      point (``g_i``: its gradient at ``theta``; no ascent for a zero gradient). Row ``i``'s
      released contribution depends on row ``i`` alone and is clipped as in DP-SGD: same
      sensitivity, same privacy. Cost: a second forward and backward pass (about 2x a
      DP-SGD step); the ascent is exact for Dense, Conv2D and Embedding through their
      ghost records (``W + s_i A_i^T G_i`` applied as ``A'_i W + s_i A'_i A_i^T G_i``), and
      by running the layer on materialised row-wise weights for other layers.
    * ``"dp-sat"`` (Park et al., *Differentially Private Sharpness-Aware Training*, 2023):
      every row's gradient at ``theta + rho u / ||u||`` with ``u`` the previous step's
      *released* noisy gradient (post-processing: no privacy cost; no ascent at the first
      step). Cost: two weight assignments per step.

    Attributes:
        mode: one of :data:`ASCENT_MODES`.
        radius: ``lambda`` (BAM) or ``rho`` (DP-SAT), ``> 0``.
    """

    argument_name = "ascent"

    mode: str
    radius: float

    def __post_init__(self):
        validation.choice("ascent mode", self.mode, ASCENT_MODES)
        self._set("radius", validation.positive("ascent radius", self.radius))


__all__ = ["ASCENT_MODES", "SharpnessAscent"]
