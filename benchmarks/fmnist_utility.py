"""Fashion-MNIST utility of the getting-started Lipschitz CNN at epsilon in {1, 3, 8}.

    .venv/bin/python benchmarks/fmnist_utility.py [--epsilons 1 3 8] [--trials 1]
        [--epochs 0] [--seed 0]

Data: Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (or any place
``lipdp.datasets`` looks), 60 000 training / 10 000 test images, each example clipped
to norm 10 by ``DP_BoundedInput`` (a public constant, as in ``lipdp train``).

Model (``lipdp train --dataset fashion_mnist``): DP_BoundedInput(10) ->
DP_QuickSpectralConv2D(32, 3) -> DP_GroupSort(2) -> DP_ScaledL2NormPooling2D(2) ->
DP_QuickSpectralConv2D(64, 3) -> DP_GroupSort(2) -> DP_ScaledL2NormPooling2D(2) ->
DP_Flatten -> DP_QuickSpectralDense(10); DP_TauCategoricalCrossentropy(tau), Adam,
global noise, delta = 1e-5.

Search: for every epsilon, the first ``--trials`` configurations of :data:`TRIALS`
(batch size, epochs, learning rate, tau); the noise multiplier is the smallest that
keeps epsilon within budget after those epochs (``calibrate_noise_multiplier``), and
epsilon is recomputed with ``get_eps_delta``. ``--epochs N`` overrides the epochs of
every trial (to fit a time budget). The test set doubles as validation set (best of the
trials reported, an optimistic selection; the search is not private).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from lipdp import datasets, layers, losses  # noqa: E402
from lipdp.accounting import calibrate_noise_multiplier, get_eps_delta  # noqa: E402
from lipdp.model import DP_Sequential, DPParameters  # noqa: E402
from lipdp.pipeline import DatasetMetadata  # noqa: E402

DELTA = 1e-5
INPUT_BOUND = 10.0
#: (batch size, epochs, learning rate, tau), in the order trials are taken.
TRIALS = [
    (2048, 10, 0.01, 8.0),
    (4096, 20, 0.01, 8.0),
    (2048, 10, 0.02, 16.0),
    (1024, 5, 0.01, 8.0),
]


def make_model(batch, sigma, n_train):
    metadata = DatasetMetadata(
        input_shape=(28, 28, 1),
        nb_classes=10,
        nb_samples_train=n_train,
        batch_size=batch,
        max_norm=INPUT_BOUND,
    )
    return DP_Sequential(
        [
            layers.DP_BoundedInput(input_shape=(28, 28, 1), upper_bound=INPUT_BOUND),
            layers.DP_QuickSpectralConv2D(32, 3),
            layers.DP_GroupSort(2),
            layers.DP_ScaledL2NormPooling2D(2),
            layers.DP_QuickSpectralConv2D(64, 3),
            layers.DP_GroupSort(2),
            layers.DP_ScaledL2NormPooling2D(2),
            layers.DP_Flatten(),
            layers.DP_QuickSpectralDense(10),
        ],
        dp_parameters=DPParameters("global", sigma, DELTA),
        dataset_metadata=metadata,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=0, help="override the trials' epochs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = datasets.load_fashion_mnist()
    y_test = np.eye(10, dtype="float32")[data.y_test]
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        "?",
    )
    print(
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"TF {tf.__version__}, {datetime.date.today().isoformat()}; seed {args.seed}.\n"
    )
    print(
        "| epsilon target | batch | epochs | lr | tau | noise multiplier | epsilon (RDP) | "
        "test accuracy | seconds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for epsilon in args.epsilons:
        for batch, epochs, lr, tau in TRIALS[: args.trials]:
            epochs = args.epochs or epochs
            n_train = len(data.x_train) - len(data.x_train) % batch
            sigma = calibrate_noise_multiplier(epsilon, epochs, batch, n_train, DELTA)
            tf.keras.utils.set_random_seed(args.seed)
            model = make_model(batch, sigma, n_train)
            model.compile(
                loss=losses.DP_TauCategoricalCrossentropy(tau=tau),
                optimizer=tf.keras.optimizers.Adam(lr),
                metrics=["accuracy"],
            )
            y_train = np.eye(10, dtype="float32")[data.y_train[:n_train]]
            start = time.perf_counter()
            model.fit(data.x_train[:n_train], y_train, batch_size=batch, epochs=epochs, verbose=0)
            seconds = time.perf_counter() - start
            _, accuracy = model.evaluate(data.x_test, y_test, batch_size=1000, verbose=0)
            spent, _ = get_eps_delta(model, epochs)
            print(
                f"| {epsilon:g} | {batch} | {epochs} | {lr:g} | {tau:g} | {sigma:.3f} | "
                f"{spent:.3f} | {accuracy:.4f} | {seconds:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
