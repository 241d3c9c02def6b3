"""Names of the original package's ``deel.lipdp.utils``, re-exported from
:mod:`lipdp.evaluation` (``from lipdp.utils import ScaledAUC`` works as before).

``PrivacyMetrics``, ``SignaltoNoiseAverage`` and ``SignaltoNoiseHistogram`` read
private training data: see :mod:`lipdp.evaluation.membership` and
:mod:`lipdp.evaluation.diagnostics`.
"""

from lipdp.evaluation.diagnostics import (
    SensitivityAudit,
    SignaltoNoiseAverage,
    SignaltoNoiseHistogram,
)
from lipdp.evaluation.membership import PrivacyMetrics
from lipdp.evaluation.robustness import CertifiableAUROC, ScaledAUC

__all__ = [
    "ScaledAUC",
    "CertifiableAUROC",
    "PrivacyMetrics",
    "SignaltoNoiseAverage",
    "SignaltoNoiseHistogram",
    "SensitivityAudit",
]
