"""Is lipdp's Fashion-MNIST accuracy limited by the noise or by the network?

    .venv/bin/python benchmarks/fmnist_capacity.py

Companion of ``fmnist_utility.py`` (same data pipeline, same lipdp CNN, seed 0): the
tutorial network trained without noise (``non_private=True``: same step and projections)
gives the accuracy the private runs cannot exceed; a 2x wider network at epsilon = 3
shows whether capacity alone helps under noise.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from fmnist_utility import DELTA, accuracy, batches, lipdp_model, load  # noqa: E402

from lipdp.accounting import calibrate_noise_multiplier, get_eps_delta  # noqa: E402
from lipdp.clipless import losses  # noqa: E402
from lipdp.pipeline import bound_normalize  # noqa: E402

#: (label, widths, batch, epochs, learning rate, tau, epsilon target or None).
RUNS = [
    ("non-private", (16, 64), 2000, 15, 5e-3, 64.0, None),
    ("non-private", (16, 64), 500, 15, 2e-3, 64.0, None),
    ("private", (32, 128), 2000, 5, 5e-3, 64.0, 3.0),
    ("non-private", (32, 128), 2000, 15, 5e-3, 64.0, None),
]


def run(data, widths, batch, epochs, lr, tau, epsilon):
    x_train, y_train, x_test, y_test = data
    n = len(x_train)
    sigma = 0.0 if epsilon is None else calibrate_noise_multiplier(epsilon, epochs, batch, n, DELTA)
    tf.keras.utils.set_random_seed(0)
    model = lipdp_model(batch, sigma, n, widths)
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=tau), optimizer=tf.keras.optimizers.Adam(lr)
    )
    start = time.perf_counter()
    model.fit(batches(x_train, y_train, batch, 0), epochs=epochs, verbose=0)
    seconds = time.perf_counter() - start
    spent = "-" if epsilon is None else f"{get_eps_delta(model, epochs)[0]:.3f}"
    return sigma, spent, accuracy(model, x_test, y_test), seconds


def main():
    x_train, y_train, x_test, y_test = load(quick=False)
    normalize, _ = bound_normalize()
    data = (normalize(x_train).numpy(), y_train, normalize(x_test).numpy(), y_test)
    print("| run | widths | batch | epochs | lr | tau | sigma | epsilon | test accuracy | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, widths, batch, epochs, lr, tau, epsilon in RUNS:
        sigma, spent, acc, seconds = run(data, widths, batch, epochs, lr, tau, epsilon)
        print(
            f"| {label} | {widths[0]}-{widths[1]} | {batch} | {epochs} | {lr:g} | {tau:g} | "
            f"{sigma:.3f} | {spent} | {100 * acc:.2f} % | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
