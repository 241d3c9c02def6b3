"""Does one power iteration per projection keep the Quick layers orthogonal?

    .venv/bin/python benchmarks/power_iterations_check.py [--arch dense|cnn] [--epochs 10]

Supports fix proposal 2 of benchmarks/README.md (power_iterations 8 -> 1 in the Quick
layers). The bound never depends on the power iteration (the orthogonal projection
divides by ``max(sigma_est (1 + margin), sqrt(Gershgorin) / 2)`` before Björck, see
``lipdp.clipless.projections``); the estimate only decides how close to orthogonal the projected
kernel is. This trains the benchmark network of ``step_speed.py`` (global noise,
sigma = 1, Adam(0.05), batch 256, random data) with the default 8 and with 1 power
iteration and prints the extreme and mean singular values of every kernel at the end
(orthogonal: all 1).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from step_speed import _lipdp_layers, _shape  # noqa: E402

from lipdp.clipless import losses  # noqa: E402
from lipdp.clipless.model import DP_Sequential, DPParameters  # noqa: E402
from lipdp.pipeline import DatasetMetadata  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["dense", "cnn"], default="dense")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    batch = 256
    shape, classes = _shape(args.arch)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (20 * batch, *shape)).astype("float32")
    y = np.eye(classes, dtype="float32")[rng.integers(0, classes, 20 * batch)]
    print(f"{args.arch}, {args.epochs} epochs of 20 steps\n")
    print("| power iterations | kernel | max singular value | min | mean |")
    print("| --- | --- | --- | --- | --- |")
    for power in (8, 1):
        tf.keras.utils.set_random_seed(0)
        metadata = DatasetMetadata(
            input_shape=shape, nb_classes=classes, nb_samples_train=len(x), batch_size=batch
        )
        model = DP_Sequential(
            _lipdp_layers(args.arch, power_iterations=power),
            dp_parameters=DPParameters("global", 1.0, 1e-5),
            dataset_metadata=metadata,
        )
        model.compile(
            loss=losses.DP_TauCategoricalCrossentropy(8.0),
            optimizer=tf.keras.optimizers.Adam(0.05),
        )
        model.fit(x, y, batch_size=batch, epochs=args.epochs, verbose=0)
        for i, layer in enumerate(k for k in model.dp_layers if hasattr(k, "kernel_matrix")):
            sv = np.linalg.svd(layer.kernel_matrix().numpy(), compute_uv=False)
            print(
                f"| {power} | {i} {tuple(layer.kernel.shape)} | {sv.max():.6f} | {sv.min():.6f} "
                f"| {sv.mean():.6f} |"
            )


if __name__ == "__main__":
    main()
