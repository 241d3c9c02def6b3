"""The reference accountant: autodp mechanisms built from scratch (slow, independent).

:class:`DPGD_Mechanism` is the original package's mechanism (its call form is kept):
Gaussian (``"global"``) or autodp's ``ComposeGaussian`` of one Gaussian per trainable
variable (``"per-layer"``) -> Poisson subsampling (``AmplificationBySampling``, improved
bound) -> composition over the steps, and with the dynamic-clipping mechanisms if given;
``epsilon`` is autodp's ``get_approxDP(delta)``. :func:`autodp_epsilon` does the same for
any terms of a privacy plan. Tens of milliseconds to seconds per call: the fast
accountants of :mod:`lipdp.accounting.rdp` reproduce these numbers and are what lipdp
uses; this module is what the tests compare them with.
"""

from __future__ import annotations

import numpy as np
from autodp import mechanism_zoo, transformer_zoo
from autodp.autodp_core import Mechanism

from lipdp.accounting.mechanisms import (
    SubsampledGaussian,
    noise_multiplier_list,
    release_from_config,
    subsample_autodp,
)
from lipdp.foundation import validation

MODES = ("global", "per-layer")


def _approx_dp(composed, counts, delta) -> float:
    if sum(counts) == 0:
        return 0.0
    # autodp's Brent search divides 0 by 0 on flat stretches (harmless).
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(composed.get_approxDP(delta))


def autodp_epsilon(terms, delta) -> float:
    """autodp's ``epsilon`` of the composition of ``(mechanism, count)`` terms."""
    terms = [(m, c) for m, c in terms if c > 0]
    if not terms:
        return 0.0
    composed = transformer_zoo.Composition()([m.autodp() for m, _ in terms], [c for _, c in terms])
    return _approx_dp(composed, [c for _, c in terms], validation.delta(delta))


class DPGD_Mechanism(Mechanism):
    """The training run as one autodp mechanism (the reference accountant).

    Args:
        mode: ``"global"`` or ``"per-layer"``.
        prob: sampling rate ``b / N`` in ``(0, 1]``.
        noise_multipliers: ``sigma`` (a number or a one-element list) for ``"global"``;
            one ``sigma * nm_coef`` per trainable variable for ``"per-layer"``.
        num_grad_steps: number of training steps (integer >= 0).
        delta: target ``delta`` in ``(0, 1)``.
        dynamic_clipping: ``None`` or a legacy config dict
            (:func:`lipdp.accounting.mechanisms.release_from_config`).

    Attributes:
        epsilon, delta: the ``(epsilon, delta)`` guarantee.
    """

    def __init__(
        self,
        mode,
        prob,
        noise_multipliers,
        num_grad_steps,
        delta,
        dynamic_clipping=None,
        name="DPGD_Mechanism",
    ):
        Mechanism.__init__(self)
        validation.choice("mode", mode, MODES)
        prob = validation.probability("prob (the sampling rate b/N)", prob)
        sigmas = noise_multiplier_list(noise_multipliers)
        if mode == "global" and len(sigmas) != 1:
            raise ValueError(
                f"mode='global' takes one noise multiplier, got {len(sigmas)}; use "
                "mode='per-layer' for one multiplier per trainable variable."
            )
        num_grad_steps = validation.count("num_grad_steps", num_grad_steps)
        delta = validation.delta(delta)
        dynamic = release_from_config(dynamic_clipping, prob)

        self.name = name
        self.params = {
            "mode": mode,
            "prob": prob,
            "noise_multipliers": sigmas if mode == "per-layer" else sigmas[0],
            "num_grad_steps": num_grad_steps,
            "delta": delta,
            "dynamic_clipping": dynamic_clipping,
        }
        gaussians = [mechanism_zoo.GaussianMechanism(sigma=s) for s in sigmas]
        if mode == "global":
            gradient = gaussians[0]
        else:
            gradient = transformer_zoo.ComposeGaussian()(gaussians, [1] * len(sigmas))
        # The rate is all subsample_autodp reads of the SubsampledGaussian.
        mechanisms = [subsample_autodp(gradient, SubsampledGaussian(1.0, prob))]
        counts = [num_grad_steps]
        if dynamic is not None:
            mechanisms.append(dynamic.mechanism.autodp())
            counts.append(dynamic.fixed)
        composed = transformer_zoo.Composition()(mechanisms, counts)
        self.propagate_updates(composed.RenyiDP, type_of_update="RDP")
        self.delta = delta
        self.epsilon = _approx_dp(composed, counts, delta)
