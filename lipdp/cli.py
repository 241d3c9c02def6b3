"""The ``lipdp`` command.

``lipdp train`` trains a Lipschitz CNN under a privacy budget and prints the privacy
report and the test accuracy. With no option it uses scikit-learn's digits (bundled)
and (epsilon, delta) = (3, 1e-5); the number of epochs is the largest one that stays
within the budget (``get_max_epochs``) unless ``--epochs`` is given.

``lipdp evaluate`` trains the same model (or loads a saved one with ``--model PATH``)
and prints the privacy report, the test accuracy, the certified accuracy at a few
radii, the calibration errors and the AUROC of membership-inference attacks (see
:mod:`lipdp.evaluation`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

#: Public input-norm bounds per data set. They are constants, never computed from the
#: private data (a data-dependent bound would itself leak, rule S6).
INPUT_BOUNDS = {"digits": 5.0, "fashion_mnist": 10.0}

#: Channels of the convolution blocks of the CLI's CNN (:func:`lipdp.zoo.pooled_cnn`).
CNN_WIDTHS = {"digits": (16,), "fashion_mnist": (32, 64)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lipdp", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a Lipschitz CNN under a privacy budget")
    _add_run_arguments(train)
    train.set_defaults(handler=train_command)
    _add_evaluate_parser(commands)
    return parser


def _add_run_arguments(parser) -> None:
    """The options of a training run, shared by ``train`` and ``evaluate``."""
    parser.add_argument("--dataset", choices=sorted(INPUT_BOUNDS), default="digits")
    parser.add_argument("--data-dir", default=None, help="directory of IDX files (fashion_mnist)")
    parser.add_argument("--epsilon", type=float, default=3.0, help="privacy budget epsilon")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument(
        "--batch-size", type=int, default=None, help="default: 512 (digits), 2048 (fashion_mnist)"
    )
    parser.add_argument(
        "--noise-multiplier",
        type=float,
        default=None,
        help="default: 6.0 (digits), 2.0 (fashion_mnist)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="default: the most epochs within the budget"
    )
    parser.add_argument("--strategy", choices=["global", "per-layer"], default="global")
    parser.add_argument("--accountant", choices=["rdp", "pld"], default="rdp")
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_evaluate_parser(commands) -> None:
    evaluate = commands.add_parser(
        "evaluate",
        help="train (or load) a model and report privacy, accuracy, certified accuracy, "
        "calibration and membership inference",
    )
    evaluate.add_argument(
        "--model", default=None, help="a saved .keras lipdp model to evaluate (no training)"
    )
    evaluate.add_argument("--save", default=None, help="save the trained model to this .keras path")
    _add_run_arguments(evaluate)
    evaluate.add_argument(
        "--radii",
        type=float,
        nargs="+",
        default=[0.0, 0.05, 0.1, 0.2, 0.5],
        help="l2 radii of the certified accuracy",
    )
    evaluate.add_argument("--bins", type=int, default=15, help="confidence bins of the ECE")
    evaluate.set_defaults(handler=evaluate_command)


_DEFAULTS = {
    # dataset: batch size, noise multiplier, learning rate
    "digits": (512, 6.0, 0.02),
    "fashion_mnist": (2048, 2.0, 0.01),
}


def _load(name, data_dir):
    from lipdp import datasets

    if name == "digits":
        return datasets.load_digits()
    return datasets.load_fashion_mnist(data_dir)


def _build_model(data, args, batch_size, sigma):
    """The CLI's model (architecture: :func:`lipdp.zoo.pooled_cnn`) and training arrays."""
    import numpy as np

    from lipdp import zoo
    from lipdp.model import DPParameters
    from lipdp.pipeline import DatasetMetadata

    n_train = len(data.x_train) - len(data.x_train) % batch_size
    metadata = DatasetMetadata(
        input_shape=data.x_train.shape[1:],
        nb_classes=data.nb_classes,
        nb_samples_train=n_train,
        nb_samples_test=len(data.x_test),
        class_names=data.class_names,
        batch_size=batch_size,
        max_norm=INPUT_BOUNDS[args.dataset],
    )
    model = zoo.build_model(
        "pooled_cnn",
        metadata,
        DPParameters(args.strategy, sigma, args.delta),
        widths=CNN_WIDTHS[args.dataset],
    )
    y_train = np.eye(data.nb_classes, dtype="float32")[data.y_train[:n_train]]
    return model, data.x_train[:n_train], y_train


def _train_private_model(args, data, verb):
    """Build, compile and train the CLI's model under the budget of ``args``.

    Returns ``(model, x_train, y_train, seconds)``.
    """
    import tensorflow as tf

    from lipdp import losses
    from lipdp.model import DP_Accountant
    from lipdp.sensitivity import get_max_epochs

    default_batch, default_sigma, default_lr = _DEFAULTS[args.dataset]
    batch_size = args.batch_size or default_batch
    sigma = args.noise_multiplier or default_sigma
    if batch_size > len(data.x_train):
        raise SystemExit(f"--batch-size {batch_size} exceeds the {len(data.x_train)} examples.")
    model, x_train, y_train = _build_model(data, args, batch_size, sigma)
    epochs = args.epochs
    if epochs is None:
        epochs = get_max_epochs(args.epsilon, model, accountant=args.accountant)
    print(
        f"lipdp {verb}: {args.dataset}, {len(x_train)} training examples, batch {batch_size}, "
        f"noise multiplier {sigma}, {args.strategy} noise, budget (epsilon = {args.epsilon}, "
        f"delta = {args.delta}) -> {epochs} epochs"
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=8.0),
        optimizer=tf.keras.optimizers.Adam(args.learning_rate or default_lr),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0 if args.quiet else 1,
        callbacks=[DP_Accountant(epsilon_budget=args.epsilon, accountant=args.accountant)],
    )
    return model, x_train, y_train, time.perf_counter() - start


def train_command(args) -> int:
    import numpy as np
    import tensorflow as tf

    from lipdp.report import privacy_report

    tf.keras.utils.set_random_seed(args.seed)
    data = _load(args.dataset, args.data_dir)
    model, _, _, seconds = _train_private_model(args, data, "train")
    y_test = np.eye(data.nb_classes, dtype="float32")[data.y_test]
    _, accuracy = model.evaluate(data.x_test, y_test, verbose=0)
    print()
    print(privacy_report(model, accountant=args.accountant))
    print(f"test accuracy: {accuracy:.4f} ({len(data.x_test)} images, {seconds:.1f} s training)")
    return 0


def evaluate_command(args) -> int:
    """``lipdp evaluate``: the privacy report and the evaluations of lipdp.evaluation.

    Membership inference reads the training data: it is an empirical audit for the
    data owner, not part of the DP release.
    """
    import numpy as np
    import tensorflow as tf

    import lipdp.layers  # noqa: F401  (registers the layers for load_model)
    import lipdp.losses  # noqa: F401
    import lipdp.model  # noqa: F401
    from lipdp import evaluation
    from lipdp.report import privacy_report

    tf.keras.utils.set_random_seed(args.seed)
    data = _load(args.dataset, args.data_dir)
    if args.model is not None:
        model = tf.keras.models.load_model(args.model)
        metadata = model.dataset_metadata
        n_train = len(data.x_train) if metadata is None else metadata.nb_samples_train
        x_train = data.x_train[:n_train]
        y_train = np.eye(data.nb_classes, dtype="float32")[data.y_train[:n_train]]
        print(f"lipdp evaluate: {args.model} on {args.dataset}")
    else:
        model, x_train, y_train, _ = _train_private_model(args, data, "evaluate")
        if args.save:
            model.save(args.save)
            print(f"saved to {args.save}")

    print()
    optimizer = getattr(model, "optimizer", None)
    metadata = model.dataset_metadata
    if optimizer is not None and metadata is not None:
        print(privacy_report(model, accountant=args.accountant))
    else:
        print("privacy report: unavailable (the model has no optimizer state or metadata)")
    print()
    x_test, y_test = data.x_test, data.y_test
    lipschitz = evaluation.lipschitz_constant(model)
    certified = evaluation.certified_accuracy(model, x_test, y_test, args.radii, lipschitz)
    probs = evaluation.predict_probabilities(model, x_test)
    calibration = evaluation.calibration_report(probs, y_test, args.bins)
    mia = evaluation.membership_inference(model, x_train, y_train, x_test, y_test, seed=args.seed)
    summary = mia.summary()
    print(f"test accuracy: {calibration.accuracy:.4f} ({len(x_test)} images)")
    print(f"Lipschitz constant (from the layers): {lipschitz:.6g}")
    print("certified accuracy (l2 radius: accuracy):")
    for radius, value in zip(args.radii, certified):
        print(f"  {radius:g}: {value:.4f}")
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


def main(argv=None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"lipdp: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
