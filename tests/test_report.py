"""lipdp.report: the privacy report states the guarantee and what it rests on."""

import pytest

from lipdp.report import privacy_report
from tests.training_helpers import autodp_epsilon, small_model


def test_privacy_report_states_its_assumptions():
    report = privacy_report(small_model(), epochs=5)
    assert report.epsilon == pytest.approx(autodp_epsilon(2.0, 40), rel=1e-5)
    assert report.steps == 40 and report.neighbouring_relation == "add/remove one example"
    assert report.noise_multipliers == [2.0] and "Poisson" in report.sampling_assumption
    assert len(report.sensitivities) == 1
    text = str(report)
    assert "RDP accountant" in text and "q = 0.125" in text and "shuffled" in text
