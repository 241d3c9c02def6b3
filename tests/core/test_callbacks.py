"""lipdp.core.callbacks: DP_Accountant (epsilon in the logs, budget stop, step-count check)."""

import csv
import logging

import pytest
import tensorflow as tf

from lipdp.core.callbacks import DP_Accountant
from tests.training_helpers import B, autodp_epsilon, small_data, small_model


def test_epsilon_in_logs_history_csv_and_log_fn(tmp_path, caplog):
    model = small_model()
    seen = []
    csv_path = tmp_path / "log.csv"
    with caplog.at_level(logging.INFO, logger="lipdp.core.callbacks"):
        history = model.fit(
            *small_data(), batch_size=B, epochs=3, verbose=0,
            callbacks=[DP_Accountant(log_fn=seen.append), tf.keras.callbacks.CSVLogger(csv_path)],
        )  # fmt: skip
    eps = history.history["epsilon"]
    assert eps == pytest.approx([autodp_epsilon(2.0, 8 * e) for e in (1, 2, 3)], rel=1e-5)
    assert history.history["delta"] == [1e-5] * 3
    assert [r["epoch"] for r in seen] == [1, 2, 3]
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["epsilon"]) == pytest.approx(eps[-1])
    assert "epoch 3: (epsilon" in caplog.text
    # A second fit continues the count (epochs are counted from the optimizer's steps).
    again = model.fit(*small_data(), batch_size=B, epochs=1, verbose=0, callbacks=[DP_Accountant()])
    assert again.history["epsilon"][0] == pytest.approx(autodp_epsilon(2.0, 32), rel=1e-5)


def test_budget_stops_before_exceeding():
    model = small_model()
    budget = (autodp_epsilon(2.0, 8 * 4) + autodp_epsilon(2.0, 8 * 5)) / 2
    history = model.fit(*small_data(), batch_size=B, epochs=50, verbose=0,
                        callbacks=[DP_Accountant(epsilon_budget=budget)])  # fmt: skip
    assert len(history.history["epsilon"]) == 4
    assert max(history.history["epsilon"]) <= budget
    assert int(model.optimizer.iterations.numpy()) == 4 * 8
    with pytest.raises(ValueError, match="One more epoch"):
        small_model().fit(*small_data(), batch_size=B, epochs=2, verbose=0,
                     callbacks=[DP_Accountant(epsilon_budget=1e-3)])  # fmt: skip


def test_step_count_mismatch_is_refused():
    x, y = small_data()
    with pytest.raises(ValueError, match="steps per epoch"):
        small_model().fit(x, y, batch_size=B, epochs=1, steps_per_epoch=3, verbose=0,
                     callbacks=[DP_Accountant()])  # fmt: skip
