"""lipdp.cli: the lipdp command."""

from lipdp import cli


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


def test_cli_evaluate_trains_saves_and_loads(tmp_path, capsys):
    path = tmp_path / "model.keras"
    argv = ["evaluate", "--epochs", "2", "--quiet", "--radii", "0", "0.1", "--bins", "10"]
    assert cli.main([*argv, "--save", str(path)]) == 0
    trained_output = capsys.readouterr().out
    for text in ("epsilon", "test accuracy", "certified accuracy", "ECE", "AUROC"):
        assert text in trained_output
    assert cli.main(["evaluate", "--model", str(path), "--radii", "0", "0.1", "--bins", "10"]) == 0
    loaded_output = capsys.readouterr().out
    tail = trained_output[trained_output.index("test accuracy") :]
    assert loaded_output[loaded_output.index("test accuracy") :] == tail
