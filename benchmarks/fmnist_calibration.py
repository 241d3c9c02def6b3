"""Calibration of clipped DP-SGD on Fashion-MNIST at epsilon = 3, delta = 1e-5 (Bu et al.).

    .venv/bin/python benchmarks/fmnist_calibration.py [--quick] [--seed 0] [--epsilon 3]
        [--epochs 8] [--threads 1] [--out-dir benchmarks/data]

Bu, Wang, Zha & Karypis, *On the Convergence and Calibration of Deep Learning with
Differential Privacy* (TMLR 2023), Table 2 on MNIST: ECE 0.4 % without privacy, 2.3 %
for DP-SGD with a small clipping norm R, 0.7 % with a large R; small-R flat clipping is
over-confident, global clipping and large R are better calibrated. Their data sets are
not available here: Fashion-MNIST stands in.

What is measured: the test accuracy, ECE, MCE and NLL (``lipdp.evaluation.calibration``,
15 equal-width confidence bins), the mean confidence minus the accuracy (> 0:
over-confident), the noise multiplier, epsilon from lipdp's RDP accountant
(``get_eps_delta``) and the wall time of these methods:

* the DP-SGD modes of ``lipdp.clipped.model`` on the tempered-sigmoid CNN of
  ``fmnist_utility.py`` (26 010 parameters, cross-entropy on logits, Adam):
  ``flat-small-R`` (``Clipping("flat", 0.1)``, the clip norm of the best tf-privacy trial
  at epsilon = 3), ``flat-large-R`` (``Clipping("flat", 10)``), ``global``
  (``Clipping("global", Z, threshold=Z)``: rows with ``||g_i|| > Z`` dropped, the others
  kept unscaled) and ``automatic`` (``Clipping("automatic", 1, gamma=0.01)``). Adam makes
  the update invariant to a common scale of gradient and noise, so R does not need a
  learning rate of its own: what R changes is which rows are clipped (the fraction with
  ``C_i < 1`` is logged on one training batch at the end of training, from lipdp's
  per-example gradient norms) and the noise relative to the unclipped gradients;
* ``lipdp-clipless``: lipdp's Lipschitz CNN (``fmnist_utility.lipdp_model``, the first
  trial of ``LIPDP_TRIALS`` with its own batch and epochs), probabilities
  ``softmax(tau * logits)`` (``logit_scale``: the tau of its loss);
* ``non-private``: the tempered-sigmoid CNN trained by plain Keras, same batch and epochs.

Every DP-SGD run uses the batch and learning rate of the best tf-privacy trial at
epsilon = 3 (``TFP_TRIALS[1]``: batch 2000, Adam 1e-2, 84.71 % in 15 epochs) but fewer
epochs (``--epochs``, 8 by default): on one thread one DP-SGD epoch of 27 steps took
35-55 s (Keras alone: 21 s), so 8 runs of 15 epochs would not fit in an hour. Search: 2
configurations per DP-SGD mode (learning rate 1e-2 or 3e-3; for ``global`` the
threshold Z in {5, 20} at 1e-2), 2 learning rates for ``non-private``, 1 trial for
``lipdp-clipless``. Z comes from the measured per-example gradient norms of this CNN:
median 8 (5th-95th percentile 4.6-12) at initialisation, 0.36 after one DP-SGD epoch;
Z = 1 would drop every row of the first steps, Z = 20 keeps most rows. The noise
multiplier of every run is the smallest that meets the epsilon target after its epochs
(``calibrate_noise_multiplier``).

Selection: 5 000 images of the training set (a seeded permutation) are held out as a
validation split; every run trains on the other 55 000; the configuration with the best
validation accuracy is reported, on the 10 000 test images. The search itself is not
private (as in the paper). Batches: a fresh shuffle every epoch, fixed size, remainder
dropped, accounted as Poisson sampling at q = b / N (``fmnist_utility.batches``).

Outputs: ``fmnist_calibration.txt`` (the tables) and ``fmnist_calibration.png`` (one
reliability diagram per method, the selected runs) in ``--out-dir``; ``--quick`` (a smoke
run: 5 000 training images of which 500 validate, 1 epoch, 1 configuration per method)
writes ``fmnist_calibration_quick.*`` instead. TensorFlow runs on ``--threads`` threads
(1 by default: the machine is shared).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import machine_description  # noqa: E402
from fmnist_utility import (  # noqa: E402
    DELTA,
    LIPDP_TRIALS,
    TFP_TRIALS,
    batches,
    lipdp_model,
    load,
    tempered_sigmoid_cnn,
)

from lipdp.accounting import calibrate_noise_multiplier, get_eps_delta  # noqa: E402
from lipdp.clipless import losses  # noqa: E402
from lipdp.clipless.model import DPParameters  # noqa: E402
from lipdp.clipped.model import Clipping, DPSGD_Sequential  # noqa: E402
from lipdp.clipped.per_example import per_example_gradients  # noqa: E402
from lipdp.evaluation.calibration import (  # noqa: E402
    calibration_report,
    plot_reliability_diagram,
    predict_probabilities,
)
from lipdp.pipeline import DatasetMetadata, bound_normalize  # noqa: E402

#: The best tf-privacy trial at epsilon = 3 (README, "Fashion-MNIST"): batch, lr, clip.
BATCH, _, LR, SMALL_R = TFP_TRIALS[1]
LARGE_R = 10.0
LEARNING_RATES = (LR, 3e-3)
GLOBAL_THRESHOLDS = (5.0, 20.0)
EPOCHS = 8
VALIDATION, QUICK_VALIDATION = 5000, 500
PAPER = (
    "Bu et al. (TMLR 2023), Table 2, MNIST: ECE 0.4 % non-DP, 2.3 % DP-SGD small R, "
    "0.7 % DP-SGD large R; small-R flat clipping over-confident, global clipping and "
    "large R better calibrated"
)


@dataclass
class Split:
    """Training, validation and test images with integer labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def mapped(self, fn):
        """The same split with ``fn`` applied to every image array."""
        return replace(self, x_train=fn(self.x_train), x_val=fn(self.x_val), x_test=fn(self.x_test))


@dataclass
class Trial:
    """One configuration: ``fit(split, epochs, epsilon, seed) -> (model, facts)``."""

    method: str
    config: str
    fit: object
    normalized: bool = False
    result: dict = field(default_factory=dict)


def split_data(quick, seed):
    """A seeded validation split of the training images (the rest trains)."""
    x, y, x_test, y_test = load(quick)
    held = QUICK_VALIDATION if quick else VALIDATION
    order = np.random.default_rng(seed).permutation(len(x))
    val, train = order[:held], order[held:]
    return Split(x[train], y[train], x[val], y[val], x_test, y_test)


def cross_entropy():
    return tf.keras.losses.CategoricalCrossentropy(from_logits=True)


def clip_facts(model, clipping, x, y):
    """On one training batch: the fraction of rows whose factor ``C_i < 1`` (clipped,
    scaled down, or dropped by ``global``) and the median per-example gradient norm."""
    x = tf.constant(x)
    y = tf.constant(np.eye(10, dtype="float32")[y])
    facts = per_example_gradients(model, x, lambda y_pred: model.per_example_losses(y, y_pred))
    norms = tf.sqrt(tf.add_n(facts.sq_norms))
    factors = clipping.factors(norms).numpy()
    return {"clipped": float(np.mean(factors < 1 - 1e-6)), "median_norm": float(np.median(norms))}


def dpsgd_fit(clipping, lr):
    """A ``Trial.fit`` training the tempered-sigmoid CNN with clipped DP-SGD."""

    def fit(data, epochs, epsilon, seed):
        n = len(data.x_train)
        batch = min(BATCH, n // 2)
        sigma = calibrate_noise_multiplier(epsilon, epochs, batch, n, DELTA)
        tf.keras.utils.set_random_seed(seed)
        meta = DatasetMetadata(
            input_shape=(28, 28, 1), nb_classes=10, nb_samples_train=n, batch_size=batch
        )
        model = DPSGD_Sequential(
            tempered_sigmoid_cnn(),
            dp_parameters=DPParameters("global", sigma, DELTA),
            clipping=clipping,
            dataset_metadata=meta,
        )
        model.compile(loss=cross_entropy(), optimizer=tf.keras.optimizers.Adam(lr))
        model.fit(batches(data.x_train, data.y_train, batch, seed), epochs=epochs, verbose=0)
        facts = clip_facts(model, clipping, data.x_train[:batch], data.y_train[:batch])
        return model, {"sigma": sigma, "epsilon": get_eps_delta(model, epochs)[0], **facts}

    return fit


def keras_fit(lr):
    """A ``Trial.fit`` training the tempered-sigmoid CNN without privacy."""

    def fit(data, epochs, epsilon, seed):
        batch = min(BATCH, len(data.x_train) // 2)
        tf.keras.utils.set_random_seed(seed)
        model = tf.keras.Sequential(tempered_sigmoid_cnn())
        model.compile(loss=cross_entropy(), optimizer=tf.keras.optimizers.Adam(lr))
        model.fit(batches(data.x_train, data.y_train, batch, seed), epochs=epochs, verbose=0)
        return model, {"sigma": 0.0, "epsilon": math.inf}

    return fit


def clipless_fit(trial):
    """A ``Trial.fit`` training lipdp's Lipschitz CNN with its own batch and epochs
    (one epoch in a quick run); the images must be normalised (``Trial.normalized``)."""

    def fit(data, epochs, epsilon, seed):
        batch, own_epochs, lr, tau = trial
        n = len(data.x_train)
        batch, epochs = min(batch, n // 2), min(own_epochs, epochs)
        sigma = calibrate_noise_multiplier(epsilon, epochs, batch, n, DELTA)
        tf.keras.utils.set_random_seed(seed)
        model = lipdp_model(batch, sigma, n)
        model.compile(
            loss=losses.DP_TauCategoricalCrossentropy(tau=tau),
            optimizer=tf.keras.optimizers.Adam(lr),
        )
        model.fit(batches(data.x_train, data.y_train, batch, seed), epochs=epochs, verbose=0)
        return model, {"sigma": sigma, "epsilon": get_eps_delta(model, epochs)[0]}

    return fit


def trials(quick):
    """Every configuration, grouped by method in report order (1 per method if quick)."""
    flat = [("flat-small-R", SMALL_R), ("flat-large-R", LARGE_R)]
    groups = [
        *[
            [
                Trial(m, f"R {r:g}, lr {lr:g}", dpsgd_fit(Clipping("flat", r), lr))
                for lr in LEARNING_RATES
            ]
            for m, r in flat
        ],
        [
            Trial(
                "global",
                f"Z = R = {z:g}, lr {LR:g}",
                dpsgd_fit(Clipping("global", z, threshold=z), LR),
            )
            for z in GLOBAL_THRESHOLDS
        ],
        [
            Trial(
                "automatic",
                f"R 1, gamma 0.01, lr {lr:g}",
                dpsgd_fit(Clipping("automatic", 1.0), lr),
            )
            for lr in LEARNING_RATES
        ],
        [
            Trial(
                "lipdp-clipless", clipless_config(), clipless_fit(LIPDP_TRIALS[0]), normalized=True
            )
        ],
        [Trial("non-private", f"lr {lr:g}", keras_fit(lr)) for lr in LEARNING_RATES],
    ]
    return [group[:1] if quick else group for group in groups]


def clipless_config():
    batch, epochs, lr, tau = LIPDP_TRIALS[0]
    return f"batch {batch}, {epochs} epochs, lr {lr:g}, tau {tau:g}"


def evaluate(model, data):
    """Validation accuracy and the test calibration report (probabilities with the
    model's logit scale: tau for lipdp's tau-cross-entropy, 1 otherwise)."""
    val = predict_probabilities(model, data.x_val, batch_size=2000)
    test = predict_probabilities(model, data.x_test, batch_size=2000)
    report = calibration_report(test, data.y_test)
    return {
        "val_accuracy": float(np.mean(val.argmax(1) == data.y_val)),
        "report": report,
        "overconfidence": float(np.mean(test.max(1))) - report.accuracy,
    }


def run(trial, data, args):
    """Train and evaluate one configuration; its result is stored on the trial."""
    start = time.perf_counter()
    model, facts = trial.fit(data, args.epochs, args.epsilon, args.seed)
    trial.result = {**facts, **evaluate(model, data), "seconds": time.perf_counter() - start}
    assert facts["epsilon"] <= args.epsilon * (1 + 1e-6) or math.isinf(facts["epsilon"])
    return trial


TRIAL_HEADER = (
    "| method | configuration | noise multiplier | epsilon | val. accuracy | test accuracy "
    "| ECE | MCE | NLL | conf. - acc. | rows with C_i < 1 | median per-example norm "
    "| seconds |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def pct(value):
    return f"{100 * value:.2f} %"


def trial_row(trial):
    r, rep = trial.result, trial.result["report"]
    clipped = pct(r["clipped"]) if "clipped" in r else "-"
    norm = f"{r['median_norm']:.3g}" if "median_norm" in r else "-"
    return (
        f"| {trial.method} | {trial.config} | {r['sigma']:.3f} | {r['epsilon']:.3f} | "
        f"{pct(r['val_accuracy'])} | {pct(rep.accuracy)} | {pct(rep.ece)} | {pct(rep.mce)} | "
        f"{rep.nll:.3f} | {100 * r['overconfidence']:+.2f} | {clipped} | {norm} | "
        f"{r['seconds']:.0f} |"
    )


SUMMARY_HEADER = (
    "| method | selected configuration | test accuracy | ECE | MCE | NLL | conf. - acc. "
    "| noise multiplier | epsilon | wall time (selected run) | search (runs, wall time) "
    "|\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def summary_row(group):
    best = max(group, key=lambda t: t.result["val_accuracy"])
    r, rep = best.result, best.result["report"]
    search = sum(t.result["seconds"] for t in group)
    return best, (
        f"| {best.method} | {best.config} | {pct(rep.accuracy)} | {pct(rep.ece)} | "
        f"{pct(rep.mce)} | {rep.nll:.3f} | {100 * r['overconfidence']:+.2f} | "
        f"{r['sigma']:.3f} | {r['epsilon']:.3f} | {r['seconds']:.0f} s | "
        f"{len(group)}, {search:.0f} s |"
    )


def save_diagrams(selected, path):
    """One reliability diagram per method (``plot_reliability_diagram``), tiled 2 x 3."""
    panels = []
    for trial in selected:
        figure = plot_reliability_diagram(trial.result["report"].diagram, title=trial.method)
        figure.canvas.draw()
        panels.append(np.asarray(figure.canvas.buffer_rgba()))
    columns = 3
    blank = np.full_like(panels[0], 255)
    panels += [blank] * (-len(panels) % columns)
    rows = [np.concatenate(panels[i : i + columns], axis=1) for i in range(0, len(panels), columns)]
    matplotlib.image.imsave(path, np.concatenate(rows, axis=0))


def header(args, data):
    mode = "QUICK smoke run (1 epoch, 1 configuration per method)" if args.quick else "full run"
    return (
        f"Machine: {machine_description()}; TF threads {args.threads}; seed {args.seed}; "
        f"epsilon = {args.epsilon:g}, delta = {DELTA:g}; {mode}.\n"
        f"Data: {len(data.x_train)} training / {len(data.x_val)} validation (held out from "
        f"the training set) / {len(data.x_test)} test images. DP-SGD and non-private: "
        f"tempered-sigmoid CNN, batch {min(BATCH, len(data.x_train) // 2)}, {args.epochs} "
        "epoch(s), Adam. Search size: 2 configurations per DP-SGD mode and for non-private, "
        "1 for lipdp-clipless (1 per method if quick); selection on validation accuracy. "
        "Calibration: 15 equal-width bins, on the test set; conf. - acc. = mean top-class "
        "probability minus accuracy, in points (> 0: over-confident); rows with C_i < 1: "
        "fraction of one training batch clipped (flat, automatic) or dropped (global) at the "
        "end of training.\n"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 000 images, 1 epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="DP-SGD / non-private")
    parser.add_argument("--threads", type=int, default=1, help="TF intra- and inter-op")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "data")
    args = parser.parse_args()
    tf.get_logger().setLevel("ERROR")  # retracing warnings: every run builds a new model
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.quick:
        args.epochs = 1
    start = time.perf_counter()
    data = split_data(args.quick, args.seed)
    normalize, _ = bound_normalize()
    normalized = data.mapped(lambda x: normalize(x).numpy())
    lines = [header(args, data), TRIAL_HEADER]
    print("\n".join(lines), flush=True)
    groups = trials(args.quick)
    for trial in (t for group in groups for t in group):
        lines.append(trial_row(run(trial, normalized if trial.normalized else data, args)))
        print(lines[-1], flush=True)
    selected, rows = zip(*(summary_row(group) for group in groups))
    summary = ["", SUMMARY_HEADER, *rows, "", f"Paper: {PAPER}."]
    summary.append(f"Total wall time {time.perf_counter() - start:.0f} s.")
    print("\n".join(summary), flush=True)
    lines += summary
    stem = "fmnist_calibration_quick" if args.quick else "fmnist_calibration"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    save_diagrams(selected, args.out_dir / f"{stem}.png")


if __name__ == "__main__":
    main()
