"""Evaluation of trained lipdp models (one module per concept).

* :mod:`lipdp.evaluation.robustness` — Lipschitz constant of the trained function,
  certified radii and accuracy, PGD attacks, ``ScaledAUC`` / ``CertifiableAUROC``;
* :mod:`lipdp.evaluation.local_certificates` — certified radii of a network with a group
  normalisation from the layer's slope around each example (not its worst case);
* :mod:`lipdp.evaluation.calibration` — ECE, MCE, NLL, reliability diagrams;
* :mod:`lipdp.evaluation.membership` — membership-inference attacks
  (``PrivacyMetrics``): an empirical check, not a proof of privacy;
* :mod:`lipdp.evaluation.outputs` — logits, probabilities, class indices, figures: what the
  others share;
* :mod:`lipdp.evaluation.diagnostics` — gradient-to-bound and signal-to-noise
  callbacks, ``SensitivityAudit``.

Membership inference and the diagnostics read private training data: their
results are not covered by the DP guarantee and none of them is added to
training by default.
"""

# Each submodule's __all__ is its public surface; the package re-exports their union.
from lipdp.evaluation import (
    calibration,
    diagnostics,
    local_certificates,
    membership,
    outputs,
    robustness,
)
from lipdp.evaluation.calibration import *  # noqa: F403
from lipdp.evaluation.diagnostics import *  # noqa: F403
from lipdp.evaluation.local_certificates import *  # noqa: F403
from lipdp.evaluation.membership import *  # noqa: F403
from lipdp.evaluation.outputs import *  # noqa: F403
from lipdp.evaluation.robustness import *  # noqa: F403

__all__ = sorted(
    {
        name
        for module in (
            outputs,
            robustness,
            local_certificates,
            calibration,
            membership,
            diagnostics,
        )
        for name in module.__all__
    }
)
