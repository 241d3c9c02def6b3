"""lipdp.evaluation.calibration: ECE, MCE, NLL and reliability diagrams on hand-computed values."""

import math

import numpy as np
import pytest

from lipdp.evaluation import calibration

# --------------------------------------------------------------------------- calibration
PROBS = np.array(
    [
        [0.9, 0.05, 0.05],  # label 0: confidence 0.9, correct
        [0.2, 0.7, 0.1],  # label 0: confidence 0.7, wrong
        [0.4, 0.35, 0.25],  # label 0: confidence 0.4, correct
        [0.3, 0.3, 0.4],  # label 1: confidence 0.4, wrong
    ]
)


LABELS = np.array([0, 0, 0, 1])


def test_calibration_errors_hand_values():
    # 2 bins: (0, .5] holds examples 3, 4 (confidence .4, accuracy .5: gap .1);
    # (.5, 1] holds 1, 2 (confidence .8, accuracy .5: gap .3).
    assert calibration.expected_calibration_error(PROBS, LABELS, 2) == pytest.approx(0.2)
    assert calibration.maximum_calibration_error(PROBS, LABELS, 2) == pytest.approx(0.3)
    # 10 bins: .4 -> (.3, .4] (gap .1, 2 examples), .7 -> (.6, .7] (gap .7), .9 -> (.8, .9]
    # (gap .1): ECE = (2 * .1 + .7 + .1) / 4, MCE = .7
    assert calibration.expected_calibration_error(PROBS, LABELS, 10) == pytest.approx(0.25)
    assert calibration.maximum_calibration_error(PROBS, np.eye(3)[LABELS], 10) == pytest.approx(0.7)
    nll = -(math.log(0.9) + math.log(0.2) + math.log(0.4) + math.log(0.3)) / 4
    assert calibration.negative_log_likelihood(PROBS, LABELS) == pytest.approx(nll)
    report = calibration.calibration_report(PROBS, LABELS, 2)
    assert report.as_dict() == pytest.approx({"accuracy": 0.5, "ece": 0.2, "mce": 0.3, "nll": nll})


def test_reliability_diagram_data_and_bin_edges():
    diagram = calibration.reliability_diagram(PROBS, LABELS, 4)
    np.testing.assert_allclose(diagram.edges, [0, 0.25, 0.5, 0.75, 1])
    np.testing.assert_array_equal(diagram.counts, [0, 2, 1, 1])
    np.testing.assert_allclose(diagram.confidence, [np.nan, 0.4, 0.7, 0.9])
    np.testing.assert_allclose(diagram.accuracy, [np.nan, 0.5, 0.0, 1.0])
    # bins are ((m-1)/M, m/M]: a confidence on an edge goes to the lower bin
    edge = np.array([[0.5, 0.5], [0.75, 0.25], [1.0, 0.0]])
    np.testing.assert_array_equal(
        calibration.reliability_diagram(edge, [0, 0, 0], 4).counts, [0, 1, 1, 1]
    )
    # perfectly calibrated toy: 4 predictions at .75 with 3 correct
    calibrated = np.array([[0.75, 0.25]] * 4)
    assert calibration.expected_calibration_error(calibrated, [0, 0, 0, 1], 10) == pytest.approx(
        0.0
    )


def test_reliability_plot_saves_a_png(tmp_path):
    figure = calibration.plot_reliability_diagram(PROBS, LABELS, n_bins=4, title="toy")
    path = tmp_path / "reliability.png"
    figure.savefig(path)
    assert path.stat().st_size > 1000
    assert figure.axes[0].get_title() == "toy: ECE 0.250, MCE 0.700"


def test_reliability_plot_draws_into_given_axes():
    figure = calibration.new_figure((8.0, 4.0))
    left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    under_confident = np.array([[0.6, 0.4]] * 4)  # confidence 0.6, accuracy 1
    assert calibration.plot_reliability_diagram(under_confident, [0] * 4, 5, ax=right) is figure
    assert not left.patches and right.get_title() == "ECE 0.400, MCE 0.400"
    gap = [p for p in right.patches if p.get_hatch() == "//"]
    # the gap bar of the bin (0.4, 0.6] spans from the accuracy 1.0 down to 0.6
    assert len(gap) == 1 and gap[0].get_y() == pytest.approx(1.0)
    assert gap[0].get_height() == pytest.approx(-0.4)
