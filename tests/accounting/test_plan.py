"""lipdp.accounting.plan and lipdp.accounting.registry: the privacy plan of a run."""

import logging
import math

import pytest

from lipdp.accounting import (
    GRADIENT_STEPS,
    Laplace,
    PrivacyPlan,
    Release,
    SubsampledGaussian,
    autodp_epsilon,
    epsilon_for_steps,
    get_accountant,
    register_accountant,
)
from tests.accounting_helpers import DELTA, TUTORIAL_Q


def tutorial_plan(sigma=2.0, others=()):
    return PrivacyPlan.for_training(
        noise_multipliers=sigma,
        sampling_rate=TUTORIAL_Q,
        steps_per_epoch=60,
        delta=DELTA,
        other_releases=others,
    )


def test_plan_of_dp_sgd_is_its_steps():
    plan = tutorial_plan()
    assert plan.terms(91) == ((SubsampledGaussian(2.0, TUTORIAL_Q), 91 * 60),)
    assert plan.steps(91) == 5460
    assert plan.epsilon(91) == pytest.approx(2.98762, abs=1e-4)
    assert plan.epsilon(0) == 0.0
    assert plan.describe(2) == [
        {
            "release": GRADIENT_STEPS,
            "mechanism": SubsampledGaussian(2.0, TUTORIAL_Q).describe(),
            "count": 120,
        }
    ]


def test_equal_mechanisms_are_merged_and_distinct_ones_composed():
    step = SubsampledGaussian(2.0, TUTORIAL_Q)
    same = Release(step, "quantile counts", per_round=1, patience=2)
    plan = tutorial_plan(others=(same, Release(Laplace(0.1), "clip", per_round=1)))
    assert plan.terms(4) == ((step, 4 * 60 + 2), (Laplace(0.1), 4))
    expected = autodp_epsilon([(step, 242), (Laplace(0.1), 4)], DELTA)
    assert plan.epsilon(4) == pytest.approx(expected, rel=1e-6)


def test_max_epochs_safe_unsafe_and_unbounded(caplog):
    plan = tutorial_plan()
    assert plan.max_epochs(3.0) == 91
    assert plan.max_epochs(3.0, safe=False) == 92  # eps(92) = 3.0046 <= 3 + 1e-2
    assert plan.max_epochs(3.0, safe=False, atol=1e-3) == 91
    assert plan.max_epochs(3.0, epochs_max=None) == 91
    assert plan.max_epochs(30.0, epochs_max=None) == plan.max_epochs(30.0, epochs_max=100_000)
    with caplog.at_level(logging.WARNING, logger="lipdp.accounting.plan"):
        assert plan.max_epochs(3.0, epochs_max=50) == 50
    assert "epochs_max" in caplog.text
    with pytest.raises(ValueError, match="One epoch already costs"):
        plan.max_epochs(0.1)
    with pytest.raises(ValueError, match="epochs_max"):
        plan.max_epochs(3.0, epochs_max=0)


def test_with_noise_multiplier_keeps_the_coefficients():
    # Per-layer: sigma * (1, 2); the plan for sigma' = sigma' * (1, 2).
    plan = PrivacyPlan.for_training(
        noise_multipliers=[1.5, 3.0],
        sampling_rate=0.01,
        steps_per_epoch=10,
        delta=DELTA,
        noise_multiplier=1.5,
    )
    other = plan.with_noise_multiplier(3.0)
    assert other.noise_multipliers == (3.0, 6.0)
    assert other.epsilon(5) == pytest.approx(epsilon_for_steps([3.0, 6.0], 0.01, 50, DELTA))
    with pytest.raises(ValueError, match="noise_multiplier is needed"):
        PrivacyPlan.for_training(
            noise_multipliers=[1.0, 2.0], sampling_rate=0.1, steps_per_epoch=1, delta=DELTA
        )


def test_non_private_plan():
    plan = PrivacyPlan.for_training(
        noise_multipliers=1.0, sampling_rate=0.1, steps_per_epoch=3, delta=DELTA, non_private=True
    )
    assert plan.epsilon(0) == 0.0
    assert plan.epsilon(2) == math.inf
    with pytest.raises(ValueError, match="non_private"):
        plan.max_epochs(3.0)
    with pytest.raises(ValueError, match="non-private"):
        plan.with_noise_multiplier(2.0)


class AutodpAccountant:
    """A third accountant, registered by name: autodp itself (slow, independent)."""

    name = "autodp"

    def __init__(self):
        self.calls = 0

    def epsilon(self, terms, delta):
        self.calls += 1
        return autodp_epsilon(terms, delta)


def test_registry_resolves_names_and_accepts_new_accountants(monkeypatch):
    from lipdp.accounting import registry

    # A private copy of the registry: other tests (the CLI's choices) see the built-ins.
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    accountant = AutodpAccountant()
    register_accountant("autodp-test", accountant)
    plan = tutorial_plan()
    assert plan.epsilon(10, accountant="autodp-test") == pytest.approx(plan.epsilon(10), rel=1e-6)
    assert accountant.calls == 1
    assert get_accountant(accountant) is accountant
    with pytest.raises(ValueError, match="accountant"):
        plan.epsilon(3, accountant="moments")
    with pytest.raises(TypeError, match="epsilon"):
        register_accountant("broken", object())
