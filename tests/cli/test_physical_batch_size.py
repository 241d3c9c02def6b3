"""``lipdp train --physical-batch-size P`` (issue 39): the flag reaches the model of either
family, is checked, and a run computing P rows at a time trains."""

import pytest

from lipdp import cli
from lipdp.data import sources
from lipdp.recipes import runs


def test_the_flag_reaches_the_recipe(monkeypatch):
    seen = []

    def stop(run, data=None, strategy=None):
        seen.append(run.model)
        raise RuntimeError("stop")

    monkeypatch.setattr(runs, "prepare", stop)
    with pytest.raises(RuntimeError, match="stop"):
        cli.main(["train", "--physical-batch-size", "7"])
    assert seen[0].physical_batch_size == 7
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        cli.main(["train", "--physical-batch-size", "0"])
    assert refused.value.code == 2


@pytest.mark.parametrize("method", ["lipdp", "dp-sgd"])
def test_the_model_of_either_family_computes_p_rows_at_a_time(method):
    recipe = runs.ModelRecipe(dataset="breast_cancer", method=method, physical_batch_size=7)
    metadata = runs.run_metadata(recipe, sources.load_breast_cancer())
    model = runs.build_model(recipe, metadata)
    assert model.physical_batch_size == 7
    with pytest.raises(ValueError, match="physical_batch_size"):
        runs.ModelRecipe(physical_batch_size=-1)


def test_the_run_line_says_how_many_rows_a_step_computes_at_once():
    from types import SimpleNamespace

    from lipdp.cli import output

    run = SimpleNamespace(model=runs.ModelRecipe(physical_batch_size=64), epsilon=3.0)
    prepared = SimpleNamespace(run=run, epochs=2, x_train=range(1536))
    line = output.run_line("train", prepared)
    assert "batch 512 computed 64 rows at a time," in line
