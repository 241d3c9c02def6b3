"""lipdp.cli: the lipdp command, its errors and its output."""

import dataclasses
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from lipdp import cli
from lipdp.cli import arguments, devices
from lipdp.recipes import defaults, runs

MISUSES = [
    (["train", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
    (["train", "--batch-size", "-3"], "argument --batch-size: must be an integer >= 1"),
    (
        ["train", "--noise-multiplier", "0"],
        "argument --noise-multiplier: must be a finite number > 0",
    ),
    (["train", "--learning-rate", "0"], "argument --learning-rate: must be a finite number > 0"),
    (["train", "--epochs", "0"], "argument --epochs: must be an integer >= 1"),
    (["train", "--epochs", "1.5"], "argument --epochs: must be an integer >= 1"),
    (["train", "--delta", "2"], "argument --delta: must be a number in (0, 1)"),
    (["train", "--epsilon", "-1"], "argument --epsilon: must be a finite number > 0"),
    (["train", "--epsilon", "inf"], "argument --epsilon: must be a finite number > 0"),
    (["train", "--data-dir", "/nonexistent"], "argument --data-dir: no such directory"),
    (["train", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["evaluate", "--model", "/nonexistent.keras"], "argument --model: no such file"),
    (["evaluate", "--save", "model.h5"], "argument --save: must end with .keras"),
    (["train", "--save", "/nonexistent/m.keras"], "argument --save: no such directory"),
    (["evaluate", "--bins", "0"], "argument --bins: must be an integer >= 1"),
    (["evaluate", "--radii", "-0.1"], "argument --radii: must be a finite number >= 0"),
    (["train", "--method", "clipping"], "argument --method: invalid choice: 'clipping'"),
    (["train", "--momentum", "1"], "argument --momentum: must be a number in [0, 1)"),
    (["train", "--optimizer", "rmsprop"], "argument --optimizer: invalid choice: 'rmsprop'"),
    (
        ["train", "--weight-norm-bound", "0"],
        "argument --weight-norm-bound: must be a finite number > 0",
    ),
    (["train", "--group-norm", "0"], "argument --group-norm: must be an integer >= 1"),
    (
        ["train", "--group-norm-alpha", "-1"],
        "argument --group-norm-alpha: must be a finite number > 0",
    ),
    (["train", "--averaging", "1"], "argument --averaging: must be a number in [0, 1)"),
    (["train", "--clipping", "median"], "argument --clipping: invalid choice: 'median'"),
    (["train", "--clip-norm", "0"], "argument --clip-norm: must be a finite number > 0"),
    (["train", "--bam", "0.1", "--dp-sat", "0.1"], "argument --dp-sat: not allowed with"),
    (["train", "--bam", "0"], "argument --bam: must be a finite number > 0"),
    (
        ["train", "--adversarial-radius", "0"],
        "argument --adversarial-radius: must be a finite number > 0",
    ),
    (["train", "--adversarial-mix", "0"], "argument --adversarial-mix: must be a number in (0, 1]"),
    (["train", "--adversarial-norm", "l1"], "argument --adversarial-norm: invalid choice: 'l1'"),
    (["evaluate", "--attack-steps", "-1"], "argument --attack-steps: must be an integer >= 0"),
    (["evaluate", "--attack-norms", "l3"], "argument --attack-norms: invalid choice: 'l3'"),
]


@pytest.mark.parametrize(
    "argv,message", MISUSES, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_misuse_is_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lipdp {argv[0]}: error: {message}")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "--batch-size", "100000"], "--batch-size 100000 exceeds the 1536"),
        (["train", "--epsilon", "1e-6"], "One epoch already costs epsilon="),
        (["evaluate", "--model", "README.md"], "--model: 'README.md' is not a Keras file"),
        (
            ["train", "--method", "dp-sgd", "--clipping", "global"],
            "--clipping global needs --clip-threshold Z",
        ),
        (["train", "--bam", "0.1"], "bam (--bam) applies to method dp-sgd only"),
        (["train", "--momentum", "0.9"], "momentum (--momentum) applies to optimizer sgd only"),
        (
            ["train", "--method", "dp-sgd", "--gradient-clip", "0.1"],
            "gradient_clip (--gradient-clip) applies to the clipless methods",
        ),
        (["train", "--dataset", "breast_cancer", "--scattering"], "--scattering needs images"),
        (
            ["train", "--dataset", "fashion_mnist", "--optimizer", "adam"],
            "--optimizer adam needs --learning-rate: the default 16 is the SGD rate",
        ),
        (["train", "--method", "dp-sgd", "--trades", "2"], "trades (--trades) needs adversarial"),
        (
            ["train", "--adversarial-radius", "0.1", "--trades", "2"],
            "trades (--trades) applies to method dp-sgd only",
        ),
        (
            ["train", "--method", "dp-sgd", "--adversarial-radius", "0.1", "--trades", "2"],
            "TRADES couples two forward passes",
        ),
    ],
)
def test_runtime_errors_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lipdp {argv[0]}: error: {message}")
    assert "Traceback" not in err


def test_cli_trains_lip_dp_sgd_on_breast_cancer(capsys):
    argv = [
        "train",
        "--method",
        "lip-dp-sgd",
        "--dataset",
        "breast_cancer",
        "--quiet",
        "--weight-norm-bound",
        "2",
        "--group-norm",
        "4",
        "--group-norm-alpha",
        "0.5",
        "--averaging",
        "0.9",
        "--epochs",
        "2",
        "--delta",
        "0.002",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "breast_cancer, 455 training examples" in out
    assert "method lip-dp-sgd (Lipschitz network, weight norm bound 2, tau 8, " in out
    assert "(114 examples" in out


def test_cli_choices_are_the_library_s():
    from lipdp.accounting.registry import _REGISTRY
    from lipdp.clipped.model import CLIPPING_MODES
    from lipdp.clipped.per_example import GRADIENT_METHODS

    actions = {a.dest: a for a in arguments.make_parser()._subparsers._group_actions[0].choices[
        "train"]._actions}  # fmt: skip
    assert tuple(actions["clipping"].choices) == CLIPPING_MODES
    assert tuple(actions["gradient_method"].choices) == GRADIENT_METHODS
    assert set(actions["accountant"].choices) == set(_REGISTRY)


def test_cli_trains_clipped_dp_sgd(capsys):
    argv = [
        "train", "--method", "dp-sgd", "--dataset", "breast_cancer", "--quiet",
        "--clipping", "automatic", "--clip-norm", "0.5", "--epochs", "2", "--delta", "0.002",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "method dp-sgd (automatic clipping, R = 0.5)" in out
    # R / b = 0.5 / 64, times the round-off slack
    assert "all variables (automatic clipping): 0.007813" in out


def test_cli_trains_dp_sgd_with_bam_and_per_layer_clipping(capsys):
    argv = [
        "train", "--method", "dp-sgd", "--dataset", "breast_cancer", "--quiet",
        "--clipping", "per-layer", "--strategy", "per-layer", "--bam", "0.1",
        "--epochs", "1", "--delta", "0.002",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "method dp-sgd (per-layer clipping, R = 1, BAM lambda = 0.1)" in out
    # two Dense layers, R_l = 1 / sqrt(2), / b = 64, times the round-off slack
    assert out.count("(per-layer clipping): 0.01105") == 2


# One family per case; dp-sgd's (2-3 s, the same flags and report as lipdp's; adversarial
# DP-SGD training itself is in tests/core/test_adversarial.py) runs in make test-slow.
_LIPDP_THEN_SLOW_DP_SGD = ["lipdp", pytest.param("dp-sgd", marks=pytest.mark.slow)]


@pytest.mark.parametrize("method", _LIPDP_THEN_SLOW_DP_SGD)
def test_cli_trains_adversarially_in_both_families(method, capsys):
    """--adversarial-*: the PGD of the run is stated, kept in the data's range, and the
    report notes it (epsilon unchanged: tests/core/test_adversarial.py)."""
    common = ["--dataset", "breast_cancer", "--quiet", "--epochs", "1", "--delta", "0.002"]
    attack = ["--adversarial-radius", "0.1", "--adversarial-norm", "linf"]
    attack += ["--adversarial-steps", "3", "--adversarial-mix", "0.5"]
    assert cli.main(["train", "--method", method, *common, *attack]) == 0
    out = capsys.readouterr().out
    described = "adversarial PGD linf radius 0.1, 3 steps of 0.0833, random start, mix 0.5"
    assert described in out and "box (-1.0, 1.0)" in out
    assert "note: adversarial training (PGD linf radius 0.1" in out


def _digits_model(**options):
    """The CLI's model for digits (batch 256, sigma 2, fixed-size batches) with these
    recipe options."""
    from lipdp.data import sources as datasets

    recipe = runs.ModelRecipe(
        dataset="digits", batch_size=256, noise_multiplier=2.0, delta=1e-3, sampling="shuffle"
    )
    recipe = dataclasses.replace(recipe, **options)
    return runs.model_and_arrays(recipe, datasets.load_digits())[0]


@pytest.mark.parametrize("method", _LIPDP_THEN_SLOW_DP_SGD)  # dp-sgd's: ~3 s
def test_cli_trains_scattering_models_in_both_families(method, capsys):
    from lipdp.clipless.layers import DP_ScatteringTransform

    model = _digits_model(method=method, scattering=True)
    assert any(isinstance(layer, DP_ScatteringTransform) for layer in model.layers)
    argv = ["train", "--method", method, "--scattering", "--quiet", "--epochs", "1"]
    assert cli.main(argv) == 0
    assert "epsilon" in capsys.readouterr().out


def test_cli_trains_with_sgd_and_momentum(capsys):
    for method in ("lipdp", "dp-sgd"):
        model = _digits_model(learning_rate=0.3, method=method, optimizer="sgd", momentum=0.9)
        config = model.optimizer.get_config()
        # (the class, not config["name"]: Keras 3 names an SGD optimizer "sgd", Keras 2 "SGD")
        assert type(model.optimizer).__name__ == "SGD"
        assert config["momentum"] == pytest.approx(0.9)
        assert config["learning_rate"] == pytest.approx(0.3)
    argv = ["train", "--optimizer", "sgd", "--momentum", "0.9", "--quiet", "--epochs", "1"]
    assert cli.main(argv) == 0
    assert "epsilon" in capsys.readouterr().out


def test_cli_gradient_clip_bounds_the_logit_gradient(capsys):
    from lipdp.clipless.layers import DP_ClipGradient
    from lipdp.clipless.model import compute_gradient_bounds

    bounds = {}
    for clip in (math.inf, 0.05):  # math.inf: no clipping (--gradient-clip none)
        model = _digits_model(gradient_clip=clip, scattering=False)
        last = model.layers[-1]
        assert isinstance(last, DP_ClipGradient) == (clip != math.inf)
        bounds[clip] = list(compute_gradient_bounds(model).values())
    # Every parameter bound is X * (clipped G): 0.05 over the loss's own bound (tau CE:
    # sqrt(2) at the logits), the same ratio for every layer.
    ratios = [float(c / u) for c, u in zip(bounds[0.05], bounds[math.inf])]
    assert ratios == pytest.approx([0.05 / np.sqrt(2)] * len(ratios), rel=1e-5)
    argv = ["train", "--gradient-clip", "0.5", "--quiet", "--epochs", "1"]
    assert cli.main(argv) == 0
    assert "logit gradients clipped at 0.5" in capsys.readouterr().out


def test_cli_model_follows_the_method_flags():
    from lipdp.clipless import layers as L
    from lipdp.data import sources as datasets

    data = datasets.load_breast_cancer()
    params = dict(noise_multiplier=2.0, delta=1e-3)
    recipe = runs.ModelRecipe(
        dataset="breast_cancer",
        batch_size=64,
        sampling="poisson",
        method="lip-dp-sgd",
        weight_norm_bound=3.0,
        group_norm=4,
        group_norm_alpha=0.2,
        **params,
    )
    model, x, _ = runs.model_and_arrays(recipe, data)
    kernels = [layer for layer in model.dp_layers if hasattr(layer, "adaptive_norm")]
    assert len(kernels) == 2 and len(x) == 455
    assert all(k.adaptive_norm and k.weight_norm_bound == 3.0 for k in kernels)
    assert all(k.constraint == "spectral" for k in kernels)
    assert any(isinstance(layer, L.DP_GroupNormalization) for layer in model.dp_layers)
    recipe = runs.ModelRecipe(
        dataset="digits",
        batch_size=512,
        sampling="shuffle",
        weight_norm_bound=2.0,
        scattering=False,
        **params,
    )
    fixed, _, _ = runs.model_and_arrays(recipe, datasets.load_digits())
    kernels = [layer for layer in fixed.dp_layers if hasattr(layer, "adaptive_norm")]
    assert all(not k.adaptive_norm and k.constraint == "orthogonal" for k in kernels)
    assert all(k.weight_norm_bound == 2.0 for k in kernels)


def test_cli_train_runs_and_reports(capsys):
    code = cli.main(["train", "--quiet", "--epochs", "3", "--batch-size", "512"])
    out = capsys.readouterr().out
    assert code == 0
    assert "-> 3 epochs" in out and "(epsilon = " in out and "test accuracy:" in out
    lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert all("epsilon" in line for line in lines) and "s to go" in lines[1]
    assert "exactly as trained" in out  # Poisson sampling by default


def test_importing_the_command_imports_neither_tensorflow_nor_keras():
    """The command silences TensorFlow's native start-up lines before TensorFlow is first
    imported: importing ``lipdp.cli`` (``python -m lipdp.cli``) must not import it."""
    code = "import sys, lipdp.cli; print(sorted({'tensorflow', 'keras'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_no_native_start_up_lines_in_a_real_process():
    """A real process: TensorFlow's C++/absl lines (fd 2) are silenced, --quiet prints one
    line per epoch, stderr stays empty."""
    env = dict(os.environ)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run(
        [sys.executable, "-m", "lipdp.cli", "train", "--quiet", "--epochs", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "epoch 2/2:" in result.stdout


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
@pytest.mark.parametrize(
    "argv",
    [["-c", "import lipdp"], ["-m", "lipdp.cli", "train", "--help"]],
    ids=["import", "help"],
)
def test_import_and_help_write_nothing_to_stderr(argv, backend):
    """A real process without TF_CPP_MIN_LOG_LEVEL: ``import lipdp`` and ``lipdp train
    --help`` import no TensorFlow (no C++ start-up lines, no CUDA ``E0000`` line on a CPU
    machine) and no JAX (no GPU notice)."""
    env = {**os.environ, "KERAS_BACKEND": backend}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env,
        cwd=Path(__file__).parents[2], timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert ("usage: lipdp train" in result.stdout) == ("--help" in argv)


def test_cli_evaluate_trains_saves_and_loads(tmp_path, capsys):
    path = tmp_path / "model.keras"
    argv = ["evaluate", "--epochs", "2", "--quiet", "--radii", "0", "0.1", "--bins", "10"]
    assert cli.main([*argv, "--save", str(path)]) == 0
    trained_output = capsys.readouterr().out
    for text in ("epsilon", "test accuracy", "certified accuracy", "ECE", "AUROC"):
        assert text in trained_output
    assert "radius | pgd l2 | certified l2" in trained_output
    assert cli.main(["evaluate", "--model", str(path), "--radii", "0", "0.1", "--bins", "10"]) == 0
    loaded_output = capsys.readouterr().out
    tail = trained_output[trained_output.index("test accuracy") :]
    assert loaded_output[loaded_output.index("test accuracy") :] == tail


# Two trainings (about 30 s on 2 idle cores); tests/core/test_distribute.py covers mirrored
# training itself in the default run.
@pytest.mark.slow
def test_cli_mirrored_training_reports_the_single_device_epsilon(capsys):
    """--mirrored 2 (the two logical CPU devices of conftest.py): the same epsilon per
    epoch as one device, the replicas named; more devices than exist: a one-line error."""
    argv = ["train", "--quiet", "--epochs", "1", "--batch-size", "512"]
    assert cli.main([*argv, "--mirrored", "2"]) == 0
    mirrored = capsys.readouterr().out
    assert cli.main(argv) == 0
    single = capsys.readouterr().out
    assert "batch 512, 2 replicas" in mirrored and "replicas" not in single

    def epsilons(out):
        lines = [line for line in out.splitlines() if line.startswith("epoch")]
        return [line.split("epsilon")[1].split("(")[0] for line in lines]  # not the time

    assert epsilons(mirrored) == epsilons(single) and len(epsilons(single)) == 1
    # More than the 2 devices: refused, by the core count (on 2 cores) or because
    # conftest.py's split had already started 2 devices (on more).
    assert cli.main([*argv, "--mirrored", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lipdp train: error: --mirrored 3: ")


# A flag the run would ignore: (argv, the one-line refusal). Refused before any training.
# The settings of a method are refused with the recipes' message (name and flag).
_DP_SGD_ONLY = (
    "{s} ({f}) applies to method dp-sgd only (method {m} clips no gradient: its "
    "sensitivities come from the layers' Lipschitz bounds): drop it or set method dp-sgd."
)
_NEEDS_RADIUS = (
    "{s} ({f}) needs adversarial_radius (the ball of its attack; without it there is no "
    "adversarial training): set adversarial_radius or drop it."
)
_SAVED_MODEL = (
    "{f} configures training, and evaluate --model evaluates a saved model without "
    "training: drop {f}."
)
_ATTACK_OFF = (
    "{f} applies to the PGD attack, which --attack-steps 0 turns off: drop {f} or give "
    "--attack-steps N >= 1."
)
_CLIPLESS_ONLY = (
    "{s} ({f}) applies to the clipless methods (lipdp, lip-dp-sgd) only ({why}): drop it or "
    "set method lipdp or lip-dp-sgd."
)
_NO_GROUP_NORM_IN_DP_SGD = (
    "group_norm (--group-norm) applies to the clipless methods (lipdp, lip-dp-sgd) and to the "
    "scattering network only (dp-sgd's plain network has no group normalisation): drop it or "
    "set scattering."
)
_TAU_IN_DP_SGD = _CLIPLESS_ONLY.format(
    s="tau",
    f="--tau",
    why="the temperature of the clipless loss DP_TauCategoricalCrossentropy; dp-sgd trains "
    "with the cross-entropy of the logits",
)
_SCATTERING_ALPHA = (
    "group_norm_alpha (--group-norm-alpha) does not apply to the scattering network (its "
    "group normalisation has its own alpha, lipdp.recipes.zoo.SCATTERING_ALPHA): drop it."
)
_MOMENTUM = (
    "momentum (--momentum) applies to optimizer sgd only (Adam keeps its own moment "
    "estimates): drop it or set optimizer sgd."
)
_NO_ASCENT = (
    "{s} ({f}) applies to method dp-sgd only (the clipless methods have no sharpness-aware "
    "step): drop it or set method dp-sgd."
)
_TRADES_CLIPLESS = (
    "trades (--trades) applies to method dp-sgd only (the gradient of the TRADES KL term "
    "with respect to the clean logits has no bound in a clipless network): drop it or set "
    "method dp-sgd."
)
INAPPLICABLE = [
    (["train", "--clip-norm", "2"], _DP_SGD_ONLY.format(m="lipdp", s="clip_norm", f="--clip-norm")),
    (
        ["train", "--method", "lip-dp-sgd", "--clipping", "automatic"],
        _DP_SGD_ONLY.format(m="lip-dp-sgd", s="clipping", f="--clipping"),
    ),
    (
        ["train", "--clip-threshold", "5"],
        _DP_SGD_ONLY.format(m="lipdp", s="clip_threshold", f="--clip-threshold"),
    ),
    (
        ["train", "--gradient-method", "jacobian"],
        _DP_SGD_ONLY.format(m="lipdp", s="gradient_method", f="--gradient-method"),
    ),
    (
        ["train", "--method", "dp-sgd", "--clip-threshold", "5"],
        "clip_threshold (--clip-threshold) applies to clipping global only (flat clipping "
        "drops no example): drop it or set clipping global.",
    ),
    (["train", "--bam", "0.1"], _NO_ASCENT.format(s="bam", f="--bam")),
    (
        ["train", "--method", "lip-dp-sgd", "--dp-sat", "0.1"],
        _NO_ASCENT.format(s="dp_sat", f="--dp-sat"),
    ),
    (
        ["train", "--method", "dp-sgd", "--gradient-clip", "0.1"],
        _CLIPLESS_ONLY.format(
            s="gradient_clip",
            f="--gradient-clip",
            why="dp-sgd clips each example's parameter gradient at clip_norm instead",
        ),
    ),
    (
        ["train", "--method", "dp-sgd", "--weight-norm-bound", "2"],
        _CLIPLESS_ONLY.format(
            s="weight_norm_bound",
            f="--weight-norm-bound",
            why="dp-sgd's layers have unconstrained kernels; their gradients are clipped at "
            "clip_norm",
        ),
    ),
    (["train", "--method", "dp-sgd", "--group-norm", "4"], _NO_GROUP_NORM_IN_DP_SGD),
    (
        ["train", "--method", "dp-sgd", "--group-norm-alpha", "0.5"],
        _CLIPLESS_ONLY.format(
            s="group_norm_alpha",
            f="--group-norm-alpha",
            why="dp-sgd's plain network has no group normalisation",
        ),
    ),
    (
        ["train", "--no-scattering", "--group-norm-alpha", "0.5"],
        "group_norm_alpha (--group-norm-alpha) needs group_norm (without it the network has "
        "no group normalisation): set group_norm or drop it.",
    ),
    (["train", "--scattering", "--group-norm", "9", "--group-norm-alpha", "2"], _SCATTERING_ALPHA),
    (["train", "--group-norm-alpha", "2"], _SCATTERING_ALPHA),  # digits: scattering by default
    (["train", "--method", "dp-sgd", "--tau", "2"], _TAU_IN_DP_SGD),
    (["train", "--method", "dp-sgd", "--scattering", "--group-norm-alpha", "2"], _SCATTERING_ALPHA),
    (["train", "--momentum", "0.9"], _MOMENTUM),
    (["train", "--momentum", "0"], _MOMENTUM),  # typed, even at its default value
    (
        ["train", "--adversarial-norm", "linf"],
        _NEEDS_RADIUS.format(s="adversarial_norm", f="--adversarial-norm"),
    ),
    (
        ["train", "--adversarial-steps", "3"],
        _NEEDS_RADIUS.format(s="adversarial_steps", f="--adversarial-steps"),
    ),
    (
        ["train", "--adversarial-mix", "0.5"],
        _NEEDS_RADIUS.format(s="adversarial_mix", f="--adversarial-mix"),
    ),
    (
        ["train", "--method", "dp-sgd", "--trades", "2"],
        _NEEDS_RADIUS.format(s="trades", f="--trades"),
    ),
    (["train", "--trades", "2"], _TRADES_CLIPLESS),  # the method is checked first
    (["train", "--adversarial-radius", "0.1", "--trades", "2"], _TRADES_CLIPLESS),
    (
        ["train", "--method", "dp-sgd", "--adversarial-radius", "0.1", "--trades", "2"]
        + ["--adversarial-mix", "0.5"],
        "adversarial_mix (--adversarial-mix) does not apply with trades (the TRADES loss "
        "replaces the mixed loss): drop one of them.",
    ),
    (
        ["train", "--data-dir", "/tmp"],
        "--data-dir applies to --dataset fashion_mnist only (digits is bundled): drop "
        "--data-dir or add --dataset fashion_mnist.",
    ),
    *[
        (["evaluate", "--attack-steps", "0", flag, value], _ATTACK_OFF.format(f=flag))
        for flag, value in [
            ("--attack-norms", "linf"),
            ("--attack-restarts", "3"),
            ("--attack-examples", "10"),
        ]
    ],
    *[
        (["evaluate", "--model", __file__, flag, *values], _SAVED_MODEL.format(f=flag))
        for flag, values in [
            ("--epochs", ["3"]),
            ("--method", ["dp-sgd"]),
            ("--clip-norm", ["2"]),
            ("--momentum", ["0.9"]),
            ("--quiet", []),
        ]
    ],
    (
        ["evaluate", "--model", __file__, "--save", "m.keras"],
        "--save saves the model this command trains, and --model loads one already saved: "
        "drop --save.",
    ),
]


@pytest.mark.parametrize(
    "argv,message", INAPPLICABLE, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_a_flag_the_run_would_ignore_is_refused_in_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"lipdp {argv[0]}: error: {message}\n"


def _check_options(argv):
    args = arguments.make_parser().parse_args(argv)
    arguments.refuse_inapplicable_options(args, arguments.explicit_options(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--method", "dp-sgd", "--clipping", "global", "--clip-threshold", "5"],
        ["train", "--method", "dp-sgd", "--scattering", "--group-norm", "9"],
        ["train", "--no-scattering", "--group-norm", "4", "--group-norm-alpha", "0.5"],
        ["train", "--no-scattering", "--gradient-clip", "none", "--tau", "4"],
        ["train", "--dataset", "fashion_mnist", "--scattering", "--group-norm", "9"],
        ["train", "--optimizer", "sgd", "--momentum", "0.9"],
        ["train", "--dataset", "fashion_mnist", "--data-dir", "/tmp"],
        ["train", "--adversarial-radius", "0.1", "--adversarial-steps", "3"],
        ["evaluate", "--attack-steps", "5", "--attack-norms", "linf"],
        ["evaluate", "--model", __file__, "--dataset", "digits", "--accountant", "pld"]
        + ["--seed", "3", "--radii", "0.1", "--bins", "5"],
    ],
    ids=" ".join,
)
def test_flags_that_apply_are_accepted(argv):
    _check_options(argv)


def test_defaults_never_count_as_typed():
    """A default is not the user's choice: --clip-norm 1, --momentum 0, --adversarial-steps
    10, ... trigger no refusal, whatever the method."""
    typed = arguments.explicit_options(["train", "--momentum", "0", "--quiet"])
    assert {"--momentum", "--quiet"} <= typed and "--clip-norm" not in typed
    for method in defaults.METHODS:
        _check_options(["train", "--method", method])
    _check_options(["evaluate", "--model", __file__])


def test_mirrored_beyond_the_usable_cores_is_refused_at_once(monkeypatch, capsys):
    monkeypatch.setattr(devices, "usable_cpu_cores", lambda: 2)
    assert cli.main(["train", "--mirrored", "99"]) == 2
    assert capsys.readouterr().err == (
        "lipdp train: error: --mirrored 99: this machine gives at most 2 device(s) (0 GPU(s), "
        "2 CPU core(s); more logical CPU devices than cores only slow training down): use "
        "--mirrored 2.\n"
    )
    monkeypatch.setattr(devices, "usable_cpu_cores", lambda: 1)
    assert cli.main(["train", "--mirrored", "2"]) == 2
    assert capsys.readouterr().err.endswith("only slow training down): drop --mirrored.\n")


def test_train_saves_a_model_that_loads_with_its_ledger(tmp_path, capsys):
    """``train --save``: the .keras file keeps the privacy ledger (the epsilon the training
    reported), and ``evaluate --model`` of it on another data set is one line. (And "1
    epoch", singular.)"""
    import tensorflow as tf

    from lipdp.core.report import privacy_report

    path = tmp_path / "digits.keras"
    assert cli.main(["train", "--quiet", "--epochs", "1", "--save", str(path)]) == 0
    out = capsys.readouterr().out
    assert "-> 1 epoch\n" in out
    assert out.endswith(f"saved to {path}\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = privacy_report(tf.keras.models.load_model(path))
    # Keras' "Skipping variable loading for optimizer ..." (an unbuilt optimizer saved).
    assert [str(w.message) for w in caught if "optimizer" in str(w.message)] == []
    assert f"(epsilon = {report.epsilon:.4f}, delta = 1e-05)" in out
    assert str(report) in out  # steps, sensitivities and ledger as trained
    assert cli.main(["evaluate", "--model", str(path), "--dataset", "breast_cancer"]) == 2
    assert capsys.readouterr().err == (
        f"lipdp evaluate: error: --model {str(path)!r} takes inputs of shape (8, 8, 1) in 10 "
        "classes, but --dataset breast_cancer has inputs of shape (30,) in 2 classes: give "
        "the --dataset the model was trained on.\n"
    )


def test_every_option_has_help_and_no_markup():
    parser = arguments.make_parser()
    assert "``" not in parser.format_help()
    for name, subparser in arguments.subcommand_parsers(parser).items():
        missing = [a.option_strings[-1] for a in subparser._actions if not a.help]
        assert missing == [], f"lipdp {name}: options without help: {missing}"
        text = subparser.format_help()
        assert "``" not in text and ":mod:" not in text and ":func:" not in text
