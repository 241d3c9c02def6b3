r"""Privacy accounting: from the mechanisms a training run releases to ``(epsilon, delta)``.

One training step releases the averaged minibatch gradient with Gaussian noise; for the
accountant it is a Gaussian mechanism (``K`` Gaussians on disjoint coordinates for the
``"per-layer"`` strategy compose into one, ``sigma_eff = (sum_k sigma_k^-2)^(-1/2)``)
amplified by Poisson subsampling with rate ``q = b / N``, composed over the steps and with
every other data-dependent release (dynamic clipping). Add/remove-one neighbouring
relation on every path.

Modules, one concept each:

* :mod:`~lipdp.accounting.mechanisms` -- the mechanisms (subsampled Gaussian, Laplace) and
  :class:`Release` (a mechanism and its count as a function of epochs);
* :mod:`~lipdp.accounting.plan` -- :class:`PrivacyPlan`, every release of a run, declared
  before it starts (rule S11);
* :mod:`~lipdp.accounting.rdp`, :mod:`~lipdp.accounting.pld` -- the accountants (fast RDP
  with autodp's numbers; PLD with ``dp_accounting``), by name in
  :mod:`~lipdp.accounting.registry`; :mod:`~lipdp.accounting.gdp`, the central-limit
  Gaussian-DP approximation of Bu et al. (flagged: not an upper bound);
* :mod:`~lipdp.accounting.reference` -- :class:`DPGD_Mechanism`, the original package's
  autodp mechanism, kept as the independent reference;
* :mod:`~lipdp.accounting.budget` -- :func:`get_eps_delta`, :func:`get_max_epochs`,
  :func:`calibrate_noise_multiplier` for models.
"""

from lipdp.accounting.budget import (
    calibrate_noise_multiplier,
    epsilon_for_steps,
    get_eps_delta,
    get_max_epochs,
    privacy_plan_of,
    steps_terms,
    training_dp_event,
)
from lipdp.accounting.mechanisms import (
    DYNAMIC_MODES,
    Laplace,
    Release,
    SubsampledGaussian,
    effective_noise_multiplier,
    release_from_config,
)
from lipdp.accounting.plan import GRADIENT_STEPS, PrivacyPlan, dp_event
from lipdp.accounting.pld import PLD_VALUE_DISCRETIZATION_INTERVAL, PLDAccountant
from lipdp.accounting.rdp import RDPAccountant
from lipdp.accounting.reference import DPGD_Mechanism, autodp_epsilon
from lipdp.accounting.registry import (
    clear_caches,
    get_accountant,
    register_accountant,
)

__all__ = [
    "DYNAMIC_MODES",
    "GRADIENT_STEPS",
    "PLD_VALUE_DISCRETIZATION_INTERVAL",
    "DPGD_Mechanism",
    "Laplace",
    "PLDAccountant",
    "PrivacyPlan",
    "RDPAccountant",
    "Release",
    "SubsampledGaussian",
    "autodp_epsilon",
    "calibrate_noise_multiplier",
    "clear_caches",
    "dp_event",
    "effective_noise_multiplier",
    "epsilon_for_steps",
    "get_accountant",
    "get_eps_delta",
    "get_max_epochs",
    "privacy_plan_of",
    "register_accountant",
    "release_from_config",
    "steps_terms",
    "training_dp_event",
]
