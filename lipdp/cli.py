"""The ``lipdp`` command.

``lipdp train`` trains a Lipschitz CNN under a privacy budget and prints the privacy
report and the test accuracy. With no option it uses scikit-learn's digits (bundled)
and (epsilon, delta) = (3, 1e-5); the number of epochs is the largest one that stays
within the budget (``get_max_epochs``) unless ``--epochs`` is given. ``--save PATH``
writes the trained model as ``.keras`` (with its privacy ledger).

``lipdp evaluate`` trains the same model (or loads a saved one with ``--model PATH``)
and prints the privacy report, the test accuracy, the certified accuracy at a few
radii, the accuracy under a PGD attack at the same radii, the calibration errors and
the AUROC of membership-inference attacks (see :mod:`lipdp.evaluation`).

``--adversarial-radius R`` (with ``--adversarial-norm``, ``--adversarial-steps``,
``--adversarial-mix``) trains on PGD adversarial examples (:mod:`lipdp.core.adversarial`).

Errors are one line on stderr and exit status 2: a bad value, and a flag the user typed
that the run would ignore (another method's, clipping's or optimiser's flag, a training
flag with ``evaluate --model``; :func:`_inapplicable_options`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time

#: Public input-norm bounds per data set. They are constants, never computed from the
#: private data (a data-dependent bound would itself leak, rule S6). Breast cancer: 30
#: features mapped to [-1, 1] by public ranges (:func:`lipdp.data.sources.load_breast_cancer`).
INPUT_BOUNDS = {"digits": 5.0, "fashion_mnist": 10.0, "breast_cancer": math.sqrt(30.0)}

#: Channels of the convolution blocks of the CLI's CNN (:func:`lipdp.recipes.zoo.pooled_cnn`).
CNN_WIDTHS = {"digits": (16,), "fashion_mnist": (32, 64)}

#: Training methods of ``--method``: ``lipdp`` keeps every kernel at norm C (orthogonal
#: kernels times C; the original method, "Fix-Lip-DP-SGD" for C != 1); ``lip-dp-sgd``
#: keeps kernels in spectral balls of radius C and computes the bounds from their
#: current norms (Barczewski & Ramon; :mod:`lipdp.clipless.layers.constrained`); ``dp-sgd`` clips
#: per-example gradients of an ordinary Keras network (:mod:`lipdp.clipped.model`).
METHODS = ("lipdp", "lip-dp-sgd", "dp-sgd")

#: Public value ranges of the features (pixels in [0, 1]; breast cancer mapped to
#: [-1, 1]): adversarial examples are kept in them.
FEATURE_RANGES = {"digits": (0.0, 1.0), "fashion_mnist": (0.0, 1.0), "breast_cancer": (-1.0, 1.0)}

#: Per data set, the defaults of --batch-size, --noise-multiplier, --learning-rate.
_DEFAULTS = {
    "digits": (512, 6.0, 0.02),
    "fashion_mnist": (2048, 2.0, 0.01),
    "breast_cancer": (64, 2.0, 0.01),
}


def _defaults_text(column) -> str:
    """``"512 (digits), 2048 (fashion_mnist), ..."``: the help's statement of a default."""
    return ", ".join(f"{values[column]:g} ({name})" for name, values in _DEFAULTS.items())


class _Parser(argparse.ArgumentParser):
    """Errors as one line, ``lipdp <command>: error: ...``, exit status 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(convert, check, requirement):
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
_seed = _number(int, lambda v: v >= 0, "an integer >= 0")
_non_negative_int = _seed
_positive_float = _number(float, lambda v: 0 < v < float("inf"), "a finite number > 0")
_probability = _number(float, lambda v: 0 < v < 1, "a number in (0, 1)")
_radius = _number(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
_mix = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_decay = _number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def _directory(text):
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    return text


def _model_file(text):
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def _keras_path(text):
    if not text.endswith(".keras"):
        raise argparse.ArgumentTypeError(
            f"must end with .keras (the format that saves the privacy state), got {text!r}"
        )
    # Checked now, not after a training of minutes that could then not be saved.
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"no such directory: {directory!r}")
    return text


#: ``lipdp --help``'s description: plain text (the module docstring's markup would show).
DESCRIPTION = (
    "lipdp: train Keras networks with differential privacy (Lipschitz networks without "
    "clipping, or clipped DP-SGD) and evaluate them."
)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lipdp", description=DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {sys.modules['lipdp'].__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summary = "train a private network under a privacy budget and report its test accuracy"
    train = commands.add_parser("train", help=summary, description=summary)
    _add_run_arguments(train)
    _add_save_argument(train)
    train.set_defaults(handler=train_command)
    _add_evaluate_parser(commands)
    return parser


def _subcommand_parsers(parser) -> dict:
    """``{"train": parser, "evaluate": parser}``: the parsers of the subcommands."""
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices


def _add_save_argument(parser) -> None:
    parser.add_argument(
        "--save",
        type=_keras_path,
        default=None,
        metavar="PATH",
        help="save the trained model to this .keras path (with its privacy ledger)",
    )


def _add_run_arguments(parser) -> None:
    """The options of a training run, shared by ``train`` and ``evaluate``."""
    parser.add_argument(
        "--dataset",
        choices=sorted(INPUT_BOUNDS),
        default="digits",
        help="digits (default) and breast_cancer are bundled; fashion_mnist is read from "
        "local files (--data-dir)",
    )
    parser.add_argument(
        "--data-dir",
        type=_directory,
        default=None,
        help="fashion_mnist only: directory of its IDX files (default: the places "
        "lipdp.data.sources looks in)",
    )
    parser.add_argument(
        "--epsilon", type=_positive_float, default=3.0, help="privacy budget epsilon (default 3)"
    )
    parser.add_argument(
        "--delta",
        type=_probability,
        default=1e-5,
        help="privacy parameter delta, in (0, 1); keep it below 1/N (default 1e-5)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help=f"expected batch size b; default: {_defaults_text(0)}",
    )
    parser.add_argument(
        "--noise-multiplier",
        type=_positive_float,
        default=None,
        help=f"sigma, the noise standard deviation over the sensitivity; default: "
        f"{_defaults_text(1)}",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=None,
        help="default: the most epochs within the budget",
    )
    parser.add_argument(
        "--sampling",
        choices=["poisson", "shuffle"],
        default="poisson",
        help="poisson (default): batches are Poisson samples of rate b/N, the mechanism the "
        "accountant analyses; shuffle: fixed-size batches of a shuffle, as the original "
        "package (the Poisson analysis is then an assumption)",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="lipdp",
        help="lipdp (default): kernels kept at norm C, bounds from C; lip-dp-sgd: kernels in "
        "balls of radius C, bounds from their current norms (less noise when they shrink)",
    )
    parser.add_argument(
        "--clipping",
        choices=["flat", "per-layer", "automatic", "global"],
        default="flat",
        help="dp-sgd only: per-example clipping, flat min(1, R/|g|), per-layer (radius "
        "R/sqrt(K) for each of K layers; with --strategy per-layer, one mechanism per "
        "layer), automatic R/(|g|+0.01) or global R/Z below Z, 0 above (default flat)",
    )
    parser.add_argument(
        "--gradient-method",
        choices=["ghost", "jacobian"],
        default="ghost",
        help="dp-sgd only: per-example gradient norms by ghost norms (default, fast) or the "
        "full Jacobian (reference)",
    )
    ascent = parser.add_mutually_exclusive_group()
    ascent.add_argument(
        "--bam",
        type=_positive_float,
        default=None,
        metavar="LAMBDA",
        help="dp-sgd only: Bias-Aware Minimisation, each example's gradient taken after its "
        "own ascent step of length LAMBDA (about 2x the step cost, same privacy)",
    )
    ascent.add_argument(
        "--dp-sat",
        type=_positive_float,
        default=None,
        metavar="RHO",
        help="dp-sgd only: DP-SAT, gradients taken after an ascent step of length RHO along "
        "the previous released gradient (same privacy)",
    )
    parser.add_argument(
        "--clip-norm", type=_positive_float, default=1.0, help="dp-sgd only: R (default 1)"
    )
    parser.add_argument(
        "--clip-threshold",
        type=_positive_float,
        default=None,
        help="dp-sgd --clipping global only: Z, examples with larger gradients are dropped",
    )
    parser.add_argument(
        "--gradient-clip",
        type=_positive_float,
        default=None,
        metavar="C",
        help="lipdp / lip-dp-sgd: clip each example's loss gradient at the logits to norm C "
        "(DP_ClipGradient; every bound upstream uses C instead of the loss's own bound, no "
        "per-example parameter gradients); default: none",
    )
    parser.add_argument(
        "--weight-norm-bound",
        type=_positive_float,
        default=1.0,
        help="C, the radius of every kernel's norm ball (default 1)",
    )
    parser.add_argument(
        "--group-norm",
        type=_positive_int,
        default=None,
        help="number of groups of a group normalisation (x - mean) / max(alpha, std) after "
        "each hidden layer (default: none)",
    )
    parser.add_argument(
        "--group-norm-alpha",
        type=_positive_float,
        default=1.0,
        help="alpha of the group normalisation (the layer is 1/alpha-Lipschitz; default 1)",
    )
    parser.add_argument(
        "--scattering",
        action="store_true",
        help="images: a scattering front-end (Kymatio's J=2, L=8, no weights, certified "
        "Lipschitz constant), a group normalisation (--group-norm groups, default 27 per "
        "channel; alpha 1e-4) and a linear head (zoo.scattering_net; with dp-sgd the same "
        "layers and a Dense head)",
    )
    parser.add_argument(
        "--averaging",
        type=_decay,
        default=None,
        help="evaluate the exponential moving average of the weights with this decay "
        "(e.g. 0.99; post-processing, no privacy cost)",
    )
    parser.add_argument(
        "--strategy",
        choices=["global", "per-layer"],
        default="global",
        help="global (default): one Gaussian mechanism on the whole gradient; per-layer: one "
        "per layer, each with its own sensitivity (dp-sgd: with --clipping per-layer only)",
    )
    parser.add_argument(
        "--mirrored",
        type=_number(int, lambda v: v >= 2, "an integer >= 2"),
        default=None,
        metavar="R",
        help="train under tf.distribute.MirroredStrategy over R devices: the first R GPUs, "
        "else the CPU split into R logical devices (same global batch, same noise and "
        "epsilon; the batch size must be divisible by R)",
    )
    parser.add_argument(
        "--accountant",
        choices=["rdp", "pld", "gdp"],
        default="rdp",
        help="rdp (default) or pld: upper bounds; gdp: the central-limit approximation of "
        "Bu et al. (not a proven bound, flagged in the report)",
    )
    parser.add_argument(
        "--learning-rate",
        type=_positive_float,
        default=None,
        help=f"step size of the optimiser; default: {_defaults_text(2)}",
    )
    parser.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="adam (default) or sgd (with --momentum; Tramer & Boneh's choice for linear "
        "heads on scattering features); the noise is added before the optimiser, so either "
        "is post-processing",
    )
    parser.add_argument(
        "--momentum",
        type=_decay,
        default=0.0,
        help="heavy-ball momentum of --optimizer sgd, in [0, 1) (default 0)",
    )
    parser.add_argument(
        "--adversarial-radius",
        type=_positive_float,
        default=None,
        metavar="R",
        help="adversarial training (both methods): each example replaced by its PGD "
        "adversarial version within radius R, computed from the current weights (same "
        "privacy; lipdp.core.adversarial); default: none",
    )
    parser.add_argument(
        "--adversarial-norm",
        choices=["l2", "linf"],
        default="l2",
        help="the ball of --adversarial-radius (default l2)",
    )
    parser.add_argument(
        "--adversarial-steps",
        type=_positive_int,
        default=10,
        help="PGD steps of adversarial training (default 10; step 2.5 R / steps)",
    )
    parser.add_argument(
        "--adversarial-mix",
        type=_mix,
        default=1.0,
        help="weight w in (0, 1] of the adversarial loss: (1 - w) clean + w adversarial "
        "(default 1: adversarial examples only)",
    )
    parser.add_argument(
        "--trades",
        type=_positive_float,
        default=None,
        metavar="BETA",
        help="with --adversarial-radius, dp-sgd and --gradient-method jacobian only: the "
        "TRADES loss CE(x) + BETA KL(p(x) || p(x')) (replaces --adversarial-mix)",
    )
    parser.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="seed of the initial weights (the noise and the Poisson batches are drawn from "
        "the operating system's entropy regardless)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="one line per epoch instead of the progress bar"
    )


def _add_evaluate_parser(commands) -> None:
    evaluate = commands.add_parser(
        "evaluate",
        help="train (or load) a model and report privacy, accuracy, certified accuracy, "
        "calibration and membership inference",
    )
    evaluate.add_argument(
        "--model",
        type=_model_file,
        default=None,
        help="a saved .keras lipdp model to evaluate (no training)",
    )
    _add_save_argument(evaluate)
    _add_run_arguments(evaluate)
    evaluate.add_argument(
        "--radii",
        type=_radius,
        nargs="+",
        default=[0.0, 0.05, 0.1, 0.2, 0.5],
        help="radii of the certified (l2) and PGD accuracy",
    )
    evaluate.add_argument(
        "--attack-steps",
        type=_non_negative_int,
        default=20,
        help="PGD steps of the robustness table at each of --radii (0: no attack; default 20)",
    )
    evaluate.add_argument(
        "--attack-restarts",
        type=_positive_int,
        default=1,
        help="PGD restarts, the first from the clean point (default 1)",
    )
    evaluate.add_argument(
        "--attack-norms",
        choices=["l2", "linf"],
        nargs="+",
        default=["l2"],
        help="balls of the PGD attack (default l2; the radii are the same numbers)",
    )
    evaluate.add_argument(
        "--attack-examples",
        type=_positive_int,
        default=1000,
        help="test examples attacked (the first ones; default 1000)",
    )
    evaluate.add_argument(
        "--bins", type=_positive_int, default=15, help="confidence bins of the ECE"
    )
    evaluate.set_defaults(handler=evaluate_command)


def _explicit_options(argv) -> set:
    """The options typed on the command line (``{"--clip-norm", ...}``): ``argv`` parsed
    again with every default suppressed, so that a default never counts as the user's
    choice (``--clip-norm`` defaults to 1 for every method)."""
    parser = _parser()
    for subparser in _subcommand_parsers(parser).values():
        for action in subparser._actions:
            action.default = argparse.SUPPRESS
    typed = vars(parser.parse_args(argv))
    return {"--" + dest.replace("_", "-") for dest in typed}


def _refuse_inapplicable_options(args, typed) -> None:
    """A ``ValueError`` (one line: the flag, why, the fix) for the first typed option that
    the run would ignore: the CLI never silently drops a flag the user chose."""
    refusals = _inapplicable_options(args)
    for flag in _option_order(_subcommand_parsers(_parser())[args.command]):
        if flag in typed and flag in refusals:
            raise ValueError(refusals[flag])


def _option_order(parser) -> list:
    """The long options of ``parser`` in the order of its ``--help``."""
    return [a.option_strings[-1] for a in parser._actions if a.option_strings]


def _inapplicable_options(args) -> dict:
    """``{flag: message}`` for every option that does not apply to the run ``args``
    describes (whether typed or not: the caller keeps the typed ones)."""
    if getattr(args, "model", None) is not None:
        refusals = _options_unused_by_a_saved_model()
    else:
        refusals = _family_refusals(args)
        refusals.update(_clipping_refusals(args))
        refusals.update(_group_norm_refusals(args))
        refusals.update(_adversarial_refusals(args))
    if args.optimizer != "sgd":
        refusals.setdefault(
            "--momentum",
            "--momentum applies to --optimizer sgd only (Adam keeps its own moment "
            "estimates): drop --momentum or add --optimizer sgd.",
        )
    if args.dataset != "fashion_mnist":
        refusals["--data-dir"] = (
            f"--data-dir applies to --dataset fashion_mnist only ({args.dataset} is "
            "bundled): drop --data-dir or add --dataset fashion_mnist."
        )
    if args.command == "evaluate" and args.attack_steps == 0:
        for flag in ("--attack-restarts", "--attack-norms", "--attack-examples"):
            refusals[flag] = (
                f"{flag} applies to the PGD attack, which --attack-steps 0 turns off: drop "
                f"{flag} or give --attack-steps N >= 1."
            )
    return refusals


def _family_refusals(args) -> dict:
    """The options of the other family than ``--method``'s."""
    if args.method != "dp-sgd":
        why = (
            f"--method {args.method} clips no gradient: its sensitivities come from the "
            "layers' Lipschitz bounds"
        )
        flags = ("--clipping", "--clip-norm", "--clip-threshold", "--gradient-method")
        refusals = {
            f: f"{f} applies to --method dp-sgd only ({why}): drop {f} or add --method dp-sgd."
            for f in flags
        }
        for flag in ("--bam", "--dp-sat"):
            refusals[flag] = (
                f"{flag} applies to --method dp-sgd only (the clipless methods have no "
                f"sharpness-aware step): drop {flag} or add --method dp-sgd."
            )
        return refusals
    return {
        "--gradient-clip": "--gradient-clip applies to the clipless methods; dp-sgd clips "
        "per-example gradients with --clip-norm.",
        "--weight-norm-bound": "--weight-norm-bound applies to the clipless methods (lipdp, "
        "lip-dp-sgd) only: dp-sgd's layers have unconstrained kernels (their gradients are "
        "clipped at --clip-norm): drop --weight-norm-bound.",
    }


def _clipping_refusals(args) -> dict:
    if args.method == "dp-sgd" and args.clipping != "global":
        return {
            "--clip-threshold": f"--clip-threshold applies to --clipping global only "
            f"({args.clipping} clipping drops no example): drop --clip-threshold or add "
            "--clipping global."
        }
    return {}


def _group_norm_refusals(args) -> dict:
    """Group normalisation: in the clipless networks (``--group-norm``, ``--group-norm-alpha``)
    and in either family's scattering network (``--group-norm`` only: its alpha is fixed)."""
    refusals = {}
    if args.method == "dp-sgd" and not args.scattering:
        refusals["--group-norm"] = (
            "--group-norm applies to the clipless methods, or to dp-sgd with --scattering "
            "(dp-sgd's plain network has no group normalisation): drop --group-norm."
        )
    if args.scattering:
        refusals["--group-norm-alpha"] = (
            "--group-norm-alpha does not apply to --scattering, whose group normalisation "
            "has its own alpha (lipdp.recipes.zoo.SCATTERING_ALPHA): drop --group-norm-alpha."
        )
    elif args.method == "dp-sgd":
        refusals["--group-norm-alpha"] = (
            "--group-norm-alpha applies to the clipless methods only (dp-sgd's plain "
            "network has no group normalisation): drop --group-norm-alpha."
        )
    elif args.group_norm is None:
        refusals["--group-norm-alpha"] = (
            "--group-norm-alpha needs --group-norm G (without it the network has no group "
            "normalisation): add --group-norm G or drop --group-norm-alpha."
        )
    return refusals


def _adversarial_refusals(args) -> dict:
    if args.adversarial_radius is None:
        flags = ("--adversarial-norm", "--adversarial-steps", "--adversarial-mix", "--trades")
        return {
            f: f"{f} needs --adversarial-radius R (the ball of its attack; without it there "
            f"is no adversarial training): add --adversarial-radius R or drop {f}."
            for f in flags
        }
    if args.trades is not None:
        return {
            "--adversarial-mix": "--adversarial-mix does not apply with --trades (the TRADES "
            "loss replaces the mixed loss): drop one of them."
        }
    return {}


def _options_unused_by_a_saved_model() -> dict:
    """``evaluate --model``: no training, so every training option would be ignored; the
    data set, the accountant of the report and the seed of the evaluations still apply."""
    used = {"--dataset", "--data-dir", "--accountant", "--seed"}
    training = _subcommand_parsers(_parser())["train"]
    refusals = {
        flag: f"{flag} configures training, and evaluate --model evaluates a saved model "
        f"without training: drop {flag}."
        for flag in _option_order(training)
        if flag not in used
    }
    refusals["--save"] = (
        "--save saves the model this command trains, and --model loads one already saved: "
        "drop --save."
    )
    return refusals


def _load(name, data_dir):
    from lipdp.data import sources as datasets

    if name == "digits":
        return datasets.load_digits()
    if name == "breast_cancer":
        return datasets.load_breast_cancer()
    return datasets.load_fashion_mnist(data_dir)


def _scattering_groups(group_norm, channels) -> int:
    return group_norm or 27 * channels  # 81 coefficients per channel: groups of 3


def _architecture(dataset, method, weight_norm_bound, group_norm, alpha, scattering=False):
    """``(zoo name, builder options)`` of the CLI's network for these options."""
    adaptive = method == "lip-dp-sgd"
    if scattering:
        return "scattering_net", dict(
            weight_norm_bound=weight_norm_bound,
            adaptive_norm=adaptive,
            constraint="spectral",
            groups=_scattering_groups(group_norm, 1),
        )
    ball = dict(
        weight_norm_bound=weight_norm_bound,
        adaptive_norm=adaptive,
        constraint="spectral" if adaptive else "orthogonal",
        group_norm=group_norm,
        alpha=alpha,
    )
    if dataset == "breast_cancer":
        return "lip_mlp", dict(width=32, **ball)
    if not adaptive and weight_norm_bound == 1.0 and group_norm is None:
        return "pooled_cnn", dict(widths=CNN_WIDTHS[dataset])
    # The same network as pooled_cnn, with norm balls (and group normalisation).
    return "lip_convnet", dict(
        widths=CNN_WIDTHS[dataset], dense=None, activation="groupsort", **ball
    )


def _keras_layers(dataset, input_shape, nb_classes, scattering=False, group_norm=None):
    """The network of ``--method dp-sgd``: ordinary Keras layers of the same size as the
    Lipschitz networks (tanh, as the tempered-sigmoid CNNs of DP-SGD; no batch norm), or
    with ``scattering`` the weightless scattering front-end and a Dense head."""
    import tensorflow as tf

    if scattering:
        from lipdp.clipless import layers
        from lipdp.recipes import zoo

        return [
            tf.keras.layers.InputLayer(input_shape=input_shape),
            layers.DP_ScatteringTransform(padding="zeros", name="scattering"),
            layers.DP_GroupNormalization(
                _scattering_groups(group_norm, input_shape[-1]), zoo.SCATTERING_ALPHA
            ),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(nb_classes),
        ]

    if dataset == "breast_cancer":
        return [
            tf.keras.layers.Dense(32, activation="relu", input_shape=input_shape),
            tf.keras.layers.Dense(nb_classes),
        ]
    stack = []
    for width in CNN_WIDTHS[dataset]:
        extra = {} if stack else {"input_shape": input_shape}
        stack += [
            tf.keras.layers.Conv2D(width, 3, padding="same", activation="tanh", **extra),
            tf.keras.layers.MaxPool2D(2),
        ]
    return stack + [tf.keras.layers.Flatten(), tf.keras.layers.Dense(nb_classes)]


def cli_model(
    data,
    dataset,
    batch_size,
    dp_parameters,
    sampling="shuffle",
    learning_rate=None,
    method="lipdp",
    weight_norm_bound=1.0,
    group_norm=None,
    alpha=1.0,
    clipping=None,
    ascent=None,
    gradient_method="ghost",
    adversarial=None,
    scattering=False,
    optimizer="adam",
    momentum=0.0,
    gradient_clip=None,
):
    """The compiled model of ``lipdp train`` / ``evaluate`` and its training arrays.

    Architecture: on images :func:`lipdp.recipes.zoo.pooled_cnn` (widths :data:`CNN_WIDTHS`), or
    the same network with norm balls (:func:`lipdp.recipes.zoo.lip_convnet`) when ``method``,
    ``weight_norm_bound`` or ``group_norm`` ask for them; on breast cancer
    :func:`lipdp.recipes.zoo.lip_mlp` (32 hidden units). Input bound :data:`INPUT_BOUNDS`, loss
    ``DP_TauCategoricalCrossentropy(8)``, Adam (learning rate the data set's default
    unless given; ``optimizer="sgd"``: SGD with ``momentum``); ``gradient_clip=c`` (clipless
    families) appends ``DP_ClipGradient(c)`` after the logits. Poisson batches use every
    training example; fixed-size batches drop the remainder (rule S5).
    ``method="dp-sgd"``: :func:`_keras_layers` trained by
    :class:`lipdp.clipped.model.DPSGD_Sequential` with ``clipping``, ``ascent`` and
    ``gradient_method``. ``adversarial``: a :class:`lipdp.core.adversarial.PGD` for adversarial
    training (either method). ``scattering``: :func:`lipdp.recipes.zoo.scattering_net` (or its
    Keras counterpart for dp-sgd) on images. Returns ``(model, x_train, y_train)``.
    Benchmarks and tests that study "the CLI's model" build it here.
    """
    import numpy as np
    import tensorflow as tf

    from lipdp.clipless import losses
    from lipdp.clipless.layers import DP_ClipGradient
    from lipdp.clipless.model import DP_Sequential
    from lipdp.core.metadata import DatasetMetadata
    from lipdp.recipes import zoo

    n_train = len(data.x_train)
    if sampling == "shuffle":
        n_train -= n_train % batch_size
    metadata = DatasetMetadata(
        input_shape=data.x_train.shape[1:],
        nb_classes=data.nb_classes,
        nb_samples_train=n_train,
        nb_samples_test=len(data.x_test),
        class_names=data.class_names,
        batch_size=batch_size,
        max_norm=INPUT_BOUNDS[dataset],
        sampling=sampling,
    )
    if method == "dp-sgd":
        from lipdp.clipped.model import Clipping, DPSGD_Sequential

        model = DPSGD_Sequential(
            _keras_layers(dataset, metadata.input_shape, data.nb_classes, scattering, group_norm),
            dp_parameters=dp_parameters,
            clipping=clipping or Clipping(),
            dataset_metadata=metadata,
            ascent=ascent,
            gradient_method=gradient_method,
            adversarial=adversarial,
        )
        loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    else:
        architecture, options = _architecture(
            dataset, method, weight_norm_bound, group_norm, alpha, scattering
        )
        stack = zoo.ZOO[architecture](metadata, **options)
        if gradient_clip is not None:
            stack.append(DP_ClipGradient(gradient_clip))
        model = DP_Sequential(stack, dp_parameters=dp_parameters, dataset_metadata=metadata)
        model.adversarial = adversarial
        loss = losses.DP_TauCategoricalCrossentropy(tau=8.0)
    model.compile(
        loss=loss,
        optimizer=_optimizer(optimizer, learning_rate or _DEFAULTS[dataset][2], momentum),
        metrics=["accuracy"],
    )
    y_train = np.eye(data.nb_classes, dtype="float32")[data.y_train[:n_train]]
    return model, data.x_train[:n_train], y_train


def _train_private_model(args, data, verb):
    """Build, compile and train the CLI's model under the budget of ``args``.

    Returns ``(model, x_train, y_train, seconds)``.
    """

    from lipdp.core.callbacks import DP_Accountant, ParameterAveraging
    from lipdp.pipeline import poisson_batches
    from lipdp.sensitivity import get_max_epochs

    default_batch, default_sigma, _ = _DEFAULTS[args.dataset]
    batch_size = args.batch_size or default_batch
    sigma = args.noise_multiplier or default_sigma
    if batch_size > len(data.x_train):
        raise ValueError(
            f"--batch-size {batch_size} exceeds the {len(data.x_train)} training examples."
        )
    strategy = _distribution_strategy(args.mirrored)
    with strategy.scope():
        model, x_train, y_train = _built_cli_model(args, data, batch_size, sigma)
    epochs = args.epochs
    if epochs is None:
        epochs = get_max_epochs(args.epsilon, model, accountant=args.accountant)
    devices = f", {args.mirrored} replicas" if args.mirrored else ""
    print(
        f"lipdp {verb}: {args.dataset}, {len(x_train)} training examples, batch {batch_size}"
        f"{devices}, method {args.method} ({_method_detail(args)}), "
        f"noise multiplier {sigma}, {args.strategy} noise, budget (epsilon = {args.epsilon}, "
        f"delta = {args.delta}) -> {epochs} epoch{'' if epochs == 1 else 's'}"
    )
    callbacks = [DP_Accountant(epsilon_budget=args.epsilon, accountant=args.accountant)]
    if args.averaging is not None:
        callbacks.append(ParameterAveraging(decay=args.averaging))
    if args.quiet:
        callbacks.append(_epoch_lines(epochs))
    metadata = model.dataset_metadata
    start = time.perf_counter()
    if metadata.sampling == "poisson":
        batches = poisson_batches(
            x_train, y_train, metadata.sampling_rate, metadata.nb_steps_per_epochs
        )
        model.fit(batches, epochs=epochs, verbose=0 if args.quiet else 1, callbacks=callbacks)
    else:
        model.fit(
            x_train,
            y_train,
            batch_size=batch_size,
            epochs=epochs,
            verbose=0 if args.quiet else 1,
            callbacks=callbacks,
        )
    return model, x_train, y_train, time.perf_counter() - start


def _distribution_strategy(replicas):
    """``None``: TensorFlow's default (one device). ``R``: ``MirroredStrategy`` over the
    first ``R`` GPUs, or over ``R`` logical devices the CPU is split into (possible only
    before TensorFlow has started its devices)."""
    import tensorflow as tf

    from lipdp.core.distribute import mirrored_strategy

    if replicas is None:
        return tf.distribute.get_strategy()
    gpus = len(tf.config.list_physical_devices("GPU"))
    if gpus >= replicas:
        devices = [d.name for d in tf.config.list_logical_devices("GPU")[:replicas]]
        return mirrored_strategy(devices)
    _refuse_more_replicas_than_cores(replicas, gpus)
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    except RuntimeError:  # devices already started: use the split already made, if any
        pass
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < replicas:
        raise ValueError(
            f"--mirrored {replicas}: only {len(devices)} device(s) available (TensorFlow had "
            "started its devices before they could be split); run lipdp in a new process."
        )
    return mirrored_strategy(devices[:replicas])


def _usable_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _refuse_more_replicas_than_cores(replicas, gpus) -> None:
    """TensorFlow splits the CPU into as many logical devices as asked, but they share its
    cores: replicas beyond the cores add copies of the step to trace and all-reduces to
    wait for, with no parallelism (on 2 cores one epoch of the demo took 15 s with 3
    replicas, 80 s with 16; 99 replicas spend minutes before the first step). Refused."""
    cores = _usable_cpu_cores()
    if replicas <= cores:
        return
    most = max(gpus, cores)
    fix = {0: "drop --mirrored", 1: "drop --mirrored", 2: "use --mirrored 2"}.get(
        most, f"use --mirrored R with R <= {most}"
    )
    raise ValueError(
        f"--mirrored {replicas}: this machine gives at most {most} device(s) ({gpus} GPU(s), "
        f"{cores} CPU core(s); more logical CPU devices than cores only slow training "
        f"down): {fix}."
    )


def _built_cli_model(args, data, batch_size, sigma):
    """:func:`cli_model` with the options of ``args``."""
    from lipdp.clipless.model import DPParameters

    return cli_model(
        data,
        args.dataset,
        batch_size,
        DPParameters(args.strategy, sigma, args.delta),
        sampling=args.sampling,
        learning_rate=args.learning_rate,
        method=args.method,
        weight_norm_bound=args.weight_norm_bound,
        group_norm=args.group_norm,
        alpha=args.group_norm_alpha,
        clipping=_clipping(args) if args.method == "dp-sgd" else None,
        ascent=_ascent(args),
        gradient_method=args.gradient_method,
        adversarial=_adversarial(args),
        scattering=_scattering(args),
        optimizer=args.optimizer,
        momentum=args.momentum,
        gradient_clip=args.gradient_clip,
    )


def _scattering(args) -> bool:
    if args.scattering and args.dataset == "breast_cancer":
        raise ValueError("--scattering needs images; breast_cancer is tabular.")
    return args.scattering


def _optimizer(name, learning_rate, momentum):
    """The Keras optimiser of ``--optimizer`` (momentum only for SGD: Adam has its own)."""
    import tensorflow as tf

    if name == "sgd":
        return tf.keras.optimizers.SGD(learning_rate, momentum=momentum)
    if momentum:
        raise ValueError("--momentum applies to --optimizer sgd only.")
    return tf.keras.optimizers.Adam(learning_rate)


def _clipping(args):
    from lipdp.clipped.model import Clipping

    if args.clipping == "global" and args.clip_threshold is None:
        raise ValueError(
            "--clipping global needs --clip-threshold Z (the norm above which an "
            "example's gradient is dropped)."
        )
    threshold = args.clip_threshold if args.clipping == "global" else None
    return Clipping(args.clipping, args.clip_norm, threshold=threshold)


def _ascent(args):
    """The ``--bam`` / ``--dp-sat`` ascent (dp-sgd only: :func:`_family_refusals`)."""
    from lipdp.clipped.model import SharpnessAscent

    mode, radius = ("bam", args.bam) if args.bam is not None else ("dp-sat", args.dp_sat)
    return None if radius is None else SharpnessAscent(mode, radius)


def _adversarial(args):
    """The ``--adversarial-*`` PGD (or ``None``), kept in the data set's value range."""
    from lipdp.core.adversarial import PGD

    if args.adversarial_radius is None:  # (--trades etc. alone: _adversarial_refusals)
        return None
    return PGD(
        args.adversarial_radius,
        args.adversarial_norm,
        steps=args.adversarial_steps,
        mix=args.adversarial_mix,
        clip_values=FEATURE_RANGES[args.dataset],
        trades_beta=args.trades,
    )


def _method_detail(args) -> str:
    detail = _family_detail(args)
    adversarial = _adversarial(args)
    return detail if adversarial is None else f"{detail}; adversarial {adversarial.describe()}"


def _family_detail(args) -> str:
    if args.method == "dp-sgd":
        detail = f"{args.clipping} clipping, R = {args.clip_norm:g}"
        if args.clipping == "global":
            detail += f", Z = {args.clip_threshold:g}"
        if args.bam is not None:
            detail += f", BAM lambda = {args.bam:g}"
        if args.dp_sat is not None:
            detail += f", DP-SAT rho = {args.dp_sat:g}"
        return detail
    detail = f"weight norm bound {args.weight_norm_bound:g}"
    if args.gradient_clip is not None:
        detail += f", logit gradients clipped at {args.gradient_clip:g}"
    return detail


def _epoch_lines(epochs):
    """``--quiet`` progress: one line per epoch with epsilon, and after the second epoch
    (the first includes the compilation) an estimate of the time left."""
    import tensorflow as tf

    class EpochLines(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()
            self.first = None

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            elapsed = time.perf_counter() - self.start
            line = (
                f"epoch {epoch + 1}/{epochs}: loss {logs.get('loss', float('nan')):.4f}, "
                f"accuracy {logs.get('accuracy', float('nan')):.4f}, "
                f"epsilon {logs.get('epsilon', float('nan')):.4f} ({elapsed:.1f} s)"
            )
            if epoch == 0:
                self.first = elapsed
            elif epoch == 1 and epochs > 2:
                left = (elapsed - self.first) * (epochs - 2)
                line += f"; about {left:.0f} s to go"
            print(line, flush=True)

    return EpochLines()


def train_command(args) -> int:
    import numpy as np
    import tensorflow as tf

    from lipdp.core.report import privacy_report

    tf.keras.utils.set_random_seed(args.seed)
    data = _load(args.dataset, args.data_dir)
    model, _, _, seconds = _train_private_model(args, data, "train")
    y_test = np.eye(data.nb_classes, dtype="float32")[data.y_test]
    _, accuracy = model.evaluate(data.x_test, y_test, verbose=0)
    print()
    print(privacy_report(model, accountant=args.accountant))
    print(f"test accuracy: {accuracy:.4f} ({len(data.x_test)} examples, {seconds:.1f} s training)")
    if args.save:
        _save(model, args.save)
    return 0


def _save(model, path) -> None:
    """The ``.keras`` file keeps the privacy ledger: ``evaluate --model`` reports the same
    epsilon."""
    model.save(path)
    print(f"saved to {path}")


def _load_model(path):
    import tensorflow as tf

    from lipdp.core.private_model import PrivateModel

    try:
        model = tf.keras.models.load_model(path)
    except Exception as error:  # any reason a file is not a loadable model
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--model: cannot load a model from {path!r} ({reason[:200]})") from None
    if not isinstance(model, PrivateModel):
        raise ValueError(f"--model: {path!r} holds a {type(model).__name__}, not a lipdp DP model.")
    return model


def _refuse_other_data(model, data, args) -> None:
    """A saved model evaluated on a data set of other inputs or classes fails deep inside
    Keras with a long traceback: one line instead, before any evaluation."""
    metadata = model.dataset_metadata
    if metadata is not None:
        shape, classes = tuple(metadata.input_shape), metadata.nb_classes
    else:  # a model saved without metadata: read its layers
        shape, classes = tuple(model.input_shape[1:]), model.output_shape[-1]
    data_shape = tuple(data.x_train.shape[1:])
    if shape == data_shape and classes == data.nb_classes:
        return
    raise ValueError(
        f"--model {args.model!r} takes inputs of shape {shape} in {classes} classes, but "
        f"--dataset {args.dataset} has inputs of shape {data_shape} in {data.nb_classes} "
        "classes: give the --dataset the model was trained on."
    )


def evaluate_command(args) -> int:
    """``lipdp evaluate``: the privacy report and the evaluations of lipdp.evaluation.

    Membership inference reads the training data: it is an empirical audit for the
    data owner, not part of the DP release.
    """
    import numpy as np
    import tensorflow as tf

    import lipdp.clipless.layers  # noqa: F401  (registers the layers for load_model)
    import lipdp.clipless.losses  # noqa: F401
    import lipdp.clipless.model  # noqa: F401
    from lipdp import evaluation
    from lipdp.clipped.model import DPSGD_Model
    from lipdp.core.report import privacy_report

    tf.keras.utils.set_random_seed(args.seed)
    data = _load(args.dataset, args.data_dir)
    if args.model is not None:
        model = _load_model(args.model)
        _refuse_other_data(model, data, args)
        metadata = model.dataset_metadata
        n_train = len(data.x_train) if metadata is None else metadata.nb_samples_train
        x_train = data.x_train[:n_train]
        y_train = np.eye(data.nb_classes, dtype="float32")[data.y_train[:n_train]]
        print(f"lipdp evaluate: {args.model} on {args.dataset}")
    else:
        model, x_train, y_train, _ = _train_private_model(args, data, "evaluate")
        if args.save:
            _save(model, args.save)

    print()
    optimizer = getattr(model, "optimizer", None)
    metadata = model.dataset_metadata
    if optimizer is not None and metadata is not None:
        print(privacy_report(model, accountant=args.accountant))
    else:
        print("privacy report: unavailable (the model has no optimizer state or metadata)")
    print()
    x_test, y_test = data.x_test, data.y_test
    lipschitz_model = not isinstance(model, DPSGD_Model)  # clipped DP-SGD: no certificate
    if lipschitz_model:
        lipschitz = evaluation.lipschitz_constant(model)
        certified = evaluation.certified_accuracy(model, x_test, y_test, args.radii, lipschitz)
    probs = evaluation.predict_probabilities(model, x_test)
    calibration = evaluation.calibration_report(probs, y_test, args.bins)
    mia = evaluation.membership_inference(model, x_train, y_train, x_test, y_test, seed=args.seed)
    summary = mia.summary()
    print(f"test accuracy: {calibration.accuracy:.4f} ({len(x_test)} examples)")
    if lipschitz_model:
        print(f"Lipschitz constant (from the layers): {lipschitz:.6g}")
        print("certified accuracy (l2 radius: accuracy):")
        for radius, value in zip(args.radii, certified):
            print(f"  {radius:g}: {value:.4f}")
    else:
        print("certified accuracy: none (a clipped DP-SGD network has no Lipschitz bound)")
    if args.attack_steps:
        print(_robustness_table(model, x_test, y_test, args, lipschitz_model))
    print(
        f"calibration ({args.bins} bins): ECE {calibration.ece:.4f}, MCE {calibration.mce:.4f}, "
        f"NLL {calibration.nll:.4f}"
    )
    print(
        f"membership inference (train vs test, empirical): AUROC "
        f"{summary['mia_auc_entire_dataset']:.4f} (loss threshold "
        f"{mia.result('loss threshold').auroc:.4f}, logistic regression "
        f"{mia.result('logistic regression').auroc:.4f}), advantage "
        f"{summary['mia_adv_entire_dataset']:.4f}"
    )
    return 0


def _robustness_table(model, x, y, args, certified):
    """The ``--attack-*`` table: accuracy under PGD (and certified, for Lipschitz
    models) at each radius, on the first ``--attack-examples`` test examples."""
    from lipdp.evaluation import robustness_curves

    x, y = x[: args.attack_examples], y[: args.attack_examples]
    curves = robustness_curves(
        model,
        x,
        y,
        args.radii,
        norms=args.attack_norms,
        steps=args.attack_steps,
        restarts=args.attack_restarts,
        seed=args.seed,
        certified=certified,
    )
    columns = [key for key in curves if key != "radii"]
    lines = [
        f"robustness ({len(x)} test examples; PGD {args.attack_steps} steps, "
        f"{args.attack_restarts} restart(s): an upper bound on robust accuracy; certified: "
        "a lower bound; linf certificates from the l2 ball containing the linf ball):",
        "  radius | " + " | ".join(c.replace("_", " ") for c in columns),
    ]
    for i, radius in enumerate(curves["radii"]):
        values = " | ".join(f"{curves[c][i]:.4f}" for c in columns)
        lines.append(f"  {radius:g} | {values}")
    return "\n".join(lines)


@contextlib.contextmanager
def _native_logs_silenced():
    """TensorFlow's C++ and absl start-up lines (CUDA factories, XLA compilation notices)
    write to file descriptor 2 directly, whatever TF_CPP_MIN_LOG_LEVEL says: send that
    descriptor to /dev/null while Python's own stderr (errors, warnings, logging) keeps
    the real one. ``LIPDP_NATIVE_LOGS=1`` keeps them."""
    if os.environ.get("LIPDP_NATIVE_LOGS") == "1" or sys.stderr is not sys.__stderr__:
        yield  # (a caller that replaced sys.stderr, e.g. a test, manages its own streams)
        return
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    try:
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is python_stderr:
                handler.setStream(sys.stderr)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        replaced, sys.stderr = sys.stderr, python_stderr
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is replaced:
                handler.setStream(python_stderr)
        replaced.close()


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    with _native_logs_silenced():
        try:
            _refuse_inapplicable_options(args, _explicit_options(argv))
            return args.handler(args)
        except (ValueError, FileNotFoundError) as error:
            print(f"lipdp {args.command}: error: {error}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
