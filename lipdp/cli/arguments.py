"""The arguments of ``lipdp``: the parser and its help, the value checks, the refusal of a
flag the run would ignore, and the arguments turned into a recipe
(:class:`lipdp.recipes.recipe_config.RunConfig`,
:class:`lipdp.recipes.run_evaluation.EvaluationConfig`). Which flag applies to which method
is the recipes' decision (:mod:`lipdp.recipes.method_settings`), refused with their message.

Every option's ``dest`` is the name of the recipe field it sets (``--clip-norm`` sets
``clip_norm``): :func:`model_recipe` copies them over.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from lipdp.recipes import defaults as D
from lipdp.recipes import method_settings

#: ``lipdp --help``'s description: plain text (the module docstring's markup would show).
DESCRIPTION = (
    "lipdp: train Keras networks with differential privacy (Lipschitz networks without "
    "clipping, or clipped DP-SGD) and evaluate them."
)


class _Parser(argparse.ArgumentParser):
    """Errors as one line, ``lipdp <command>: error: ...``, exit status 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


# -------------------------------------------------------------------------- value types
def _defaults_text(setting) -> str:
    """``"512 (digits), 2048 (fashion_mnist), ...; 8192 for the clipless fashion_mnist
    scattering network"``: the help's statement of a data-set default (dp-sgd's, and the
    clipless networks' that differ)."""
    text = ", ".join(
        f"{getattr(values, setting):g} ({name})" for name, values in D.DEFAULTS.items()
    )
    networks = [
        f"{getattr(values, setting):g} for the clipless {dataset} {network} network"
        for (dataset, network), values in D.CLIPLESS_DEFAULTS.items()
        if getattr(values, setting) not in (None, getattr(D.DEFAULTS[dataset], setting))
    ]
    return "; ".join([text, *networks])


def _clipless_defaults_text(setting) -> str:
    """``"0.3 (digits scattering), none (fashion_mnist cnn), ..."``: the help's statement
    of a clipless network's default."""
    values = [
        (f"{dataset} {network}", getattr(d, setting))
        for (dataset, network), d in D.CLIPLESS_DEFAULTS.items()
    ]
    return ", ".join(f"{'none' if v is None else format(v, 'g')} ({name})" for name, v in values)


def _scattering_default_text() -> str:
    names = [name for name, network in D.CLIPLESS_NETWORKS.items() if network == "scattering"]
    return " and ".join(names) or "no data set"


def _sgd_networks_text(momentum=False) -> str:
    """The clipless networks whose default optimiser is SGD (with their momentum)."""
    names = [
        f"{values.momentum:g} for the {dataset} {network} network"
        if momentum
        else f"{dataset} {network}"
        for (dataset, network), values in D.CLIPLESS_DEFAULTS.items()
        if values.optimizer == "sgd"
    ]
    return ", ".join(names) or "no"


def _clip_or_none(text):
    """``--gradient-clip``: a number > 0, or ``none`` (no clipping: ``math.inf``)."""
    if text.strip().lower() in ("none", "off", "inf"):
        return math.inf
    return _positive_float(text)


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
_replicas = _number(int, lambda v: v >= 2, "an integer >= 2")


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


# ------------------------------------------------------------------------------ parsers
def make_parser() -> argparse.ArgumentParser:
    """The ``lipdp`` parser: ``train`` and ``evaluate`` (``args.command``)."""
    parser = _Parser(prog="lipdp", description=DESCRIPTION)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {sys.modules['lipdp'].__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summary = "train a private network under a privacy budget and report its test accuracy"
    train = commands.add_parser("train", help=summary, description=summary)
    _add_run_arguments(train)
    _add_save_argument(train)
    _add_evaluate_parser(commands)
    return parser


def subcommand_parsers(parser) -> dict:
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
    """The options of a training run, shared by ``train`` and ``evaluate``, in the order
    of the help (the order in which the refusals are checked, too)."""
    _add_data_arguments(parser)
    _add_budget_arguments(parser)
    _add_method_arguments(parser)
    _add_network_arguments(parser)
    _add_optimisation_arguments(parser)
    _add_adversarial_arguments(parser)
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


def _add_data_arguments(parser) -> None:
    parser.add_argument(
        "--dataset",
        choices=D.DATASETS,
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


def _add_budget_arguments(parser) -> None:
    """The privacy budget and the mechanism it buys (batch, noise, epochs, sampling)."""
    parser.add_argument(
        "--epsilon", type=_positive_float, default=3.0, help="privacy budget epsilon (default 3)"
    )
    parser.add_argument(
        "--delta",
        type=_probability,
        default=1e-5,
        help="privacy parameter delta, in (0, 1), below 1/N (the probability the guarantee "
        "fails; default 1e-5)",
    )
    parser.add_argument(
        "--allow-large-delta",
        action="store_true",
        help="accept --delta >= 1/N (refused otherwise: a mechanism releasing one record at "
        "random meets such a guarantee)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help=f"expected batch size b; default: {_defaults_text('batch_size')}",
    )
    parser.add_argument(
        "--physical-batch-size",
        type=_positive_int,
        default=None,
        metavar="P",
        help="compute each step P rows at a time and noise the logical batch (--batch-size) "
        "once: logical batches larger than memory, the same epsilon (default: whole batches)",
    )
    parser.add_argument(
        "--noise-multiplier",
        type=_positive_float,
        default=None,
        help=f"sigma, the noise standard deviation over the sensitivity; default: "
        f"{_defaults_text('noise_multiplier')}",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=None,
        help="default: the most epochs within the budget",
    )
    parser.add_argument(
        "--sampling",
        choices=D.SAMPLINGS,
        default="poisson",
        help="poisson (default): batches are Poisson samples of rate b/N, the mechanism the "
        "accountant analyses; shuffle: fixed-size batches of a shuffle, as the original "
        "package (the Poisson analysis is then an assumption)",
    )


def _add_method_arguments(parser) -> None:
    """The method, and clipped DP-SGD's clipping and ascent steps."""
    parser.add_argument(
        "--method",
        choices=D.METHODS,
        default="lipdp",
        help="lipdp (default): kernels kept at norm C, bounds from C; lip-dp-sgd: kernels in "
        "balls of radius C, bounds from their current norms (less noise when they shrink)",
    )
    parser.add_argument(
        "--clipping",
        choices=D.CLIPPING_MODES,
        default="flat",
        help="dp-sgd only: per-example clipping, flat min(1, R/|g|), per-layer (radius "
        "R/sqrt(K) for each of K layers; with --strategy per-layer, one mechanism per "
        "layer), automatic R/(|g|+0.01) or global R/Z below Z, 0 above (default flat)",
    )
    parser.add_argument(
        "--gradient-method",
        choices=D.GRADIENT_METHODS,
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


def _add_network_arguments(parser) -> None:
    """The network: logit-gradient clipping, kernel balls, group normalisation, scattering."""
    parser.add_argument(
        "--gradient-clip",
        type=_clip_or_none,
        default=None,
        metavar="C",
        help="lipdp / lip-dp-sgd: clip each example's loss gradient at the logits to norm C "
        "(DP_ClipGradient; every bound upstream uses C instead of the loss's own bound, no "
        "per-example parameter gradients), or 'none'; default: "
        f"{_clipless_defaults_text('gradient_clip')}",
    )
    parser.add_argument(
        "--tau",
        type=_positive_float,
        default=None,
        help="lipdp / lip-dp-sgd: temperature of the loss DP_TauCategoricalCrossentropy(tau); "
        f"default: {_clipless_defaults_text('tau')}",
    )
    parser.add_argument(
        "--weight-norm-bound",
        type=_positive_float,
        default=None,
        help="C, the radius of every kernel's norm ball; default: "
        f"{_clipless_defaults_text('weight_norm_bound')}",
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
        action=argparse.BooleanOptionalAction,
        default=None,
        help="images: a scattering front-end (Kymatio's J=2, L=8, no weights, certified "
        "Lipschitz constant), a group normalisation (--group-norm groups, default 27 per "
        "channel; alpha 1e-4) and a linear head (zoo.scattering_net; with dp-sgd the same "
        "layers and a Dense head); --no-scattering: the CNN. Default: on for the clipless "
        f"methods on {_scattering_default_text()}, off otherwise",
    )
    parser.add_argument(
        "--feature-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --scattering (and no adversarial training): compute the scattering "
        "features once and train the head on them, the same mechanism and model as "
        "recomputing them at every step, several times faster (default: on); "
        "--no-feature-cache recomputes them",
    )


def _add_optimisation_arguments(parser) -> None:
    """Averaging, noise strategy, devices, accountant and the optimiser."""
    parser.add_argument(
        "--averaging",
        type=_decay,
        default=None,
        help="evaluate the exponential moving average of the weights with this decay "
        "(e.g. 0.99; post-processing, no privacy cost)",
    )
    parser.add_argument(
        "--strategy",
        choices=D.NOISE_STRATEGIES,
        default="global",
        help="global (default): one Gaussian mechanism on the whole gradient; per-layer: one "
        "per layer, each with its own sensitivity (dp-sgd: with --clipping per-layer only)",
    )
    parser.add_argument(
        "--mirrored",
        type=_replicas,
        default=None,
        metavar="R",
        help="train under tf.distribute.MirroredStrategy over R devices: the first R GPUs, "
        "else the CPU split into R logical devices (same global batch, same noise and "
        "epsilon; the batch size must be divisible by R)",
    )
    parser.add_argument(
        "--accountant",
        choices=D.ACCOUNTANTS,
        default="rdp",
        help="rdp (default) or pld: upper bounds; gdp: the central-limit approximation of "
        "Bu et al. (not a proven bound, flagged in the report)",
    )
    parser.add_argument(
        "--learning-rate",
        type=_positive_float,
        default=None,
        help=f"step size of the optimiser; default: {_defaults_text('learning_rate')} "
        "(a clipless network's own default is for its own optimiser)",
    )
    parser.add_argument(
        "--optimizer",
        choices=D.OPTIMIZERS,
        default=None,
        help="adam or sgd (with --momentum; Tramer & Boneh's choice for linear heads on "
        "scattering features); the noise is added before the optimiser, so either is "
        "post-processing; default: adam, sgd for the clipless "
        f"{_sgd_networks_text()} network",
    )
    parser.add_argument(
        "--momentum",
        type=_decay,
        default=None,
        help="heavy-ball momentum of --optimizer sgd, in [0, 1); default: 0, "
        f"{_sgd_networks_text(momentum=True)}",
    )


def _add_adversarial_arguments(parser) -> None:
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
        choices=D.ADVERSARIAL_NORMS,
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
    _add_evaluation_arguments(evaluate)


def _add_evaluation_arguments(evaluate) -> None:
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
        choices=D.ADVERSARIAL_NORMS,
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


# ------------------------------------------------------------------ inapplicable flags
def explicit_options(argv) -> set:
    """The options typed on the command line (``{"--clip-norm", ...}``): ``argv`` parsed
    again with every default suppressed, so that a default never counts as the user's
    choice (``--clip-norm`` defaults to 1 for every method)."""
    parser = make_parser()
    for subparser in subcommand_parsers(parser).values():
        for action in subparser._actions:
            action.default = argparse.SUPPRESS
    typed = vars(parser.parse_args(argv))
    return {"--" + dest.replace("_", "-") for dest in typed}


def refuse_inapplicable_options(args, typed) -> None:
    """A ``ValueError`` (one line: the flag, why, the fix) for the first typed option that
    the run would ignore: the CLI never silently drops a flag the user chose."""
    refusals = _inapplicable_options(args)
    for flag in _option_order(subcommand_parsers(make_parser())[args.command]):
        if flag in typed and flag in refusals:
            raise ValueError(refusals[flag])


def _option_order(parser) -> list:
    """The long options of ``parser`` in the order of its ``--help``."""
    return [a.option_strings[-1] for a in parser._actions if a.option_strings]


def _inapplicable_options(args) -> dict:
    """``{flag: message}`` for every option that does not apply to the run ``args``
    describes (whether typed or not: the caller keeps the typed ones). Which setting
    applies to which method is decided by :mod:`lipdp.recipes.method_settings`, the
    recipes' table, with their messages."""
    if getattr(args, "model", None) is not None:
        refusals = _options_unused_by_a_saved_model()
    else:
        refusals = {
            "--" + setting.replace("_", "-"): message
            for setting, message in method_settings.inapplicable_settings(args).items()
        }
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


def _options_unused_by_a_saved_model() -> dict:
    """``evaluate --model``: no training, so every training option would be ignored; the
    data set, the accountant of the report and the seed of the evaluations still apply."""
    used = {"--dataset", "--data-dir", "--accountant", "--seed"}
    training = subcommand_parsers(make_parser())["train"]
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


# --------------------------------------------------------------- arguments -> recipe
def refuse_missing_settings(args) -> None:
    """A ``ValueError`` in the flags' words for a run that lacks a setting it needs (the
    recipe would refuse it too, in its fields' words)."""
    per_layer_clipping = args.clipping == "per-layer"
    if args.method == "dp-sgd" and args.strategy == "per-layer" and not per_layer_clipping:
        raise ValueError(
            f"--strategy per-layer needs --clipping per-layer with --method dp-sgd ("
            f"--clipping {args.clipping} bounds the whole gradient, not each layer's): add "
            "--clipping per-layer or drop --strategy."
        )
    if args.method == "dp-sgd" and args.clipping == "global" and args.clip_threshold is None:
        raise ValueError(
            "--clipping global needs --clip-threshold Z (the norm above which an "
            "example's gradient is dropped)."
        )
    if args.scattering and args.dataset not in D.IMAGE_DATASETS:
        raise ValueError(f"--scattering needs images; {args.dataset} is tabular.")
    net = D.clipless_defaults(args.dataset, args.scattering)
    adam_on_sgd = args.method != "dp-sgd" and net.optimizer == "sgd" and args.optimizer == "adam"
    if adam_on_sgd and args.learning_rate is None:
        raise ValueError(
            f"--optimizer adam needs --learning-rate: the default {net.learning_rate:g} is "
            f"the SGD rate of this network on {args.dataset}."
        )


def refuse_indivisible_batch(args) -> None:
    """``--batch-size`` (or its default) not divisible by ``--mirrored R``: refused, as
    the help says, before any data is read."""
    if args.mirrored is not None:
        size = batch_size(args)
        if size % args.mirrored:
            below = size - size % args.mirrored
            above = below + args.mirrored
            sizes = f"{below} or {above}" if below else f"{above}"
            raise ValueError(
                f"--batch-size {size} is not divisible by --mirrored {args.mirrored} (each "
                f"replica takes an equal share of the batch): use --batch-size {sizes}."
            )


def batch_size(args) -> int:
    """``--batch-size``, or the default of the data set and the network."""
    return args.batch_size or model_recipe(args).resolved().batch_size


def model_recipe(args):
    """The :class:`~lipdp.recipes.recipe_config.ModelRecipe` of ``args``: every recipe field that is
    an option (the options are named after the fields)."""
    from lipdp.recipes.recipe_config import ModelRecipe

    names = [f.name for f in dataclasses.fields(ModelRecipe) if hasattr(args, f.name)]
    return ModelRecipe(**{name: getattr(args, name) for name in names})


def run_config(args):
    """The :class:`~lipdp.recipes.recipe_config.RunConfig` of ``args``."""
    from lipdp.recipes.recipe_config import RunConfig

    return RunConfig(
        model_recipe(args),
        epsilon=args.epsilon,
        epochs=args.epochs,
        accountant=args.accountant,
        averaging=args.averaging,
        seed=args.seed,
        data_dir=args.data_dir,
        cache_features=args.feature_cache,
    )


def evaluation_config(args):
    """The :class:`~lipdp.recipes.run_evaluation.EvaluationConfig` of ``evaluate``'s
    ``args``."""
    from lipdp.recipes.run_evaluation import EvaluationConfig

    return EvaluationConfig(
        radii=tuple(args.radii),
        bins=args.bins,
        attack_steps=args.attack_steps,
        attack_restarts=args.attack_restarts,
        attack_norms=tuple(args.attack_norms),
        attack_examples=args.attack_examples,
        seed=args.seed,
    )
