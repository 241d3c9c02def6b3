"""Breast cancer (569 x 30): Lip-DP-SGD, with and without group normalisation, fixed-norm
lipdp, and clipped DP-SGD (tensorflow-privacy), at (epsilon, delta = 1/n).

    .venv/bin/python benchmarks/breast_cancer_utility.py [--trials 6] [--seeds 10]
        [--epsilons 1.672 1.0] [--methods lip-dp-sgd lip-dp-sgd+gn fixed-norm dp-sgd]

Protocol (Barczewski & Ramon, Table 1 / 5: 80/20 split, 10 runs, delta = 1/n):

* Data: scikit-learn's Wisconsin diagnostic set, every feature clipped to its public
  range and mapped to [-1, 1] (``lipdp.data.sources.load_breast_cancer``: no statistic of
  the rows is used; row norm <= sqrt(30)); stratified 80/20 split (455 / 114).
  ``delta = 1 / 569``.
* Search (not private, as in the paper): every method gets the same number of
  configurations (``--trials``), the first ones of a fixed seeded sample of its grid;
  each is scored by its mean test accuracy on two *search splits* (split seeds 100 and
  101). The best configuration is then trained on ``--seeds`` fresh splits (seeds 0..9):
  split, initialisation, batches and noise all change; the table reports mean ± std.
* Noise: for every configuration the smallest noise multiplier whose epsilon after the
  epochs is <= the target (``lipdp.accounting.calibrate_noise_multiplier``); lipdp's
  epsilon is recomputed from the trained model (``get_eps_delta``), DP-SGD's with
  dp_accounting's RDP accountant.

Methods (one hidden layer of 32 units, ReLU, cross-entropy, Adam):

* ``lip-dp-sgd``: ``lipdp.recipes.zoo.lip_mlp``: kernels in spectral balls of radius C, bounds
  from the current norms (``adaptive_norm=True``), Poisson batches, global noise.
  Searched: batch, epochs, learning rate, C, tau, and the public row-norm bound
  (``DP_BoundedInput`` clips every row to it: 2, 3 or sqrt(30)).
* ``lip-dp-sgd+gn``: the same with ``DP_GroupNormalization(4 groups, alpha)`` after the
  hidden layer. Searched: the same plus alpha.
* ``fixed-norm``: the original lipdp method on the same network: orthogonal kernels
  times C, bounds from C (``adaptive_norm=False``; the paper's Fix-Lip-DP-SGD).
* ``dp-sgd``: per-example clipping, ``tensorflow_privacy.DPSequential`` (fast clipping)
  on Dense(32, relu) -> Dense(2) with biases; shuffled fixed-size batches accounted as
  Poisson (as every DP-SGD library does). Searched: batch, epochs, learning rate, clip.

Published (paper, epsilon = 1.672, delta = 1/n): DP-SGD 0.773 (0.813 with GN),
Lip-DP-SGD 0.798 (0.924 with GN), Fix-Lip-DP-SGD 0.700.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import dp_sgd_epsilon, machine_description  # noqa: E402

from lipdp.accounting import calibrate_noise_multiplier, get_eps_delta  # noqa: E402
from lipdp.clipless import losses  # noqa: E402
from lipdp.clipless.model import DPParameters  # noqa: E402
from lipdp.data.sources import load_breast_cancer  # noqa: E402
from lipdp.foundation.metadata import DatasetMetadata  # noqa: E402
from lipdp.pipeline import poisson_batches  # noqa: E402
from lipdp.recipes import zoo

N_TOTAL = 569
DELTA = 1.0 / N_TOTAL
INPUT_BOUND = math.sqrt(30.0)
SEARCH_SPLITS = (100, 101)
WIDTH = 32

#: The grid of every method; the search takes the first ``--trials`` of a seeded shuffle.
GRID = {
    "batch": (64, 128),
    "epochs": (15, 30, 60),
    "lr": (0.01, 0.03, 0.1),
    "norm": (1.0, 3.0, 10.0),  # C (weight-norm bound) or the clipping norm
    "tau": (2.0, 8.0),  # lipdp only
    "bound": (2.0, 3.0, INPUT_BOUND),  # lipdp only: rows clipped to this norm
    "alpha": (0.05, 0.2, 1.0),  # group normalisation only
}


def configurations(method, count):
    keys = ["batch", "epochs", "lr", "norm"]
    if method != "dp-sgd":
        keys += ["tau", "bound"]
    if method == "lip-dp-sgd+gn":
        keys.append("alpha")
    grid = [dict(zip(keys, values)) for values in itertools.product(*(GRID[k] for k in keys))]
    order = np.random.default_rng(12).permutation(len(grid))
    return [grid[i] for i in order[:count]]


def _one_hot(y):
    return np.eye(2, dtype="float32")[y]


def run_lipdp(method, config, epsilon, seed):
    data = load_breast_cancer(seed=seed)
    n = len(data.x_train)
    batch, epochs = config["batch"], config["epochs"]
    sigma = calibrate_noise_multiplier(epsilon, epochs, batch, n, DELTA, tol=1e-3)
    metadata = DatasetMetadata(
        input_shape=(30,),
        nb_classes=2,
        nb_samples_train=n,
        nb_samples_test=len(data.x_test),
        batch_size=batch,
        max_norm=config["bound"],  # DP_BoundedInput clips every row to it
        sampling="poisson",
    )
    adaptive = method != "fixed-norm"
    tf.keras.utils.set_random_seed(seed)
    model = zoo.build_model(
        "lip_mlp",
        metadata,
        DPParameters("global", sigma, DELTA),
        width=WIDTH,
        weight_norm_bound=config["norm"],
        adaptive_norm=adaptive,
        constraint="spectral" if adaptive else "orthogonal",
        group_norm=4 if method == "lip-dp-sgd+gn" else None,
        alpha=config.get("alpha", 1.0),
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=config["tau"]),
        optimizer=tf.keras.optimizers.Adam(config["lr"]),
        metrics=["accuracy"],
    )
    batches = poisson_batches(
        data.x_train, _one_hot(data.y_train), metadata.sampling_rate, metadata.nb_steps_per_epochs
    )
    model.fit(batches, epochs=epochs, verbose=0)
    spent, _ = get_eps_delta(model, epochs)
    assert spent <= epsilon * (1 + 1e-6), spent
    accuracy = float(np.mean(model.predict(data.x_test, verbose=0).argmax(1) == data.y_test))
    return accuracy, spent, sigma


def run_dp_sgd(config, epsilon, seed):
    import tensorflow_privacy as tfp
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry

    data = load_breast_cancer(seed=seed)
    n = len(data.x_train)
    batch, epochs = config["batch"], config["epochs"]
    sigma = calibrate_noise_multiplier(epsilon, epochs, batch, n, DELTA, tol=1e-3)
    tf.keras.utils.set_random_seed(seed)
    model = tfp.DPSequential(
        l2_norm_clip=config["norm"],
        noise_multiplier=sigma,
        use_xla=False,
        layer_registry=layer_registry.make_default_layer_registry(),
        layers=[
            tf.keras.layers.Dense(WIDTH, activation="relu", input_shape=(30,)),
            tf.keras.layers.Dense(2),
        ],
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.Adam(config["lr"]),
    )
    keep = n - n % batch  # fixed-size batches: drop the remainder
    model.fit(
        data.x_train[:keep],
        _one_hot(data.y_train[:keep]),
        batch_size=batch,
        epochs=epochs,
        verbose=0,
    )
    spent = dp_sgd_epsilon(sigma, batch / n, epochs * (n // batch), DELTA)
    assert spent <= epsilon * (1 + 1e-3), spent
    accuracy = float(np.mean(model.predict(data.x_test, verbose=0).argmax(1) == data.y_test))
    return accuracy, spent, sigma


def run(method, config, epsilon, seed):
    if method == "dp-sgd":
        return run_dp_sgd(config, epsilon, seed)
    return run_lipdp(method, config, epsilon, seed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.672, 1.0])
    parser.add_argument(
        "--methods", nargs="+", default=["lip-dp-sgd", "lip-dp-sgd+gn", "fixed-norm", "dp-sgd"]
    )
    args = parser.parse_args()
    print(
        f"Machine: {machine_description()}. delta = 1/{N_TOTAL}; {args.trials} configurations "
        f"per method scored on splits {SEARCH_SPLITS}; best one on splits 0..{args.seeds - 1}.\n"
    )
    rows = []
    for epsilon in args.epsilons:
        for method in args.methods:
            start = time.perf_counter()
            scored = []
            for config in configurations(method, args.trials):
                accuracies = [run(method, config, epsilon, s)[0] for s in SEARCH_SPLITS]
                scored.append((float(np.mean(accuracies)), config))
                print(
                    f"  eps {epsilon:g} {method} {config}: search {scored[-1][0]:.3f}", flush=True
                )
            search_score, best = max(scored, key=lambda item: item[0])
            results = [run(method, best, epsilon, seed) for seed in range(args.seeds)]
            accuracy = np.array([r[0] for r in results])
            spent = max(r[1] for r in results)
            seconds = time.perf_counter() - start
            rows.append((epsilon, method, accuracy, spent, results[0][2], best, seconds))
            print(
                f"eps {epsilon:g} {method}: {accuracy.mean():.3f} ± {accuracy.std():.3f} "
                f"(search {search_score:.3f}, {seconds:.0f} s)",
                flush=True,
            )
    print(
        "\n| epsilon target | method | test accuracy, mean ± std over splits | "
        "epsilon spent (max) | noise multiplier | chosen configuration | wall time |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for epsilon, method, accuracy, spent, sigma, best, seconds in rows:
        print(
            f"| {epsilon:g} | {method} | {accuracy.mean():.3f} ± {accuracy.std():.3f} | "
            f"{spent:.3f} | {sigma:.3f} | {best} | {seconds:.0f} s |"
        )


if __name__ == "__main__":
    main()
