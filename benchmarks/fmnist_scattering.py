"""Scattering features + a private head on Fashion-MNIST, with the hyper-parameter search
accounted in epsilon (issue 15).

    .venv/bin/python benchmarks/fmnist_scattering.py [--quick] [--seed 0]
        [--epsilons 1 3 8] [--methods lipdp dp-sgd] [--out-dir benchmarks/data] [--merge]

Tramer & Boneh (ICLR 2021) reach 89.7 % at epsilon = 3, delta = 1e-5 with a linear model
on ScatterNet features (Kymatio, J = 2, L = 8) trained by DP-SGD. Here, with lipdp:

* **features** (``lipdp.clipless.features.fixed_features``): ``DP_BoundedInput(28)`` ->
  ``DP_ScatteringTransform(J=2, L=8, padding="zeros")`` (certified 0.255-Lipschitz) ->
  ``DP_GroupNormalization(groups, alpha=1e-4)``: (7, 7, 81) per image, computed once (a
  fixed per-record map: no statistic of the data enters it), public norm bound
  ``sqrt(3969) = 63`` (every group is scaled to unit variance, so every image nearly
  reaches it);
* **lipdp** (the clipless family): ``DP_BoundedInput(63)`` -> ``DP_Flatten`` ->
  ``DP_QuickSpectralDense(10, constraint="spectral", weight_norm_bound=16)`` (a ball: an
  orthogonal kernel, the layer's default, pins all 10 singular values at 16) ->
  ``DP_ClipGradient(c)``,
  ``DP_TauCategoricalCrossentropy(1)``: the kernel gradient of one example is at most
  ``63 c`` by the bound pass, no per-example clipping;
* **dp-sgd** (lipdp's clipped family, ``DPSGD_Sequential``): ``Flatten`` -> ``Dense(10)``,
  cross-entropy, ``Clipping("flat", R)`` with ``R = 63 c`` (the same scale);
* **tf-privacy**: the same network with tensorflow-privacy 0.9's ``DPSequential`` (fast
  clipping of Dense), shuffled fixed-size batches (its usual pipeline), the search run by
  hand with the same draws (``run_tfp_search``);

all with the protocol of the chosen space (``SPACES``): Adam, batches of (expected) size
4 096, 30 epochs for ``first`` and ``revised``; SGD with momentum 0.9, 8 192, 40 epochs
for ``published`` and ``published-search`` (Tramer & Boneh's) — Poisson batches for
lipdp's two families, the sampling the accountant analyses — delta = 1e-5.

**Private search** (``lipdp.recipes.tuning.private_random_search``, Papernot & Steinke 2022):
the number of runs ``K`` is geometric with mean 3, each run draws ``lr`` in {3e-3, 1e-2,
3e-2}, ``groups`` in {9, 27, 81} and ``c`` in {0.1, 0.3, 1} (``--space first``;
``--space revised``: lr in {1e-3, 3e-3}, c in {0.1, 0.3}, written after the first
searches; ``--space published-search``: lr in {8, 16, 32}, groups as above, c = 0.1 /
63, around Tramer & Boneh's command; ``--space published``: their command alone, one
run, no search, so (a) = (b)); the run with the best validation accuracy is released.
The noise multiplier of every run is calibrated so that the **whole search** meets the
target epsilon (``calibrate_noise_multiplier(..., search=...)``), and each selected
model is reported twice: (a) the epsilon of its own run, as papers report, and (b) the
epsilon of the search (the target; the selected model's ``privacy_report`` states it).
Both methods use the same generator seed: the same ``K`` and the same configurations
(the search budget is identical by construction); the generator is seeded by ``(--seed,
10 epsilon)``, so ``K`` differs across epsilons.

**Validation data**: 5 000 training images (a permutation seeded by ``--seed``) are held
out and *treated as public* (the guarantee covers the 55 000 training records; a score
computed from private records would be a release the plan does not count). The test
images are used only for the reported accuracy. A non-private head (sigma = 0, lr 1e-2,
27 groups, c = 1) gives the ceiling of the features.

Seeds: ``--seed`` fixes the validation split, the search's draws and the initialisations
(not the privacy noise); every seed's searches are reported, and their mean.

Outputs: ``fmnist_scattering.txt`` (and ``fmnist_scattering_runs/*.json``, one per
search and seed) in ``--out-dir``; ``--quick``: 5 000 training images (500 validate), 2 epochs,
epsilon = 3, ``fmnist_scattering_quick.txt``. TensorFlow runs on one thread per process;
run one process per method and ``--merge``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from lipdp.accounting import calibrate_noise_multiplier, get_eps_delta  # noqa: E402
from lipdp.accounting.plan import PrivacyPlan  # noqa: E402
from lipdp.accounting.tuning_cost import RandomSearch  # noqa: E402
from lipdp.clipless import layers as L  # noqa: E402
from lipdp.clipless import losses
from lipdp.clipless.features import fixed_features  # noqa: E402
from lipdp.clipless.model import DP_Sequential, DPParameters  # noqa: E402
from lipdp.clipped.model import Clipping, DPSGD_Sequential  # noqa: E402
from lipdp.core.report import privacy_report  # noqa: E402
from lipdp.data import sources as datasets  # noqa: E402
from lipdp.foundation.metadata import DatasetMetadata  # noqa: E402
from lipdp.pipeline import poisson_batches  # noqa: E402
from lipdp.recipes import zoo
from lipdp.recipes.tuning import SearchResult, private_random_search  # noqa: E402

try:
    from benchmarks.common import dp_sgd_epsilon, machine_description
except ModuleNotFoundError:  # run as a script
    from common import dp_sgd_epsilon, machine_description

DELTA, VALIDATION = 1e-5, 5000
IMAGE_BOUND = 28.0  # pixels in [0, 1]: no 28 x 28 image is longer
FEATURE_NORM = 63.0  # sqrt(7 * 7 * 81): the normalised features' norm bound
#: The default law of the number of runs (``--mean-runs`` changes its mean).
SEARCH = RandomSearch(mean=3.0, shape=1.0)
#: Tramer & Boneh's published Fashion-MNIST command for ScatterNet + linear (their
#: repository's README): SGD, momentum 0.9, batch 8 192, lr 16, GroupNorm with 27 groups,
#: per-example clipping at 0.1 of gradients whose features have norm 63 — in this
#: script's units (R = 63 c) c = 0.1 / 63. With every gradient clipped, SGD's update
#: depends on lr * R only, so these are their steps exactly.
TB_LR, TB_CLIP = 16.0, 0.1 / FEATURE_NORM


@dataclass(frozen=True)
class Space:
    """A search space (lr, groups, c) and the fixed training protocol it runs with.

    ``searched=False``: one configuration trained once, no search (its epsilon is that
    of the run)."""

    lrs: tuple
    groups: tuple
    clips: tuple
    batch: int = 4096
    epochs: int = 30
    optimizer: str = "adam"
    searched: bool = True
    origin: str = ""


SPACES = {
    "first": Space(
        (3e-3, 1e-2, 3e-2), (9, 27, 81), (0.1, 0.3, 1.0), origin="fixed before any search ran"
    ),
    # Written after the first searches, dropping the values that did badly there (lr 3e-2,
    # c = 1): a data-dependent choice, so its results are optimistic (README).
    "revised": Space(
        (1e-3, 3e-3), (9, 27, 81), (0.1, 0.3), origin="written after the first searches"
    ),
    # Tramer & Boneh's published configuration, trained once: the field's convention
    # (hyper-parameters chosen by the authors on this data set, outside any epsilon).
    "published": Space(
        (TB_LR,), (27,), (TB_CLIP,), 8192, 40, "sgd", False, "Tramer & Boneh's command"
    ),
    # A private search around it (lr halved / doubled, the group axis of "first"): its
    # centre comes from a publication, not from this benchmark's results.
    "published-search": Space(
        (TB_LR / 2, TB_LR, 2 * TB_LR),
        (9, 27, 81),
        (TB_CLIP,),
        8192,
        40,
        "sgd",
        True,
        "around Tramer & Boneh's command",
    ),
}
SPACE = SPACES["first"]  # set by --space
PUBLISHED = "Tramer & Boneh 2021, ScatterNet + linear, DP-SGD: 89.7 % at epsilon = 3"


def sample(rng):
    """One configuration (the same law for every run and both methods)."""
    return {
        "lr": float(rng.choice(SPACE.lrs)),
        "groups": int(rng.choice(SPACE.groups)),
        "clip": float(rng.choice(SPACE.clips)),
    }


def optimizer(lr):
    """The protocol's optimiser (momentum 0.9 for SGD, as Tramer & Boneh)."""
    if SPACE.optimizer == "sgd":
        return tf.keras.optimizers.SGD(lr, momentum=0.9)
    return tf.keras.optimizers.Adam(lr)


# ----------------------------------------------------------------------- features
def scattering_output(quick, seed):
    """Scattering coefficients (before normalisation) of the train / validation / test
    images, and the labels."""
    data = datasets.load_fashion_mnist()
    order = np.random.default_rng(seed).permutation(len(data.x_train))
    x, y = data.x_train[order], data.y_train[order]
    if quick:
        x, y = x[:5000], y[:5000]
    held = VALIDATION if not quick else 500
    front = zoo.scattering_net(
        input_shape=(28, 28, 1), upper_bound=IMAGE_BOUND, nb_classes=10, groups=None
    )[:2]
    train, _ = fixed_features(front, x.astype("float32"), 1000)
    test, _ = fixed_features(front, data.x_test.astype("float32"), 1000)
    return (train[held:], y[held:]), (train[:held], y[:held]), (test, data.y_test)


def normalised(coefficients, groups):
    """The front-end's last layer (per example); the norm of a row is at most 63."""
    layer = L.DP_GroupNormalization(groups, zoo.SCATTERING_ALPHA)
    return np.concatenate(
        [layer(coefficients[i : i + 5000]).numpy() for i in range(0, len(coefficients), 5000)]
    )


# ------------------------------------------------------------------------ training
def head(method, config, sigma, n, shape):
    bound = float(np.sqrt(np.prod(shape)))  # the normalisation's cap
    meta = DatasetMetadata(
        input_shape=shape,
        nb_classes=10,
        nb_samples_train=n,
        batch_size=SPACE.batch,
        max_norm=bound,
        sampling="poisson",
    )
    params = DPParameters("global", sigma, DELTA, non_private=sigma == 0)
    if method == "lipdp":
        model = DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=shape, upper_bound=bound),
                L.DP_Flatten(),
                L.DP_QuickSpectralDense(10, constraint="spectral", weight_norm_bound=16.0),
                L.DP_ClipGradient(config["clip"]),
            ],
            dp_parameters=params,
            dataset_metadata=meta,
        )
        loss = losses.DP_TauCategoricalCrossentropy(tau=1.0)
    else:
        model = DPSGD_Sequential(
            [
                tf.keras.layers.InputLayer(input_shape=shape),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(10),
            ],
            dp_parameters=params,
            clipping=Clipping("flat", bound * config["clip"]),
            dataset_metadata=meta,
        )
        loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, optimizer=optimizer(config["lr"]))
    return model


def accuracy(model, x, y):
    return float(np.mean(model.predict(x, batch_size=4096, verbose=0).argmax(1) == y))


def make_train(method, sigma, data, epochs, log):
    (train, y_train), (val, y_val), _ = data
    one_hot = np.eye(10, dtype="float32")[y_train]

    def train_run(config):
        start = time.perf_counter()
        x = normalised(train, config["groups"])
        model = head(method, config, sigma, len(x), x.shape[1:])
        meta = model.dataset_metadata
        batches = poisson_batches(x, one_hot, meta.sampling_rate, meta.nb_steps_per_epochs)
        model.fit(batches, epochs=epochs, verbose=0)
        score = accuracy(model, normalised(val, config["groups"]), y_val)
        run_epsilon = get_eps_delta(model, epochs)[0] if sigma > 0 else float("inf")
        log.append(
            dict(
                config,
                validation=score,
                epsilon_run=run_epsilon,
                seconds=time.perf_counter() - start,
            )
        )
        return model, score

    return train_run


def run_search(method, epsilon, data, epochs, seed, search=SEARCH):
    """The private search of ``SPACE`` (or its single run when it is not searched:
    ``search`` is then ignored and the epsilon is the run's)."""
    search = search if SPACE.searched else None
    n = len(data[0][0])
    sigma = calibrate_noise_multiplier(epsilon, epochs, SPACE.batch, n, DELTA, search=search)
    log = []
    start = time.perf_counter()
    # One generator per (seed, epsilon), the same for every method: the same K and the
    # same configurations (fixed before any result was seen).
    rng = np.random.default_rng([seed, round(10 * epsilon)])
    train = make_train(method, sigma, data, epochs, log)
    if search is None:
        config = sample(rng)
        model, score = train(config)
        result = SearchResult(model, config, score, 1)
    else:
        result = private_random_search(train, sample, search, rng)
    test_x, test_y = data[2]
    selected = next(run for run in log if run["validation"] == result.score)
    return {
        "method": method,
        "target": epsilon,
        "sigma": sigma,
        "runs": result.runs,
        "config": result.config,
        "validation": result.score,
        "test": accuracy(result.model, normalised(test_x, result.config["groups"]), test_y),
        "epsilon_run": selected["epsilon_run"],
        "epsilon_search": get_eps_delta(result.model, epochs)[0],
        "report_states_search": "search" in str(privacy_report(result.model, epochs)).lower(),
        "trials": log,
        "seconds": time.perf_counter() - start,
    }


def train_tfp(config, sigma, data, epochs, seed, log):
    """tensorflow-privacy's DPSequential on the same features: ``Flatten`` -> ``Dense(10)``,
    flat clipping at ``R = 63 c`` with its fast (ghost) norms for Dense, Adam; shuffled
    batches of exactly 4 096 (remainder dropped: how tf-privacy is used; its epsilon is
    computed as Poisson sampling at q = b / N, as its own tools do)."""
    import tensorflow_privacy as tfp
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry

    (train, y_train), (val, y_val), _ = data
    start = time.perf_counter()
    x = normalised(train, config["groups"])
    tf.keras.utils.set_random_seed(seed)
    model = tfp.DPSequential(
        l2_norm_clip=float(np.sqrt(np.prod(x.shape[1:]))) * config["clip"],
        noise_multiplier=sigma,
        use_xla=False,
        layer_registry=layer_registry.make_default_layer_registry(),
        layers=[
            tf.keras.layers.InputLayer(input_shape=x.shape[1:]),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(10),
        ],
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=optimizer(config["lr"]),
    )
    one_hot = np.eye(10, dtype="float32")[y_train]
    batches = (
        tf.data.Dataset.from_tensor_slices((x, one_hot))
        .shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
        .batch(SPACE.batch, drop_remainder=True)
    )
    model.fit(batches, epochs=epochs, verbose=0)
    steps = epochs * (len(x) // SPACE.batch)
    score = accuracy(model, normalised(val, config["groups"]), y_val)
    run_epsilon = (
        dp_sgd_epsilon(sigma, SPACE.batch / len(x), steps, DELTA) if sigma > 0 else math.inf
    )
    log.append(
        dict(config, validation=score, epsilon_run=run_epsilon, seconds=time.perf_counter() - start)
    )
    return model, score


def run_tfp_search(epsilon, data, epochs, seed, search=SEARCH):
    """The same search by hand (tf-privacy models have no privacy plan): the same law,
    the same generator, drawn in the same order as ``private_random_search`` (``K``,
    then one configuration per run), the same noise multiplier; the search's epsilon is
    that of lipdp's accountant for the same mechanism."""
    search = search if SPACE.searched else None
    n = len(data[0][0])
    sigma = calibrate_noise_multiplier(epsilon, epochs, SPACE.batch, n, DELTA, search=search)
    rng = np.random.default_rng([seed, round(10 * epsilon)])
    start, log, best = time.perf_counter(), [], None
    runs = search.sample(rng) if search is not None else 1
    for index in range(runs):
        config = sample(rng)
        model, score = train_tfp(config, sigma, data, epochs, seed + index, log)
        if best is None or score > best[1]:
            best = (model, score, config, log[-1]["epsilon_run"])
    model, score, config, run_epsilon = best
    plan = PrivacyPlan.for_training(
        noise_multipliers=sigma,
        sampling_rate=SPACE.batch / n,
        steps_per_epoch=n // SPACE.batch,
        delta=DELTA,
        search=search,
    )
    test_x, test_y = data[2]
    return {
        "method": "tf-privacy",
        "target": epsilon,
        "sigma": sigma,
        "runs": runs,
        "config": config,
        "validation": score,
        "test": accuracy(model, normalised(test_x, config["groups"]), test_y),
        "epsilon_run": run_epsilon,
        "epsilon_search": plan.epsilon(epochs),
        "report_states_search": None,
        "trials": log,
        "seconds": time.perf_counter() - start,
    }


def run_ceiling(method, data, epochs, seed):
    tf.keras.utils.set_random_seed(seed)
    config = {"lr": 1e-2, "groups": 27, "clip": 1.0}
    log = []
    if method == "tf-privacy":
        model, _ = train_tfp(config, 0.0, data, epochs, seed, log)
    else:
        model, _ = make_train(method, 0.0, data, epochs, log)(config)
    test_x, test_y = data[2]
    return {
        "method": method,
        "config": config,
        "validation": log[0]["validation"],
        "test": accuracy(model, normalised(test_x, 27), test_y),
        "seconds": log[0]["seconds"],
    }


# ------------------------------------------------------------------------- tables
def table(results, ceilings, header):
    lines = [header, ""]
    lines.append(
        "method  | seed | space | E[K] | eps target (b: search) | eps of the run (a) | sigma | K "
        "| selected (lr, groups, c) | val % | test %"
    )
    order = sorted(
        results,
        key=lambda r: (
            r["target"],
            r.get("space", "first"),
            r.get("mean_runs", 3.0),
            r["method"],
            r["seed"],
        ),
    )
    for r in order:
        c = r["config"]
        lines.append(
            f"{r['method']:7s} | {r['seed']} | {r.get('space', 'first')} | "
            f"{r.get('mean_runs', 3.0):g} | "
            f"{r['epsilon_search']:.3f} | "
            f"{r['epsilon_run']:.3f} | {r['sigma']:.3f} | {r['runs']} | "
            f"({c['lr']:g}, {c['groups']}, {c['clip']:g}) | "
            f"{100 * r['validation']:.2f} | {100 * r['test']:.2f}"
        )
    lines += [
        "",
        "Mean test accuracy over the seeds (method, target eps, space, E[K], seeds, %):",
    ]

    def key(r):
        return (r["target"], r.get("space", "first"), r.get("mean_runs", 3.0), r["method"])

    for k in sorted({key(r) for r in results}):
        tests = [r["test"] for r in results if key(r) == k]
        lines.append(
            f"  {k[3]:10s} {k[0]:g} | {k[1]} | {k[2]:g} | {len(tests)} | {100 * np.mean(tests):.2f}"
        )
    lines += ["", "Non-private heads (sigma = 0, lr 1e-2, 27 groups, c = 1): the ceiling"]
    for c in ceilings:
        lines.append(
            f"{c['method']:7s} | val {100 * c['validation']:.2f} | test {100 * c['test']:.2f}"
        )
    lines += [
        "",
        "Every trial (method, target, lr, groups, c, validation %, epsilon of the run, s):",
    ]
    for r in order:
        for t in r["trials"]:
            lines.append(
                f"  {r['method']:7s} {r['target']:g} s{r['seed']} {r.get('space', 'first')} "
                f"k{r.get('mean_runs', 3.0):g} | "
                f"{t['lr']:g} {t['groups']} {t['clip']:g} | "
                f"{100 * t['validation']:.2f} | {t['epsilon_run']:.3f} | {t['seconds']:.0f}"
            )
    total = sum(r["seconds"] for r in results) + sum(c["seconds"] for c in ceilings)
    lines += [
        "",
        f"Training time summed over searches and ceilings: {total / 60:.1f} min.",
        PUBLISHED,
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--methods", nargs="+", default=["lipdp", "dp-sgd", "tf-privacy"])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/data"))
    parser.add_argument("--merge", action="store_true", help="only write the table")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-ceiling", action="store_true", help="no non-private run")
    parser.add_argument("--mean-runs", type=float, default=SEARCH.mean, help="E[K] (default 3)")
    parser.add_argument("--space", choices=sorted(SPACES), default="first")
    args = parser.parse_args()
    global SPACE
    SPACE = SPACES[args.space]
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    name = "fmnist_scattering_quick" if args.quick else "fmnist_scattering"
    runs_dir = args.out_dir / f"{name}_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    epochs = 2 if args.quick else SPACE.epochs
    epsilons = [3.0] if args.quick else args.epsilons
    if not args.merge:
        data = scattering_output(args.quick, args.seed)
        for method in args.methods:
            # The ceiling is a property of the features: run once, with the first protocol.
            if not args.skip_ceiling and args.space == "first":
                ceiling = run_ceiling(method, data, epochs, args.seed)
                path = runs_dir / f"ceiling_{method}_s{args.seed}.json"
                path.write_text(json.dumps(ceiling, indent=1))
            search = RandomSearch(mean=args.mean_runs, shape=SEARCH.shape)
            suffix = "" if search == SEARCH else f"_k{args.mean_runs:g}"
            suffix += "" if args.space == "first" else f"_{args.space}"
            for epsilon in epsilons:
                if method == "tf-privacy":
                    result = run_tfp_search(epsilon, data, epochs, args.seed, search)
                else:
                    result = run_search(method, epsilon, data, epochs, args.seed, search)
                result.update(
                    seed=args.seed,
                    # E[K] = 1: a single run, no search (its epsilon is the run's).
                    mean_runs=search.mean if SPACE.searched else 1.0,
                    space=args.space,
                    batch=SPACE.batch,
                    epochs=epochs,
                    optimizer=SPACE.optimizer,
                )
                path = runs_dir / f"search_{method}_{epsilon:g}_s{args.seed}{suffix}.json"
                path.write_text(json.dumps(result, indent=1))
                print(f"{method} eps {epsilon:g}: test {result['test']:.4f}", flush=True)
    results = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("search_*.json"))]
    ceilings = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("ceiling_*.json"))]
    protocols = "; ".join(
        f"{name}: {space.optimizer}, batch {space.batch}, {space.epochs} epochs ({space.origin})"
        for name, space in SPACES.items()
    )
    header = (
        f"Fashion-MNIST, scattering (J=2, L=8) + private head, delta = {DELTA:g}, batches "
        "Poisson (lipdp's families) or shuffled (tf-privacy), search K geometric (E[K] in the "
        "table; 1 = a single run, no search).\n"
        f"Spaces: {protocols}.\n"
        f"Machine: {machine_description()}. A seed fixes the validation split, the search's\n"
        "draws (K, configurations) and the initialisations; the privacy noise is unseeded."
    )
    (args.out_dir / f"{name}.txt").write_text(table(results, ceilings, header))
    print(table(results, ceilings, header))


if __name__ == "__main__":
    main()
