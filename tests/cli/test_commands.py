"""lipdp.cli.commands: the command runs the recipe of its arguments, nothing of its own."""

import dataclasses

import pytest

from lipdp import cli
from lipdp.cli import arguments
from lipdp.recipes import runs


class _Stop(Exception):
    pass


def _spied_run(monkeypatch, argv):
    """The ``RunConfig`` that ``lipdp argv`` hands to the recipes (stopped before any
    model is built)."""
    calls = []

    def spy(run, data=None, strategy=None):
        calls.append(run)
        raise _Stop

    monkeypatch.setattr(runs, "prepare", spy)
    with pytest.raises(_Stop):
        cli.main(argv)
    (run,) = calls
    return run


def test_the_cli_runs_the_recipe_of_its_arguments(monkeypatch):
    argv = ["train", "--quiet", "--epochs", "1", "--method", "dp-sgd", "--clip-norm", "2"]
    argv += ["--clipping", "global", "--clip-threshold", "5", "--seed", "3"]
    run = _spied_run(monkeypatch, argv)
    recipe = runs.ModelRecipe(method="dp-sgd", clipping="global", clip_norm=2, clip_threshold=5)
    assert run == runs.RunConfig(recipe, epochs=1, seed=3)


def test_the_cli_defaults_are_the_recipe_defaults(monkeypatch):
    """No option: the default recipe, for both commands (the same run)."""
    assert _spied_run(monkeypatch, ["train"]) == runs.RunConfig()
    assert _spied_run(monkeypatch, ["evaluate"]) == runs.RunConfig()


def test_every_model_option_sets_the_recipe_field_of_its_name():
    """The options are named after the recipe's fields (all but ``non_private``, which
    only a library user sets), so that ``model_recipe`` can copy them over."""
    train = arguments.subcommand_parsers(arguments.make_parser())["train"]
    dests = {action.dest for action in train._actions}
    fields = {f.name for f in dataclasses.fields(runs.ModelRecipe)}
    assert fields - dests == {"non_private"}
