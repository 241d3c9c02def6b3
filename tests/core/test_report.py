"""lipdp.core.report: the privacy report states the guarantee and what it rests on."""

import pytest

from lipdp.core.report import privacy_report
from tests.training_helpers import autodp_epsilon, small_model


def test_privacy_report_states_its_assumptions():
    report = privacy_report(small_model(), epochs=5)
    assert report.epsilon == pytest.approx(autodp_epsilon(2.0, 40), rel=1e-5)
    assert report.steps == 40 and report.neighbouring_relation == "add/remove one example"
    assert report.noise_multipliers == [2.0] and "Poisson" in report.sampling_assumption
    assert len(report.sensitivities) == 1
    text = str(report)
    assert "RDP accountant" in text and "q = 0.125" in text and "shuffled" in text


def test_shuffled_training_is_flagged_as_not_proven(caplog):
    import logging

    from lipdp.core import callbacks
    from lipdp.core.callbacks import DP_Accountant
    from tests.training_helpers import B, small_data

    model = small_model()
    assert "NOT A PROVEN GUARANTEE" in privacy_report(model, epochs=1).sampling_assumption
    callbacks._SHUFFLE_WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="lipdp.core.callbacks"):
        for _ in range(2):
            model.fit(*small_data(), batch_size=B, epochs=1, verbose=0, callbacks=[DP_Accountant()])
    assert caplog.text.count("not a proven guarantee for shuffling") == 1  # once per process


def test_one_epoch_is_singular():
    from tests.cases import LAYER_CASES

    model, _, _ = LAYER_CASES["SpectralDense"]()
    assert "(1 epoch, batch" in str(privacy_report(model, epochs=1))
    assert "(2 epochs, batch" in str(privacy_report(model, epochs=2))
