"""Which end-to-end Lipschitz architecture of the zoo does best on Fashion-MNIST at
epsilon = 3, and is it limited by the noise or by the network? (issue 15, item 2)

    .venv/bin/python benchmarks/fmnist_architectures.py [--quick] [--only NAME ...]
        [--modes private non-private] [--seed 0] [--threads 1] [--out-dir benchmarks/data]
        [--merge] [--time-steps K] [--budget-minutes M]

Today's reference is ``fmnist_utility.py``'s lipdp CNN (``zoo.strided_cnn(widths=(16,
64))``, 82.0 % at epsilon = 3, best of 3 trials picked on the test set), which reaches
only 85-86 % without noise (``fmnist_capacity.py``). This script trains a handful of
*end-to-end* Lipschitz networks of :mod:`lipdp.recipes.zoo` (no scattering or other fixed
features; the list is :data:`ARCHITECTURES`) with one fixed protocol, twice each:

* **private**: epsilon = 3, delta = 1e-5, the noise multiplier the smallest that meets
  the target after the run's epochs (``calibrate_noise_multiplier``); the epsilon actually
  spent is recomputed from the trained model (``get_eps_delta``, RDP);
* **non-private**: the same network, step, projections and hyper-parameters without noise
  (``DPParameters(..., non_private=True)``): what the network can do at all.

The gap between the two says whether an architecture is limited by the noise; the
non-private column says whether it is limited by the network.

Protocol (fixed before any run; nothing is tuned on the test set):

* data: Fashion-MNIST (``lipdp.data.sources.load_fashion_mnist``); 5 000 of the 60 000
  training images (a permutation seeded by 0) are held out as validation data *treated
  as public* (the guarantee covers the other 55 000); both validation and test accuracy
  are reported, the test set is never used for a choice. Every image is divided by its
  norm (``bound_normalize()``, public bound 1), as in ``fmnist_utility.py``.
* batches: Poisson sampling (``lipdp.pipeline.poisson_batches``, ``sampling="poisson"``:
  the mechanism the accountant analyses; expected size ``b``, ``N // b`` steps per epoch;
  drawn from OS randomness, lipdp's default). ``fmnist_utility.py`` used shuffled
  fixed-size batches under the same Poisson accounting; this script uses the sampling
  that the accounting actually describes.
* hyper-parameters: ``fmnist_utility.py``'s best lipdp trial at epsilon = 3 (its
  ``LIPDP_TRIALS[2]``, 81.96 %): expected batch 2 000, Adam with learning rate 5e-3,
  ``DP_TauCategoricalCrossentropy(tau=128)``, ``DP_ClipGradient(0.3)`` appended after
  the logits of every network (the reference's ``clip=0.3``), global noise, no bias
  (except what a builder puts in). The strided CNNs train the reference's 15 epochs;
  the networks whose convolutions run at full resolution cost 50-175 s per epoch on
  one shared thread and train 3 epochs (sigma recalibrated for 3 epochs), and the
  reference is also run at 3 epochs to compare at equal epochs; one variant of the
  reference trains with a 2x larger expected batch and 2x more epochs (private only).
  The epochs were set from ``--time-steps 3`` measurements made before the full run
  (:data:`ARCHITECTURES`) so that the whole run fits in about an hour; with
  ``--budget-minutes M`` a run whose estimated end (measured seconds per epoch) falls
  after ``M`` minutes is skipped. Dropped for time: ``convnet-groupnorm`` (the slowest:
  ``--only convnet-groupnorm`` runs it), and whatever the budget skipped (the table
  lists the default architectures without a result). The full run of 2026-11-25
  (``--budget-minutes 60``) took 62.8 min: under that run's load the epochs were about
  1.4x slower than measured, so the budget skipped ``resnet-16x2``'s non-private run and
  ``mixer-p4-64``.
* seeds: ``--seed`` (0) seeds the initialisations (``tf.keras.utils.set_random_seed``);
  the validation split always uses seed 0; the Poisson batches and the privacy noise are
  not reproducible (drawn from the OS). One run per (architecture, mode): differences of
  a few tenths of a point are within run-to-run noise.

Run one process at a time (TensorFlow on ``--threads`` threads, default 1). Outputs, in
``--out-dir``: ``fmnist_architectures.txt`` (a markdown table, rebuilt after every run
and by ``--merge`` from the JSON files) and ``fmnist_architectures_runs/<name>_<mode>.json``
(one per run, written as soon as the run ends, so an interruption loses nothing;
rerunning a run overwrites its file). ``--only`` runs a subset of the architectures.

``--quick``: a smoke run (the first 5 000 training images, 500 of them held out, 1 epoch,
batch at most 2 000), written to ``fmnist_architectures_quick.txt`` and
``fmnist_architectures_quick_runs/``. ``--time-steps K``: no training run; for each
architecture, time ``K`` steps (after one warm-up step) on the full training set at its
batch size and print the estimated seconds per epoch (how the epochs were chosen).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from lipdp.accounting import calibrate_noise_multiplier, get_eps_delta  # noqa: E402
from lipdp.clipless import layers as L  # noqa: E402
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters  # noqa: E402
from lipdp.data import sources as datasets  # noqa: E402
from lipdp.foundation.metadata import DatasetMetadata  # noqa: E402
from lipdp.pipeline import bound_normalize, poisson_batches  # noqa: E402
from lipdp.recipes import zoo

try:
    from benchmarks.common import machine_description
    from benchmarks.fmnist_utility import LIPDP_TRIALS, accuracy
except ModuleNotFoundError:  # run as a script
    from common import machine_description
    from fmnist_utility import LIPDP_TRIALS, accuracy

EPSILON, DELTA = 3.0, 1e-5
VALIDATION, SPLIT_SEED = 5000, 0
QUICK_SUBSET, QUICK_VALIDATION = 5000, 500
#: fmnist_utility.py's best lipdp trial at epsilon = 3 (batch 2000, 15 epochs, lr 5e-3,
#: tau 128) and its network's gradient clip after the logits.
BATCH, _, LR, TAU = LIPDP_TRIALS[2]
CLIP = 0.3
REFERENCE = "strided_cnn (16, 64), fmnist_utility.py: 81.96 % at epsilon = 3 (test set)"


@dataclass(frozen=True)
class Architecture:
    """A zoo builder with its options, the epochs and expected batch of its runs, its
    modes, and the seconds per epoch measured by ``--time-steps 3`` before the full run."""

    builder: str
    options: dict = field(default_factory=dict)
    epochs: int = 15
    batch: int = BATCH
    modes: tuple = ("private", "non-private")
    epoch_seconds: float = 0.0
    default: bool = True
    note: str = ""


#: The candidates, in the order they run. Epochs: 15 (the reference protocol) for the
#: strided CNNs, whose epoch is cheap; 3 for the networks whose convolutions run at full
#: resolution (50-175 s per epoch here), and the reference at 3 epochs too for a
#: comparison at equal epochs. ``epoch_seconds``: ``--time-steps 3`` on 2026-11-25 (one
#: thread, 2 cores shared with two other benchmark processes), which fixed these epochs.
#: ``default=False``: dropped from the full run for time (``--only`` runs it).
ARCHITECTURES = {
    "strided-16-64": Architecture(
        "strided_cnn", dict(widths=(16, 64)), epoch_seconds=6, note="the reference (notebook 01)"
    ),
    "strided-16-64-e3": Architecture(
        "strided_cnn",
        dict(widths=(16, 64)),
        epochs=3,
        epoch_seconds=6,
        note="the reference at the slow networks' 3 epochs",
    ),
    "strided-32-128": Architecture(
        "strided_cnn", dict(widths=(32, 128)), epoch_seconds=19, note="2x wider"
    ),
    "strided-16-64-b4096": Architecture(
        "strided_cnn",
        dict(widths=(16, 64)),
        epochs=30,
        batch=4096,
        modes=("private",),
        epoch_seconds=7,
        note="the reference, 2x batch, 2x epochs (private only: same network)",
    ),
    "pooled-32-64": Architecture(
        "pooled_cnn",
        dict(widths=(32, 64)),
        epochs=3,
        epoch_seconds=71,
        note="lipdp train's CNN (3x3 convs, L2-norm pooling)",
    ),
    "convnet-groupsort": Architecture(
        "lip_convnet",
        dict(widths=(32, 64), dense=128, activation="groupsort"),
        epochs=3,
        epoch_seconds=90,
        note="Lip-DP-SGD's ConvNet (zoo defaults: spectral balls of radius 1, adaptive norms)",
    ),
    "convnet-relu": Architecture(
        "lip_convnet",
        dict(widths=(32, 64), dense=128, activation="relu"),
        epochs=3,
        epoch_seconds=58,
        note="the same with ReLU",
    ),
    "resnet-16x2": Architecture(
        "resnet",
        dict(merge_policy="1-lip-add", blocks=2, width=16),
        epochs=3,
        epoch_seconds=139,
        note="two 1-lip-add residual blocks at full resolution",
    ),
    "mixer-p4-64": Architecture(
        "mlp_mixer",
        dict(patch_size=4, channels=64, depth=2),
        epochs=3,
        epoch_seconds=52,
        note="MLP-Mixer, 49 tokens of 4x4 pixels, 2 blocks",
    ),
    # Dropped for time: 174 s per epoch; with alpha = 1 (the zoo's default) and images of
    # norm 1, every group's standard deviation is below alpha, so the layer only centres
    # each group (a smaller alpha multiplies the layers' cotangent bounds by 1 / alpha).
    "convnet-groupnorm": Architecture(
        "lip_convnet",
        dict(widths=(32, 64), dense=128, activation="groupsort", group_norm=8, alpha=1.0),
        epochs=3,
        epoch_seconds=174,
        default=False,
        note="GroupSort + group normalisation (8 groups, alpha 1)",
    ),
}
MODES = ("private", "non-private")


# -------------------------------------------------------------------------------- data
def load(quick):
    """``(x_train, y_train), (x_val, y_val), (x_test, y_test)``: images divided by their
    norm (public bound 1), integer labels; the validation images are a seeded random
    subset of the training images (``quick``: of its first 5 000)."""
    data = datasets.load_fashion_mnist()
    x, y = data.x_train, data.y_train
    held_out = QUICK_VALIDATION if quick else VALIDATION
    if quick:
        x, y = x[:QUICK_SUBSET], y[:QUICK_SUBSET]
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    val, train = order[:held_out], order[held_out:]
    normalize, _ = bound_normalize()

    def prepared(images):
        return normalize(images.astype("float32")).numpy()

    return (
        (prepared(x[train]), y[train]),
        (prepared(x[val]), y[val]),
        (prepared(data.x_test), data.y_test),
    )


# ---------------------------------------------------------------------------- models
def build(arch, n, batch, sigma):
    """The architecture as a compiled ``DP_Sequential``; ``sigma = 0``: non-private."""
    meta = DatasetMetadata(
        input_shape=(28, 28, 1),
        nb_classes=10,
        nb_samples_train=n,
        batch_size=batch,
        max_norm=1.0,
        sampling="poisson",
    )
    params = DPParameters("global", sigma, DELTA, non_private=sigma == 0)
    stack = zoo.ZOO[arch.builder](meta, **arch.options) + [L.DP_ClipGradient(CLIP)]
    model = DP_Sequential(stack, dp_parameters=params, dataset_metadata=meta)
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=TAU),
        optimizer=tf.keras.optimizers.Adam(LR),
    )
    return model


class StepTimes(tf.keras.callbacks.Callback):
    """Wall time of every epoch (and of every step when ``steps``: stop after that many)."""

    def __init__(self, steps=None):
        super().__init__()
        self.steps, self.epochs, self.step_times = steps, [], []

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(time.perf_counter() - self._epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self._step = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.step_times.append(time.perf_counter() - self._step)
        if self.steps is not None and len(self.step_times) >= self.steps:
            self.model.stop_training = True


def epochs_and_batch(arch, quick, n):
    if quick:
        return 1, min(arch.batch, n // 2)
    return arch.epochs, arch.batch


def train(name, arch, mode, data, seed, quick):
    """One run -> its record (everything the table and the JSON file need)."""
    (x, y), (x_val, y_val), (x_test, y_test) = data
    n = len(x)
    epochs, batch = epochs_and_batch(arch, quick, n)
    sigma = (
        calibrate_noise_multiplier(EPSILON, epochs, batch, n, DELTA) if mode == "private" else 0.0
    )
    tf.keras.utils.set_random_seed(seed)
    model = build(arch, n, batch, sigma)
    meta = model.dataset_metadata
    batches = poisson_batches(
        x, np.eye(10, dtype="float32")[y], meta.sampling_rate, meta.nb_steps_per_epochs
    )
    timer = StepTimes()
    start = time.perf_counter()
    model.fit(batches, epochs=epochs, verbose=0, callbacks=[timer])
    seconds = time.perf_counter() - start
    return {
        "name": name,
        "mode": mode,
        "builder": arch.builder,
        "options": arch.options,
        "note": arch.note,
        "parameters": int(model.count_params()),
        "n_train": n,
        "batch": batch,
        "epochs": epochs,
        "steps": epochs * meta.nb_steps_per_epochs,
        "lr": LR,
        "tau": TAU,
        "clip": CLIP,
        "sigma": sigma,
        "epsilon_target": EPSILON if mode == "private" else None,
        "epsilon": get_eps_delta(model, epochs)[0] if mode == "private" else None,
        "delta": DELTA,
        "validation": accuracy(model, x_val, y_val),
        "test": accuracy(model, x_test, y_test),
        "train_seconds": seconds,
        "epoch_seconds": timer.epochs,
        "seed": seed,
        "quick": quick,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def time_steps(names, data, steps):
    """Seconds per epoch of every architecture, from ``steps`` timed steps at full size."""
    (x, y), _, _ = data
    one_hot = np.eye(10, dtype="float32")[y]
    print("| architecture | batch | parameters | s/step (median) | steps/epoch | s/epoch (est.) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        arch = ARCHITECTURES[name]
        tf.keras.utils.set_random_seed(0)
        model = build(arch, len(x), arch.batch, 1.0)
        meta = model.dataset_metadata
        batches = poisson_batches(x, one_hot, meta.sampling_rate, meta.nb_steps_per_epochs)
        timer = StepTimes(steps + 1)
        model.fit(batches, epochs=1, verbose=0, callbacks=[timer])
        per_step = statistics.median(timer.step_times[1:])
        print(
            f"| {name} | {arch.batch} | {model.count_params()} | {per_step:.3f} | "
            f"{meta.nb_steps_per_epochs} | {per_step * meta.nb_steps_per_epochs:.0f} |",
            flush=True,
        )


# ----------------------------------------------------------------------------- table
def table(records, quick):
    """The markdown results: one row per architecture, private and non-private side by side."""
    by = {(r["name"], r["mode"]): r for r in records}
    names = [n for n in ARCHITECTURES if any((n, m) in by for m in MODES)]
    names += sorted({r["name"] for r in records} - set(names))
    mode = (
        f"QUICK smoke run ({QUICK_SUBSET} images, {QUICK_VALIDATION} held out, 1 epoch)"
        if quick
        else "full run (55 000 training images, 5 000 held-out validation images)"
    )
    lines = [
        f"Fashion-MNIST, end-to-end Lipschitz architectures, epsilon = {EPSILON:g}, "
        f"delta = {DELTA:g}; {mode}.",
        f"Protocol: Poisson batches, Adam lr {LR:g}, tau {TAU:g}, DP_ClipGradient({CLIP:g}) "
        "after the logits, global noise; inputs divided by their norm (bound 1);",
        "validation = held-out training images treated as public; one run per cell "
        "(initialisation seed in the JSON files).",
        f"Reference: {REFERENCE}.",
        f"Machine: {machine_description()}.",
        "",
        "| architecture | builder (options) | parameters | batch | epochs | sigma | epsilon spent "
        "| private val % | private test % | non-private val % | non-private test % "
        "| gap (test) | s private / non-private |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pct(r, key):
        return "-" if r is None else f"{100 * r[key]:.2f}"

    for name in names:
        p, q = by.get((name, "private")), by.get((name, "non-private"))
        r = p or q
        options = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        gap = "-" if p is None or q is None else f"{100 * (q['test'] - p['test']):.2f}"
        secs = " / ".join("-" if s is None else f"{s['train_seconds']:.0f}" for s in (p, q))
        lines.append(
            f"| {name} | {r['builder']}({options}) | {r['parameters']} | {r['batch']} | "
            f"{r['epochs']} | {'-' if p is None else format(p['sigma'], '.3f')} | "
            f"{'-' if p is None else format(p['epsilon'], '.3f')} | "
            f"{pct(p, 'validation')} | {pct(p, 'test')} | {pct(q, 'validation')} | "
            f"{pct(q, 'test')} | {gap} | {secs} |"
        )
    total = sum(r["train_seconds"] for r in records)
    missing = [n for n in ARCHITECTURES if n not in names]
    missing[:0] = (
        [f"{n} {m}" for n in names for m in ARCHITECTURES[n].modes if (n, m) not in by]
        if not quick
        else []
    )
    lines += [
        "",
        "gap = non-private test % - private test %: the cost of the noise for that network.",
        f"Training wall time summed over the {len(records)} runs: {total / 60:.1f} min.",
        "Not run (dropped or skipped for time): " + (", ".join(missing) or "none") + ".",
        "Notes: " + "; ".join(f"{n}: {ARCHITECTURES[n].note}" for n in names if n in ARCHITECTURES),
    ]
    return "\n".join(lines) + "\n"


def write_table(out_dir, stem, runs_dir, quick):
    records = [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*.json"))]
    text = table(records, quick) if records else "no runs yet\n"
    (out_dir / f"{stem}.txt").write_text(text)
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 000 images, 1 epoch")
    parser.add_argument("--only", nargs="+", choices=list(ARCHITECTURES), default=None)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--seed", type=int, default=0, help="initialisations")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/data"))
    parser.add_argument("--merge", action="store_true", help="only rebuild the table")
    parser.add_argument("--time-steps", type=int, default=0, help="only time K steps each")
    parser.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="skip a run whose estimated time (epoch_seconds) would end past this budget",
    )
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    names = args.only or [n for n, a in ARCHITECTURES.items() if a.default]
    stem = "fmnist_architectures_quick" if args.quick else "fmnist_architectures"
    runs_dir = args.out_dir / f"{stem}_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.time_steps:
        time_steps(names, load(quick=False), args.time_steps)
        return
    if not args.merge:
        data = load(args.quick)
        start = time.perf_counter()
        for name in names:
            arch = ARCHITECTURES[name]
            for mode in [m for m in args.modes if m in arch.modes]:
                elapsed = time.perf_counter() - start
                estimate = arch.epochs * arch.epoch_seconds + 20  # + tracing and evaluation
                if args.budget_minutes and not args.quick:
                    if elapsed + estimate > 60 * args.budget_minutes:
                        print(f"{name} {mode}: skipped for time (~{estimate:.0f} s)", flush=True)
                        continue
                record = train(name, arch, mode, data, args.seed, args.quick)
                assert mode != "private" or record["epsilon"] <= EPSILON * (1 + 1e-6)
                path = runs_dir / f"{name}_{mode}.json"
                path.write_text(json.dumps(record, indent=1))
                write_table(args.out_dir, stem, runs_dir, args.quick)
                print(
                    f"{name} {mode}: val {100 * record['validation']:.2f} % test "
                    f"{100 * record['test']:.2f} % ({record['train_seconds']:.0f} s, "
                    f"{(time.perf_counter() - start) / 60:.1f} min so far)",
                    flush=True,
                )
    print(write_table(args.out_dir, stem, runs_dir, args.quick))


if __name__ == "__main__":
    main()
