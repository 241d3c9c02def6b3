"""lipdp.recipes.method_settings: which setting applies to which method, decided once and
refused with the same one-line message by the recipes and by the command line."""

import dataclasses

import pytest

from lipdp import cli
from lipdp.cli import arguments
from lipdp.recipes import defaults, method_settings
from lipdp.recipes.recipe_config import ModelRecipe

CLIPLESS = {"lipdp", "lip-dp-sgd"}
DP_SGD = {"dp-sgd"}

#: Written by hand from the networks of lipdp.recipes.model_factory (not read from the
#: table): setting -> (methods whose plain network reads it, methods whose scattering
#: network reads it).
EXPECTED_SCOPES = {
    "clipping": (DP_SGD, DP_SGD),
    "clip_norm": (DP_SGD, DP_SGD),
    "clip_threshold": (DP_SGD, DP_SGD),
    "gradient_method": (DP_SGD, DP_SGD),
    "bam": (DP_SGD, DP_SGD),
    "dp_sat": (DP_SGD, DP_SGD),
    "trades": (DP_SGD, DP_SGD),  # the clipless models refuse TRADES (its KL has no bound)
    "gradient_clip": (CLIPLESS, CLIPLESS),
    "tau": (CLIPLESS, CLIPLESS),
    "weight_norm_bound": (CLIPLESS, CLIPLESS),
    "group_norm": (CLIPLESS, CLIPLESS | DP_SGD),  # every scattering network has one
    "group_norm_alpha": (CLIPLESS, set()),  # the scattering network's alpha is fixed
}

#: The options of a run that every method reads (each needs nothing of another setting
#: but what the recipe checks on its own: --scattering needs images, --data-dir
#: fashion_mnist, a run-level choice).
EVERY_METHOD = {
    "--dataset",
    "--data-dir",
    "--epsilon",
    "--delta",
    "--allow-large-delta",
    "--batch-size",
    "--physical-batch-size",
    "--noise-multiplier",
    "--epochs",
    "--sampling",
    "--method",
    "--scattering",
    "--feature-cache",
    "--averaging",
    "--strategy",
    "--mirrored",
    "--accountant",
    "--learning-rate",
    "--optimizer",
    "--adversarial-radius",
    "--seed",
    "--quiet",
    "--save",
}

#: A value other than the default of each setting of the tables: (option, recipe value).
VALUES = {
    "clipping": ("automatic", "automatic"),
    "clip_norm": ("2", 2.0),
    "clip_threshold": ("5", 5.0),
    "gradient_method": ("jacobian", "jacobian"),
    "bam": ("0.1", 0.1),
    "dp_sat": ("0.1", 0.1),
    "trades": ("2", 2.0),
    "gradient_clip": ("0.5", 0.5),
    "tau": ("2", 2.0),
    "weight_norm_bound": ("2", 2.0),
    "group_norm": ("4", 4),
    "group_norm_alpha": ("0.5", 0.5),
    "momentum": ("0.9", 0.9),
    "adversarial_norm": ("linf", "linf"),
    "adversarial_steps": ("3", 3),
    "adversarial_mix": ("0.5", 0.5),
}


def _flag(setting):
    return "--" + setting.replace("_", "-")


def _conditioned():
    return {s for c in method_settings.CONDITIONS for s in c.settings}


def test_the_table_is_the_hand_written_scopes():
    table = {
        setting: (
            {m for m in defaults.METHODS if scope.reads(m, scattering=False)},
            {m for m in defaults.METHODS if scope.reads(m, scattering=True)},
        )
        for setting, scope in method_settings.METHOD_SCOPES.items()
    }
    assert table == EXPECTED_SCOPES


def test_every_option_of_a_run_is_classified():
    """Each option of ``lipdp train`` is in the method table, or needs another setting
    (the conditions), or applies to every method: a new option must be placed."""
    train = arguments.subcommand_parsers(arguments.make_parser())["train"]
    flags = {_flag(a.dest) for a in train._actions if a.option_strings} - {"--help"}
    scoped = {_flag(s) for s in method_settings.METHOD_SCOPES}
    conditioned = {_flag(s) for s in _conditioned()}
    assert flags == scoped | conditioned | EVERY_METHOD
    assert not (scoped | conditioned) & EVERY_METHOD


def test_help_that_names_a_method_is_in_the_table():
    """An option whose help scopes it to some methods ("dp-sgd only", "lipdp /
    lip-dp-sgd", "with ... dp-sgd") is in the method table."""
    train = arguments.subcommand_parsers(arguments.make_parser())["train"]
    scoped = {_flag(s) for s in method_settings.METHOD_SCOPES}
    markers = ("dp-sgd only", "lipdp / lip-dp-sgd", "dp-sgd and", "dp-sgd --clipping")
    for action in train._actions:
        if action.help and any(marker in action.help for marker in markers):
            assert _flag(action.dest) in scoped, action.option_strings


def test_every_setting_of_the_tables_is_a_recipe_field_and_an_option():
    fields = {f.name for f in dataclasses.fields(ModelRecipe)}
    settings = set(method_settings.METHOD_SCOPES) | _conditioned()
    assert settings <= fields and settings == set(VALUES)
    train = arguments.subcommand_parsers(arguments.make_parser())["train"]
    dests = {a.dest for a in train._actions}
    assert settings <= dests


def _cli_error(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    prefix = f"lipdp {argv[0]}: error: "
    assert err.startswith(prefix) and err.count("\n") == 1
    return err[len(prefix) : -1]


def _recipe_error(**settings):
    with pytest.raises(ValueError) as error:
        ModelRecipe(**settings)
    return str(error.value)


#: (setting, method, scattering) of a run the setting does not apply to: every method
#: outside the setting's scope, on the network where it is refused.
REFUSED = [
    (setting, method, scattering)
    for setting, (plain, on_scattering) in EXPECTED_SCOPES.items()
    for method in defaults.METHODS
    for scattering in (False, True)
    if method not in (on_scattering if scattering else plain)
]


def _same_refusal(setting, method, scattering, capsys):
    """The one line of ``lipdp train`` and of ``ModelRecipe`` for ``setting`` in a run of
    ``method`` (``scattering``), checked equal."""
    option, value = VALUES[setting]
    network = "--scattering" if scattering else "--no-scattering"
    argv = ["train", "--method", method, network, _flag(setting), option]
    from_cli = _cli_error(argv, capsys)
    from_recipe = _recipe_error(method=method, scattering=scattering, **{setting: value})
    assert from_cli == from_recipe, argv
    assert from_cli.startswith(f"{setting} ({_flag(setting)}) "), from_cli


def test_a_setting_of_another_method_is_refused_with_one_message(capsys):
    """The same one line from ``lipdp train`` and from ``ModelRecipe``, for every setting
    of the table and every method (and network) it does not apply to."""
    assert len(REFUSED) == 7 * 2 * 2 + 3 * 2 + 1 + 4  # dp-sgd's, clipless, group norm, alpha
    for setting, method, scattering in REFUSED:
        _same_refusal(setting, method, scattering, capsys)


def test_a_setting_missing_its_condition_is_refused_with_one_message(capsys):
    for setting in sorted(_conditioned()):
        _same_refusal(
            setting, "lipdp" if setting == "group_norm_alpha" else "dp-sgd", False, capsys
        )


#: What each setting needs besides its method, to be accepted.
NEEDS = {
    "clip_threshold": {"clipping": "global"},
    "trades": {"adversarial_radius": 0.1, "gradient_method": "jacobian"},
    "group_norm_alpha": {"group_norm": 4},
}


def test_a_setting_is_accepted_by_the_methods_that_read_it():
    for setting, readers_by_network in EXPECTED_SCOPES.items():
        option, value = VALUES[setting]
        needs = NEEDS.get(setting, {})
        for scattering, readers in zip((False, True), readers_by_network):
            for method in sorted(readers):
                ModelRecipe(method=method, scattering=scattering, **needs, **{setting: value})
                argv = ["train", "--method", method, _flag(setting), option]
                argv.append("--scattering" if scattering else "--no-scattering")
                for name, needed in needs.items():
                    argv += [_flag(name), str(needed)]
                args = arguments.make_parser().parse_args(argv)
                arguments.refuse_inapplicable_options(args, arguments.explicit_options(argv))
