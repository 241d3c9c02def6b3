"""Evaluation of trained lipdp models (one module per concept).

* :mod:`lipdp.evaluation.robustness` — Lipschitz constant of the trained function,
  certified radii and accuracy, PGD attacks, ``ScaledAUC`` / ``CertifiableAUROC``;
* :mod:`lipdp.evaluation.calibration` — ECE, MCE, NLL, reliability diagrams;
* :mod:`lipdp.evaluation.membership` — membership-inference attacks
  (``PrivacyMetrics``): an empirical check, not a proof of privacy;
* :mod:`lipdp.evaluation.diagnostics` — gradient-to-bound and signal-to-noise
  callbacks, ``SensitivityAudit``.

Membership inference and the diagnostics read private training data: their
results are not covered by the DP guarantee and none of them is added to
training by default.
"""

from lipdp.evaluation.calibration import (
    CalibrationReport,
    ReliabilityDiagram,
    calibration_report,
    expected_calibration_error,
    maximum_calibration_error,
    negative_log_likelihood,
    plot_reliability_diagram,
    predict_probabilities,
    reliability_diagram,
)
from lipdp.evaluation.diagnostics import (
    AuditReport,
    SensitivityAudit,
    SignaltoNoiseAverage,
    SignaltoNoiseHistogram,
    gradient_statistics,
    per_example_gradients,
)
from lipdp.evaluation.membership import (
    AttackResult,
    MembershipReport,
    PrivacyMetrics,
    attacker_advantage,
    dp_advantage_bound,
    logistic_regression_attack,
    loss_threshold_attack,
    membership_inference,
    roc_auc,
)
from lipdp.evaluation.robustness import (
    CertifiableAUROC,
    ScaledAUC,
    certified_accuracy,
    certified_radius,
    empirical_lipschitz,
    lipschitz_constant,
    pgd_attack,
    pgd_l2_attack,
    plot_robustness_curves,
    robust_accuracy,
    robustness_curves,
)

__all__ = [
    "lipschitz_constant",
    "certified_radius",
    "certified_accuracy",
    "pgd_attack",
    "pgd_l2_attack",
    "robust_accuracy",
    "robustness_curves",
    "plot_robustness_curves",
    "empirical_lipschitz",
    "ScaledAUC",
    "CertifiableAUROC",
    "ReliabilityDiagram",
    "CalibrationReport",
    "reliability_diagram",
    "expected_calibration_error",
    "maximum_calibration_error",
    "negative_log_likelihood",
    "calibration_report",
    "plot_reliability_diagram",
    "predict_probabilities",
    "AttackResult",
    "MembershipReport",
    "PrivacyMetrics",
    "roc_auc",
    "attacker_advantage",
    "dp_advantage_bound",
    "loss_threshold_attack",
    "logistic_regression_attack",
    "membership_inference",
    "per_example_gradients",
    "gradient_statistics",
    "SignaltoNoiseAverage",
    "SignaltoNoiseHistogram",
    "AuditReport",
    "SensitivityAudit",
]
