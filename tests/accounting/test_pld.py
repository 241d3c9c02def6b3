"""lipdp.accounting.pld: tighter than RDP, equal to dp_accounting's PLD accountant."""

import itertools

import pytest
from dp_accounting.pld import PLDAccountant as DpAccountingPLD

from lipdp.accounting import (
    Laplace,
    PLDAccountant,
    SubsampledGaussian,
    epsilon_for_steps,
    training_dp_event,
)
from tests.accounting_helpers import DELTA, TUTORIAL_Q


@pytest.mark.parametrize("sigma,q", list(itertools.product((1.0, 2.0, 5.0), (0.001, 0.01))))
def test_pld_is_tighter_than_rdp(sigma, q):
    for steps in (1, 100, 5000):
        rdp = epsilon_for_steps(sigma, q, steps, DELTA, accountant="rdp")
        pld = epsilon_for_steps(sigma, q, steps, DELTA, accountant="pld")
        assert 0 < pld <= rdp * (1 + 1e-6)


@pytest.mark.smoke
def test_pld_accountant_equals_dp_accounting_events():
    config = {"mode": "laplace", "epsilon": 0.05, "num_updates": 3}
    for dynamic in (None, config):
        ours = epsilon_for_steps(2.0, TUTORIAL_Q, 600, DELTA, "pld", dynamic)
        reference = DpAccountingPLD(value_discretization_interval=1e-4)
        reference.compose(training_dp_event(2.0, TUTORIAL_Q, 600, dynamic))
        assert ours == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)


def test_composition_of_several_mechanisms_equals_dp_accounting():
    terms = [(SubsampledGaussian(2.0, TUTORIAL_Q), 300), (Laplace(0.1), 4)]
    ours = PLDAccountant().epsilon(terms, DELTA)
    reference = DpAccountingPLD(value_discretization_interval=1e-4)
    for mechanism, count in terms:
        reference.compose(mechanism.dp_event(), count)
    assert ours == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)
    assert PLDAccountant().epsilon([], DELTA) == 0.0


def test_rejects_bad_interval():
    with pytest.raises(ValueError, match="value_discretization_interval"):
        PLDAccountant(value_discretization_interval=0.0)
