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


def test_budget_stop_is_a_warning_with_the_numbers(caplog):
    """The budget ending ``fit`` early is said at WARNING (epochs done, epsilon spent, the
    budget) and kept in ``stopped_by_budget``; a fit whose last epoch is the last within
    the budget ends as planned, without the warning. (Before: one INFO line only.)"""
    budget = (autodp_epsilon(2.0, 8 * 2) + autodp_epsilon(2.0, 8 * 3)) / 2
    accountant = DP_Accountant(epsilon_budget=budget)
    with caplog.at_level(logging.WARNING, logger="lipdp.core.callbacks"):
        small_model().fit(*small_data(), batch_size=B, epochs=5, verbose=0,
                          callbacks=[accountant])  # fmt: skip
    (record,) = [r for r in caplog.records if "privacy budget" in r.getMessage()]
    assert record.levelno == logging.WARNING
    spent = autodp_epsilon(2.0, 8 * 2)
    assert accountant.stopped_by_budget[0] == 2
    assert accountant.stopped_by_budget[1] == pytest.approx(spent, rel=1e-5)
    assert record.getMessage().startswith(
        f"the privacy budget ended training after epoch 2 (2 of the 5 of this fit): "
        f"epsilon = {spent:.4g} spent, and epoch 3 would reach "
        f"{autodp_epsilon(2.0, 8 * 3):.4g} > the budget {budget:g}."
    )
    caplog.clear()
    planned = DP_Accountant(epsilon_budget=budget)
    with caplog.at_level(logging.WARNING, logger="lipdp.core.callbacks"):
        small_model().fit(*small_data(), batch_size=B, epochs=2, verbose=0,
                          callbacks=[planned])  # fmt: skip
    assert planned.stopped_by_budget is None and "privacy budget" not in caplog.text


def test_log_fn_takes_the_original_package_s_names(caplog):
    """``log_fn="logging"`` (the original ``deel.lipdp``'s name; before: ``TypeError: log_fn
    must be callable``) logs each epoch's ``{"epoch", "epsilon", "delta"}`` at INFO;
    ``"wandb"``/``"all"`` need wandb (one line if absent); another string is refused."""
    import importlib.util

    with caplog.at_level(logging.INFO, logger="lipdp.core.callbacks"):
        history = small_model().fit(*small_data(), batch_size=B, epochs=2, verbose=0,
                                    callbacks=[DP_Accountant(log_fn="logging")])  # fmt: skip
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("{'epoch'")]
    epsilons = history.history["epsilon"]
    assert logged == [
        str({"epoch": e + 1, "epsilon": epsilons[e], "delta": 1e-5}) for e in range(2)
    ]
    if importlib.util.find_spec("wandb") is None:
        for name in ("wandb", "all"):
            with pytest.raises(ImportError) as info:
                DP_Accountant(log_fn=name)
            assert str(info.value) == (
                f"log_fn={name!r} needs wandb, which is not installed: pip install wandb, "
                "or use log_fn='logging'."
            )
    with pytest.raises(ValueError, match="log_fn must be a callable or one of 'logging'"):
        DP_Accountant(log_fn="print")
