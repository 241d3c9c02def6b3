"""The default command of each family on digits and breast cancer, several runs each
(issue 29).

    .venv/bin/python benchmarks/clipless_defaults.py [--dataset digits] [--runs 5] [--only NAME ...]
    .venv/bin/python benchmarks/clipless_defaults.py --search [--seeds 0 1 2]

``--runs``: every contender is ``lipdp train`` with the options of its row (built by
:func:`lipdp.recipes.runs.train`, the command's own code path), at the budget of the data
set: (epsilon, delta) = (3, 1e-5) on digits (the command's default), (1.672, 1/569) on
breast cancer (the budget of Lip-DP-SGD's table), trained ``--runs`` times
(initialisation seeds 0, 1, ...;
the privacy noise and the Poisson batches draw from the operating system). Prints one
JSON line per run and a table of mean, standard deviation, minimum and maximum of the test
accuracy (digits: 261 images, one is 0.38 points; breast cancer: 114 rows, one is 0.88
points), the epsilon the accountant logged and the wall time.

``--search``: the private random search of Papernot & Steinke
(:func:`lipdp.recipes.tuning.private_random_search`) over the clipless settings of the
table (network, logit-gradient clip, temperature, learning rate), ``K`` geometric with
E[K] = 3, the noise multiplier of every run calibrated so that the **whole search** meets
epsilon = 3 (:func:`lipdp.accounting.calibrate_noise_multiplier` with ``search=``), each
run scored on 300 training images held out (treated as public, like the validation set
of ``fmnist_scattering.py``), the selected run's test accuracy reported. This is the
accuracy a user gets when the search is paid for in epsilon, not the optimistic "best
configuration" of the ``--runs`` table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

#: ``dataset -> {name -> (ModelRecipe options, the command line it stands for)}``.
DIGITS = {
    "lipdp (default)": ({}, "lipdp train"),
    "lipdp, CNN": ({"scattering": False}, "lipdp train --no-scattering"),
    "lipdp, before issue 29": (
        {"scattering": False, "gradient_clip": math.inf, "learning_rate": 0.02},
        "lipdp train --no-scattering --gradient-clip none --learning-rate 0.02",
    ),
    "dp-sgd (default)": ({"method": "dp-sgd"}, "lipdp train --method dp-sgd"),
    "dp-sgd, scattering": (
        {"method": "dp-sgd", "scattering": True},
        "lipdp train --method dp-sgd --scattering",
    ),
}
_BC = "lipdp train --dataset breast_cancer --epsilon 1.672 --delta 0.0017575"
BREAST_CANCER = {
    "lipdp (default)": ({}, _BC),
    "lipdp, Lip-DP-SGD": ({"method": "lip-dp-sgd"}, f"{_BC} --method lip-dp-sgd"),
    "dp-sgd (default)": ({"method": "dp-sgd"}, f"{_BC} --method dp-sgd"),
    "dp-sgd, before issue 29": (
        {"method": "dp-sgd", "noise_multiplier": 2.0},
        f"{_BC} --method dp-sgd --noise-multiplier 2",
    ),
}
_FM = "lipdp train --dataset fashion_mnist"
#: The CNNs (end to end from pixels) take 40-50 min per run here: their figures are the
#: earlier benchmarks' (benchmarks/README.md, "Calibration of clipped DP-SGD").
FASHION_MNIST = {
    "lipdp (default)": ({}, _FM),
    "dp-sgd, scattering": (
        {"method": "dp-sgd", "scattering": True},
        f"{_FM} --method dp-sgd --scattering",
    ),
}
CONTENDERS = {"digits": DIGITS, "breast_cancer": BREAST_CANCER, "fashion_mnist": FASHION_MNIST}
BUDGETS = {"digits": (3.0, 1e-5), "breast_cancer": (1.672, 1 / 569), "fashion_mnist": (3.0, 1e-5)}

#: The search space of ``--search`` (every value is one a user can pass to ``lipdp train``).
SPACE = {
    "scattering": (True, False),
    "gradient_clip": (math.inf, 1.0, 0.3, 0.1),
    "tau_factor": (0.5, 1.0, 2.0),  # times the network's default temperature
    "learning_rate": (0.005, 0.01, 0.02),
}
EPSILON, DELTA, SEARCH_EPOCHS, HELD_OUT = 3.0, 1e-5, 46, 300


def run_contender(dataset, name, seed, data):
    from lipdp.recipes import runs

    options, _ = CONTENDERS[dataset][name]
    epsilon, delta = BUDGETS[dataset]
    recipe = runs.ModelRecipe(dataset=dataset, delta=delta, **options)
    start = time.perf_counter()
    trained = runs.train(runs.RunConfig(model=recipe, epsilon=epsilon, seed=seed), data=data)
    history = trained.history.history
    return dict(
        contender=name,
        seed=seed,
        test_accuracy=float(trained.test_metrics["accuracy"]),
        epsilon=float(history["epsilon"][-1]),
        epochs=len(history["loss"]),
        seconds=time.perf_counter() - start,
    )


def summarise(records, contenders, dataset="digits") -> str:
    lines = [
        "| command | runs | test accuracy: mean ± sd | min–max | epsilon | s per run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in contenders:
        rows = [r for r in records if r["contender"] == name]
        if not rows:
            continue
        acc = [r["test_accuracy"] for r in rows]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        lines.append(
            f"| `{CONTENDERS[dataset][name][1]}` | {len(rows)} "
            f"| {statistics.mean(acc):.4f} ± {sd:.4f} "
            f"| {min(acc):.4f}–{max(acc):.4f} | {max(r['epsilon'] for r in rows):.4f} "
            f"| {statistics.mean(r['seconds'] for r in rows):.0f} |"
        )
    return "\n".join(lines)


def compare(args, data):
    names = args.only or list(CONTENDERS[args.dataset])
    records = []
    for seed in range(args.runs):  # interleaved: the machine's load hits every contender
        for name in names:
            record = run_contender(args.dataset, name, seed, data)
            print(json.dumps(record), flush=True)
            records.append(record)
    print(summarise(records, names, args.dataset))


# ------------------------------------------------------------------------------ search
def sample(rng):
    return {key: values[rng.integers(len(values))] for key, values in SPACE.items()}


def split(data, seed):
    """``(training data without the held-out rows, held-out x, held-out y)``."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(data.x_train))
    keep, held = order[HELD_OUT:], order[:HELD_OUT]
    train = dataclasses.replace(data, x_train=data.x_train[keep], y_train=data.y_train[keep])
    return train, data.x_train[held], data.y_train[held]


def search(seed, data):
    import numpy as np

    from lipdp.accounting import calibrate_noise_multiplier, get_eps_delta
    from lipdp.accounting.tuning_cost import RandomSearch
    from lipdp.recipes import defaults as D
    from lipdp.recipes import runs
    from lipdp.recipes.tuning import private_random_search

    train_data, x_val, y_val = split(data, seed)
    law = RandomSearch(mean=3.0)
    batch = D.DEFAULTS["digits"].batch_size
    n = len(train_data.x_train)
    sigma = calibrate_noise_multiplier(EPSILON, SEARCH_EPOCHS, batch, n, DELTA, search=law)

    def train(config):
        tau_default = D.clipless_defaults("digits", config["scattering"]).tau
        recipe = runs.ModelRecipe(
            scattering=config["scattering"],
            gradient_clip=config["gradient_clip"],
            tau=tau_default * config["tau_factor"],
            learning_rate=config["learning_rate"],
            noise_multiplier=sigma,
            delta=DELTA,
        )
        run = runs.RunConfig(model=recipe, epsilon=1e6, epochs=SEARCH_EPOCHS, seed=seed)
        prepared = runs.prepare(run, train_data)
        runs.fit(prepared)
        score = prepared.model.evaluate(
            x_val, runs.one_hot(y_val, 10), verbose=0, return_dict=True
        )["accuracy"]
        logging.info("search run %s: validation accuracy %.4f", config, score)
        return prepared.model, score

    start = time.perf_counter()
    result = private_random_search(train, sample, law, rng=np.random.default_rng(seed))
    test = runs.metrics_on_test_set(result.model, data)["accuracy"]
    epsilon, _ = get_eps_delta(result.model, SEARCH_EPOCHS)
    record = dict(
        seed=seed,
        sigma=sigma,
        runs=result.runs,
        selected={k: (None if v == math.inf else v) for k, v in result.config.items()},
        validation_accuracy=result.score,
        test_accuracy=float(test),
        search_epsilon=float(epsilon),
        scores=[(str(c), s) for c, s in result.scores],
        seconds=time.perf_counter() - start,
    )
    print(json.dumps(record), flush=True)
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=list(CONTENDERS), default="digits")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--search", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from common import machine_description

    from lipdp.recipes import runs

    print(machine_description(), flush=True)
    data = runs.load_data("digits" if args.search else args.dataset)
    if args.search:
        records = [search(seed, data) for seed in args.seeds]
        tests = [r["test_accuracy"] for r in records]
        print(f"search: test accuracy mean {statistics.mean(tests):.4f} over {len(tests)} seeds")
    else:
        compare(args, data)


if __name__ == "__main__":
    main()
