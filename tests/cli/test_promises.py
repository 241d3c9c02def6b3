"""The promises of ``lipdp`` a user checks (issue 40, "Why 2"): each refusal or warning
through the command's entry point, with the message the user reads."""

import logging
import zipfile

import keras
import pytest

from lipdp import cli
from lipdp.cli import output
from lipdp.foundation import validation
from lipdp.recipes import runs


class _Stop(Exception):
    pass


def _stop_before_building(monkeypatch):
    """``runs.prepare`` replaced by a stop: every check of the command runs, no model is
    built or trained."""

    def stop(run, data=None, strategy=None):
        raise _Stop

    monkeypatch.setattr(runs, "prepare", stop)


def _one_line_error(argv, capsys, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"lipdp {argv[0]}: error: {message}\n"


# ------------------------------------------------------------------------------- delta
def test_delta_at_or_above_one_over_n_is_the_one_rule():
    """delta < 1/N accepted, delta = 1/N and above refused, forced: kept (hand values)."""
    assert validation.delta_for_dataset(0.00099, 1000) == 0.00099
    for value in (0.001, 0.5):
        with pytest.raises(ValueError, match=r"delta 0\.001|delta 0\.5"):
            validation.delta_for_dataset(value, 1000)
    assert validation.delta_for_dataset(0.5, 1000, allow_large=True) == 0.5
    with pytest.raises(ValueError, match="must be in the open interval"):
        validation.delta_for_dataset(1.0, 1000, allow_large=True)


def test_delta_above_one_over_n_is_refused_unless_forced(monkeypatch, capsys):
    """Before: ``--delta 0.5`` trained and reported "(epsilon = ..., delta = 0.5)-DP"."""
    _stop_before_building(monkeypatch)
    _one_line_error(
        ["train", "--delta", "0.5"],
        capsys,
        "--delta 0.5 >= 1/N = 0.000651 (N = 1536 training examples): delta is the "
        "probability the guarantee fails, and with delta >= 1/N a mechanism releasing one "
        "record at random meets it; give --delta below 0.000651 (e.g. 0.0001), or "
        "--allow-large-delta to keep it.",
    )
    with pytest.raises(_Stop):  # forced: accepted, the run goes on to be built
        cli.main(["train", "--delta", "0.5", "--allow-large-delta"])
    with pytest.raises(_Stop):
        cli.main(["train", "--delta", "0.0006"])


# ------------------------------------------------------------------------- budget stop
def test_the_budget_ending_training_is_said(capsys, caplog):
    """Before: ``--epochs 500`` stopped at 46/500 with no word of the budget."""
    argv = ["train", "--quiet", "--epsilon", "0.6", "--epochs", "5"]
    with caplog.at_level(logging.WARNING):
        assert cli.main(argv) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("stopped by the privacy budget")]
    done = int(line.split("after ")[1].split(" of")[0])
    assert 1 <= done < 5 and line.split(" epochs:")[0].endswith(f"{done} of 5")
    assert [x.split(":")[0] for x in out.splitlines() if x.startswith("epoch ")] == [
        f"epoch {e}/5" for e in range(1, done + 1)
    ]
    spent = float(line.split("epsilon = ")[1].split(" ")[0])
    assert spent <= 0.6 and line.endswith(
        "spent of the budget 0.6 (one more epoch would exceed it)"
    )
    assert f"(epsilon = {spent:.4f}, delta = 1e-05)-DP" in out  # the report agrees
    (record,) = [r for r in caplog.records if "privacy budget ended" in r.getMessage()]
    assert record.levelno == logging.WARNING and f"after epoch {done} " in record.getMessage()
    next_epsilon = float(record.getMessage().split("would reach ")[1].split(" ")[0])
    assert next_epsilon > 0.6


# ----------------------------------------------------------------------- dropped rows
def test_rows_dropped_by_shuffled_batches_are_stated(monkeypatch, caplog):
    """Before: only the header's "1000 training examples" said that 536 of 1536 were
    never used."""
    _stop_before_building(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="lipdp.cli"), pytest.raises(_Stop):
        cli.main(["train", "--sampling", "shuffle", "--batch-size", "1000"])
    (record,) = [r for r in caplog.records if r.name == "lipdp.cli"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "--sampling shuffle --batch-size 1000 trains on 1000 of the 1536 training examples "
        "(the 536 left over make no whole batch and are never used): use --batch-size 768 "
        "(it divides 1536), or --sampling poisson (every example)."
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lipdp.cli"), pytest.raises(_Stop):
        cli.main(["train", "--sampling", "shuffle", "--batch-size", "768"])
    assert [r for r in caplog.records if r.name == "lipdp.cli"] == []


# ------------------------------------------------------------------------- --data-dir
def test_a_data_dir_without_the_data_is_refused(tmp_path, capsys):
    """Before: an empty --data-dir fell back to the system's copy of Fashion-MNIST."""
    _one_line_error(
        ["train", "--dataset", "fashion_mnist", "--data-dir", str(tmp_path)],
        capsys,
        f"--data-dir {str(tmp_path)!r} holds no fashion_mnist (the 4 IDX files "
        "(train-images-idx3-ubyte[.gz], ...) or fashion_mnist.npz): give the directory that "
        "holds them, or drop --data-dir to use the places lipdp looks in by default.",
    )


def test_the_loader_s_message_names_the_flag(tmp_path, monkeypatch):
    """The data set found nowhere: the fix names ``--data-dir`` for the command (the
    library's ``data_dir=`` otherwise)."""
    from lipdp.data import sources

    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    monkeypatch.setattr(sources, "keras_cache_dirs", lambda: [])
    monkeypatch.setattr(sources, "_search_tfds", lambda name: (None, "not here"))
    monkeypatch.delenv("LIPDP_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError) as cli_error:
        runs.load_data("fashion_mnist", tmp_path, data_dir_name="--data-dir")
    with pytest.raises(FileNotFoundError) as library_error:
        runs.load_data("fashion_mnist", tmp_path)
    assert f"--data-dir {tmp_path}:" in str(cli_error.value)
    assert "pass --data-dir (or set" in str(cli_error.value)
    assert "data_dir" not in str(cli_error.value)
    assert "pass data_dir= (or set" in str(library_error.value)


# ---------------------------------------------------------------------- --model files
def test_a_file_that_is_not_a_keras_file_is_named_so(tmp_path, capsys):
    """Before: "cannot load a model from ... (File not found: filepath=...)"."""
    garbage = tmp_path / "corrupt.keras"
    garbage.write_bytes(b"not a zip archive")
    _one_line_error(
        ["evaluate", "--model", str(garbage)],
        capsys,
        f"--model: {str(garbage)!r} is not a Keras file (neither a .keras zip archive nor an "
        "HDF5 .h5 file): give a model saved by lipdp train --save or "
        "model.save('name.keras').",
    )
    archive = tmp_path / "other.keras"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("notes.txt", "hello")
    _one_line_error(
        ["evaluate", "--model", str(archive)],
        capsys,
        f"--model: {str(archive)!r} is not a Keras file (a zip archive without the "
        "config.json of a saved model): give a model saved by lipdp train --save or "
        "model.save(...).",
    )


# ---------------------------------------------------------------------- --mirrored
def test_a_batch_not_divisible_by_the_replicas_is_refused_at_once(monkeypatch, capsys):
    """Before: ``--mirrored 2 --batch-size 511`` trained. Refused before any data is read."""

    def no_data(*args, **kwargs):
        raise AssertionError("the data were read before the check")

    monkeypatch.setattr(runs, "load_data", no_data)
    _one_line_error(
        ["train", "--mirrored", "2", "--batch-size", "511"],
        capsys,
        "--batch-size 511 is not divisible by --mirrored 2 (each replica takes an equal "
        "share of the batch): use --batch-size 510 or 512.",
    )


# ------------------------------------------------------------------------------ Ctrl-C
def _interrupt_at(epoch, batch):
    """A stand-in for ``--quiet``'s epoch lines that presses Ctrl-C after ``batch`` of
    ``epoch`` (0-based)."""

    class CtrlC(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_end(self, b, logs=None):
            if (self.epoch, b) == (epoch, batch):
                raise KeyboardInterrupt

    return lambda epochs: CtrlC()


def test_ctrl_c_prints_one_line_and_saves_the_partial_model(tmp_path, monkeypatch, capsys):
    """Before: a 55-108-line traceback. After: where it stopped, the epsilon spent, the
    partial model saved (with its ledger: the same epsilon when reloaded)."""
    from lipdp.core.callbacks import noisy_steps_taken
    from lipdp.core.report import privacy_report

    path = tmp_path / "partial.keras"
    monkeypatch.setattr(output, "epoch_lines", _interrupt_at(epoch=1, batch=0))
    argv = ["train", "--quiet", "--epochs", "3", "--save", str(path)]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    model = keras.models.load_model(path)
    assert noisy_steps_taken(model) == 3 + 1  # 3 steps per epoch (1536 / 512), then one
    report = privacy_report(model)
    assert err == (
        f"lipdp train: interrupted at epoch 2/3, step 1/3: epsilon = {report.epsilon:.4f} "
        f"spent (delta = 1e-05, 2 epoch(s) begun); partial model saved to {path}\n"
    )


def test_ctrl_c_in_the_test_evaluation_keeps_the_trained_model(tmp_path, monkeypatch, capsys):
    """Ctrl-C after the last epoch (in the test evaluation): the training is whole, so its
    epsilon is said and the trained model saved, not lost (before: "interrupted")."""
    from lipdp.core.report import privacy_report

    def interrupted(model, data):
        raise KeyboardInterrupt

    path = tmp_path / "trained.keras"
    monkeypatch.setattr(runs, "metrics_on_test_set", interrupted)
    assert cli.main(["train", "--quiet", "--epochs", "1", "--save", str(path)]) == 130
    report = privacy_report(keras.models.load_model(path))
    assert capsys.readouterr().err == (
        f"lipdp train: interrupted in the test evaluation, after training: epsilon = "
        f"{report.epsilon:.4f} spent (delta = 1e-05, 1 epoch(s) begun); trained model saved "
        f"to {path}\n"
    )


def test_ctrl_c_before_training_is_one_line(monkeypatch, capsys):
    def interrupted(run, data=None, strategy=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "prepare", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == "lipdp train: interrupted\n"


# ------------------------------------------------------------------- flags, not params
def test_messages_name_the_flags(capsys):
    """Before: "... use noisify_strategy='global' (per-layer noise needs per-layer
    clipping)", the Python parameter for the flag the user typed."""
    _one_line_error(
        ["train", "--method", "dp-sgd", "--strategy", "per-layer"],
        capsys,
        "--strategy per-layer needs --clipping per-layer with --method dp-sgd (--clipping "
        "flat bounds the whole gradient, not each layer's): add --clipping per-layer or "
        "drop --strategy.",
    )
