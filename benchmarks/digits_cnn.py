"""Utility of the small Lipschitz CNN on scikit-learn's digits (issue 2 reference run).

    .venv/bin/python benchmarks/digits_cnn.py [--epochs 40] [--seeds 3]

Trains the CNN of ``lipdp train`` on digits (``lipdp.recipes.zoo.pooled_cnn``, input bound 5):
DP_BoundedInput -> DP_QuickSpectralConv2D(16, 3) -> DP_GroupSort(2) ->
DP_ScaledL2NormPooling2D(2) -> DP_Flatten -> DP_QuickSpectralDense(10) with
DP_TauCategoricalCrossentropy(tau=8), Adam(0.02), batch 256, 1 536 training and 261
test images, for several noise multipliers and both noise strategies, and prints the
mean and spread of the test accuracy over seeds. The privacy budget (epsilon) of these
runs is computed by the accountant of issue 3.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from lipdp.clipless import losses  # noqa: E402
from lipdp.clipless.model import DPParameters  # noqa: E402
from lipdp.pipeline import DatasetMetadata  # noqa: E402
from lipdp.recipes import zoo

N_TRAIN, BATCH = 1536, 256


def make_model(sigma, strategy):
    meta = DatasetMetadata(
        input_shape=(8, 8, 1), nb_classes=10, nb_samples_train=N_TRAIN, batch_size=BATCH
    )
    params = DPParameters(strategy, sigma, 1e-5, non_private=sigma == 0)
    model = zoo.build_model("pooled_cnn", meta, params, upper_bound=5.0, widths=(16,))
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=8.0),
        optimizer=tf.keras.optimizers.Adam(0.02),
        metrics=["accuracy"],
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    data = load_digits()
    x = (data.images[..., None] / 16.0).astype("float32")
    y = np.eye(10, dtype="float32")[data.target]
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, train_size=N_TRAIN, random_state=0, stratify=data.target
    )
    print(
        f"| noise multiplier | strategy | test accuracy (mean ± std over {args.seeds} seeds) "
        "| seconds per run |"
    )
    print("| --- | --- | --- | --- |")
    for sigma, strategy in [
        (0.0, "global"),
        (1.0, "global"),
        (1.0, "per-layer"),
        (2.0, "global"),
        (4.0, "global"),
    ]:
        accuracies, start = [], time.perf_counter()
        for seed in range(args.seeds):
            tf.keras.utils.set_random_seed(seed)
            model = make_model(sigma, strategy)
            model.fit(x_train, y_train, batch_size=BATCH, epochs=args.epochs, verbose=0)
            accuracies.append(model.evaluate(x_test, y_test, verbose=0)[1])
        seconds = (time.perf_counter() - start) / args.seeds
        label = "0 (non-private reference)" if sigma == 0 else f"{sigma:g}"
        print(
            f"| {label} | {strategy} | {np.mean(accuracies):.3f} ± {np.std(accuracies):.3f} "
            f"| {seconds:.1f} |"
        )


if __name__ == "__main__":
    main()
