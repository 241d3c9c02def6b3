"""Clipless DP-SGD on Keras 3's JAX backend against TensorFlow: digits (sklearn
``load_digits``, 8x8 images as 64 features, 10 classes) at epsilon = 3.

    .venv/bin/python benchmarks/clipless_jax_digits.py [--seeds 0 1 2 3 4] [--epochs 10] [--lr 0.1]

Each run is a subprocess of its own backend (``KERAS_BACKEND=jax`` / ``tensorflow``):
``lipdp.make_private(layers, method="clipless", epsilon=3, delta=1e-5, ...)`` on
``DP_BoundedInput(1) - DP_SpectralDense(128) - GroupSort(2) - DP_SpectralDense(10) -
DP_ClipGradient(1)`` (the dense slice ported to ``jax.jit``),
``DP_TauCategoricalCrossentropy(8)``, ``SGD(lr, momentum=0.9)`` (``--lr``, 0.1), Poisson
batches of expected size 64 from ``lipdp.private_batches``,
the same split (1437 training rows, 360 test rows, ``random_state=seed``) and the same seed for
the initial weights (``keras.utils.set_random_seed(seed)``; the initial kernels still differ
between backends, their random streams being different). Prints the test accuracy, epsilon
and the wall time of ``fit`` for each backend and seed; the privacy noise is not seeded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(seed: int, epochs: int, lr: float) -> dict:
    """One training run on the backend of this process (``KERAS_BACKEND``)."""
    sys.path.insert(0, str(ROOT))
    import keras
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import lipdp
    from lipdp.clipless import layers as L
    from lipdp.clipless.losses import DP_TauCategoricalCrossentropy
    from lipdp.core.callbacks import DP_Accountant

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    x -= x.mean(axis=0)
    y = np.eye(10, dtype="float32")[digits.target]
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=360, random_state=seed, stratify=digits.target
    )
    keras.utils.set_random_seed(seed)
    layers = [
        L.DP_BoundedInput(input_shape=(64,), upper_bound=1.0),
        L.DP_SpectralDense(128),
        L.DP_GroupSort(2),
        L.DP_SpectralDense(10),
        L.DP_ClipGradient(1.0),
    ]
    model = lipdp.make_private(
        layers, epsilon=3.0, delta=1e-5, epochs=epochs, batch_size=64,
        dataset_size=len(x_train), method="clipless", sampling="poisson",
    )  # fmt: skip
    model.compile(
        loss=DP_TauCategoricalCrossentropy(8.0),
        optimizer=keras.optimizers.SGD(lr, momentum=0.9),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    history = model.fit(
        lipdp.private_batches(model, x_train, y_train), epochs=epochs, verbose=0,
        callbacks=[DP_Accountant()],
    )  # fmt: skip
    wall = time.perf_counter() - start
    predictions = np.asarray(model.predict(x_test, verbose=0))
    accuracy = float(np.mean(predictions.argmax(axis=1) == y_test.argmax(axis=1)))
    return {
        "backend": keras.backend.backend(),
        "seed": seed,
        "epochs": epochs,
        "lr": lr,
        "sigma": model.dp_parameters.noise_multiplier,
        "epsilon": float(history.history["epsilon"][-1]),
        "test_accuracy": accuracy,
        "fit_seconds": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run(args.seeds[0], args.epochs, args.lr)))
        return
    results = []
    for seed in args.seeds:
        for backend in ("tensorflow", "jax"):
            env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
            done = subprocess.run(
                [sys.executable, __file__, "--one", "--seeds", str(seed), "--epochs",
                 str(args.epochs), "--lr", str(args.lr)],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    for backend in ("tensorflow", "jax"):
        accuracies = [r["test_accuracy"] for r in results if r["backend"] == backend]
        seconds = [r["fit_seconds"] for r in results if r["backend"] == backend]
        print(
            f"{backend}: test accuracy {min(accuracies):.3f}-{max(accuracies):.3f} "
            f"(mean {sum(accuracies) / len(accuracies):.3f}), fit {sum(seconds):.0f} s in all"
        )


if __name__ == "__main__":
    main()
