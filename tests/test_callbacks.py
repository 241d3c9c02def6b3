"""DP_Accountant, privacy_report and the lipdp command."""

import csv
import logging

import numpy as np
import pytest
import tensorflow as tf
from autodp import mechanism_zoo, transformer_zoo

from lipdp import cli, losses
from lipdp import layers as L
from lipdp.metadata import DatasetMetadata
from lipdp.model import DP_Accountant, DP_Sequential, DPParameters
from lipdp.report import privacy_report

N, B = 512, 64


def _model(sigma=2.0):
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(6,), upper_bound=1.0), L.DP_QuickSpectralDense(3)],
        dp_parameters=DPParameters("global", sigma, 1e-5),
        dataset_metadata=DatasetMetadata(
            input_shape=(6,), nb_classes=3, nb_samples_train=N, batch_size=B
        ),
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(2.0), optimizer="sgd")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6)).astype("float32")
    return x, np.eye(3, dtype="float32")[rng.integers(0, 3, N)]


def _autodp_epsilon(sigma, steps, delta=1e-5):
    """Independent computation with autodp's transformers."""
    step = transformer_zoo.AmplificationBySampling()(
        mechanism_zoo.GaussianMechanism(sigma=sigma), B / N, improved_bound_flag=True
    )
    return transformer_zoo.Composition()([step], [steps]).get_approxDP(delta=delta)


def test_epsilon_in_logs_history_csv_and_log_fn(tmp_path, caplog):
    model = _model()
    seen = []
    csv_path = tmp_path / "log.csv"
    with caplog.at_level(logging.INFO, logger="lipdp.callbacks"):
        history = model.fit(
            *_data(), batch_size=B, epochs=3, verbose=0,
            callbacks=[DP_Accountant(log_fn=seen.append), tf.keras.callbacks.CSVLogger(csv_path)],
        )  # fmt: skip
    eps = history.history["epsilon"]
    assert eps == pytest.approx([_autodp_epsilon(2.0, 8 * e) for e in (1, 2, 3)], rel=1e-5)
    assert history.history["delta"] == [1e-5] * 3
    assert [r["epoch"] for r in seen] == [1, 2, 3]
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["epsilon"]) == pytest.approx(eps[-1])
    assert "epoch 3: (epsilon" in caplog.text
    # A second fit continues the count (epochs are counted from the optimizer's steps).
    again = model.fit(*_data(), batch_size=B, epochs=1, verbose=0, callbacks=[DP_Accountant()])
    assert again.history["epsilon"][0] == pytest.approx(_autodp_epsilon(2.0, 32), rel=1e-5)


def test_budget_stops_before_exceeding():
    model = _model()
    budget = (_autodp_epsilon(2.0, 8 * 4) + _autodp_epsilon(2.0, 8 * 5)) / 2
    history = model.fit(*_data(), batch_size=B, epochs=50, verbose=0,
                        callbacks=[DP_Accountant(epsilon_budget=budget)])  # fmt: skip
    assert len(history.history["epsilon"]) == 4
    assert max(history.history["epsilon"]) <= budget
    assert int(model.optimizer.iterations.numpy()) == 4 * 8
    with pytest.raises(ValueError, match="One more epoch"):
        _model().fit(*_data(), batch_size=B, epochs=2, verbose=0,
                     callbacks=[DP_Accountant(epsilon_budget=1e-3)])  # fmt: skip


def test_step_count_mismatch_is_refused():
    x, y = _data()
    with pytest.raises(ValueError, match="steps per epoch"):
        _model().fit(x, y, batch_size=B, epochs=1, steps_per_epoch=3, verbose=0,
                     callbacks=[DP_Accountant()])  # fmt: skip


def test_privacy_report_states_its_assumptions():
    report = privacy_report(_model(), epochs=5)
    assert report.epsilon == pytest.approx(_autodp_epsilon(2.0, 40), rel=1e-5)
    assert report.steps == 40 and report.neighbouring_relation == "add/remove one example"
    assert report.noise_multipliers == [2.0] and "Poisson" in report.sampling_assumption
    assert len(report.sensitivities) == 1
    text = str(report)
    assert "RDP accountant" in text and "q = 0.125" in text and "shuffled" in text


def test_cli_train_runs_and_reports(capsys):
    code = cli.main(["train", "--quiet", "--epochs", "2", "--batch-size", "512"])
    out = capsys.readouterr().out
    assert code == 0
    assert "-> 2 epochs" in out and "(epsilon = " in out and "test accuracy:" in out


def test_cli_errors_are_reported(capsys):
    assert cli.main(["train", "--quiet", "--delta", "2"]) == 2
    assert "delta" in capsys.readouterr().err
    assert cli.main(["train", "--quiet", "--epsilon", "1e-6"]) == 2
    assert "epsilon" in capsys.readouterr().err
