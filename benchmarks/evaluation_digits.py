"""Robustness, calibration and membership inference on scikit-learn's digits (issue 5).

    .venv/bin/python benchmarks/evaluation_digits.py [--seed 0]

Three models of similar size (one 3x3 convolution with 16 channels, 2x2 pooling, one
dense layer to 10 classes), 1 536 training / 261 test images:

* ``dp``: the CNN of ``lipdp train`` with its defaults (noise multiplier 6, batch 512,
  the most epochs within (epsilon, delta) = (3, 1e-5), tau = 8, Adam(0.02));
* ``lip-nonprivate``: the same Lipschitz network trained without noise
  (``non_private=True``, batch 64, 60 epochs);
* ``baseline``: an unconstrained Keras CNN (Conv2D + ReLU, MaxPool, Dense with
  biases), cross-entropy, batch 64, 100 epochs, no privacy.

For each: test accuracy; an upper bound on the Lipschitz constant (from the layers
for lipdp models; the product of exact operator norms for the baseline: the conv as
a matrix on 8x8x1 inputs, ReLU and non-overlapping max pooling are 1-Lipschitz, the
dense kernel's spectral norm); a lower bound by gradient ascent; certified accuracy
for radii 0..2; PGD (l2, 50 steps, 3 restarts) robust accuracy; ECE / MCE / NLL
(15 bins; lipdp models use softmax(tau * logits), the distribution their loss
models); membership-inference AUROC and advantage (training vs test images).
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from lipdp.clipless.audit import conv_operator_norm, dense_operator_norm  # noqa: E402
from lipdp.core.callbacks import DP_Accountant  # noqa: E402
from lipdp.core.report import privacy_report  # noqa: E402
from lipdp.data import sources as datasets  # noqa: E402
from lipdp.evaluation import (  # noqa: E402
    calibration_report,
    certified_accuracy,
    empirical_lipschitz,
    gradient_statistics,
    lipschitz_constant,
    membership_inference,
    pgd_l2_attack,
)
from lipdp.evaluation.outputs import predict_logits, softmax  # noqa: E402
from lipdp.recipes.runs import ModelRecipe, model_and_arrays  # noqa: E402
from lipdp.sensitivity import get_max_epochs  # noqa: E402

RADII = np.round(np.arange(0.0, 2.01, 0.25), 2)
FINE_RADII = [0.05, 0.1, 0.15, 0.2]
PGD_RADII = [0.1, 0.25, 0.5, 1.0, 2.0]


def lipdp_model(data, sigma, batch_size, non_private=False):
    """The compiled CNN of ``lipdp train`` (:func:`lipdp.recipes.runs.build_model`) on the
    whole batches of the training set, with the CLI's metadata."""
    recipe = ModelRecipe(
        dataset="digits",
        batch_size=batch_size,
        noise_multiplier=None if non_private else sigma,
        non_private=non_private,
        sampling="shuffle",
    )
    return model_and_arrays(recipe, data)


def baseline_model():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu", input_shape=(8, 8, 1)),
            tf.keras.layers.MaxPool2D(2),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=tf.keras.optimizers.Adam(0.005),
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def baseline_lipschitz(model):
    conv, dense = model.layers[0], model.layers[3]
    conv_norm = conv_operator_norm(conv.kernel.numpy(), (8, 8, 1), conv.strides, conv.padding)
    return float(conv_norm) * float(dense_operator_norm(dense.kernel.numpy()))


def evaluate(name, model, lipschitz, scale, data, x_train, y_train, seed):
    x_test, y_test = data.x_test, data.y_test
    start = time.perf_counter()
    logits = predict_logits(model, x_test)
    cal = calibration_report(softmax(logits, scale), y_test, 15)
    cert = certified_accuracy(model, x_test, y_test, list(RADII) + FINE_RADII, lipschitz)
    lower = float(empirical_lipschitz(model, x_test[:64], steps=60, seed=seed).max())
    robust = []
    for radius in PGD_RADII:
        _, margin = pgd_l2_attack(model, x_test, y_test, radius, steps=50, restarts=3, seed=seed)
        robust.append(float(np.mean(margin < 0)))
    mia = membership_inference(model, x_train, y_train, x_test, y_test, scale=scale, seed=seed)
    probs = softmax(logits, scale)
    return {
        "name": name,
        "accuracy": cal.accuracy,
        "mean_confidence": float(probs.max(axis=1).mean()),
        "lipschitz": lipschitz,
        "lipschitz_lower": lower,
        "certified": dict(zip(list(RADII) + FINE_RADII, cert)),
        "pgd": dict(zip(PGD_RADII, robust)),
        "ece": cal.ece,
        "mce": cal.mce,
        "nll": cal.nll,
        "mia_threshold": mia.result("loss threshold"),
        "mia_lr": mia.result("logistic regression"),
        "seconds_eval": time.perf_counter() - start,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = datasets.load_digits()
    results = []

    tf.keras.utils.set_random_seed(args.seed)
    model, x, y = lipdp_model(data, 6.0, 512)
    epochs = get_max_epochs(3.0, model)
    start = time.perf_counter()
    model.fit(x, y, batch_size=512, epochs=epochs, verbose=0, callbacks=[DP_Accountant()])
    train_s = time.perf_counter() - start
    report = privacy_report(model, epochs)
    print(report)
    stats = gradient_statistics(model, x[:256], y[:256])
    for s in stats:
        print(
            f"  {s.name}: mean ||g_i||/bound {s.mean_ratio:.3f} (max {s.max_ratio:.3f}), "
            f"signal-to-noise {s.signal_to_noise:.3g}"
        )
    res = evaluate(
        f"dp (eps={report.epsilon:.2f})",
        model,
        lipschitz_constant(model),
        8.0,
        data,
        x,
        y,
        args.seed,
    )
    res["seconds_train"] = train_s
    results.append(res)

    tf.keras.utils.set_random_seed(args.seed)
    model, x, y = lipdp_model(data, 1.0, 64, non_private=True)
    start = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=60, verbose=0)
    train_s = time.perf_counter() - start
    res = evaluate("lip-nonprivate", model, lipschitz_constant(model), 8.0, data, x, y, args.seed)
    res["seconds_train"] = train_s
    results.append(res)

    tf.keras.utils.set_random_seed(args.seed)
    model = baseline_model()
    y_onehot = np.eye(10, dtype="float32")[data.y_train]
    start = time.perf_counter()
    model.fit(data.x_train, y_onehot, batch_size=64, epochs=100, verbose=0)
    train_s = time.perf_counter() - start
    res = evaluate(
        "baseline", model, baseline_lipschitz(model), 1.0, data, data.x_train, y_onehot, args.seed
    )
    res["seconds_train"] = train_s
    results.append(res)

    print()
    header = "| metric | " + " | ".join(r["name"] for r in results) + " |"
    print(header)
    print("|" + " --- |" * (len(results) + 1))

    def row(label, fmt):
        print(f"| {label} | " + " | ".join(fmt(r) for r in results) + " |")

    row("test accuracy", lambda r: f"{r['accuracy']:.3f}")
    row("Lipschitz upper bound", lambda r: f"{r['lipschitz']:.3g}")
    row("Lipschitz lower bound (ascent)", lambda r: f"{r['lipschitz_lower']:.3g}")
    for radius in sorted(list(RADII) + FINE_RADII):
        row(f"certified acc. r={radius:g}", lambda r, k=radius: f"{r['certified'][k]:.3f}")
    for radius in PGD_RADII:
        row(f"PGD robust acc. r={radius:g}", lambda r, k=radius: f"{r['pgd'][k]:.3f}")
    row("mean confidence", lambda r: f"{r['mean_confidence']:.3f}")
    row("ECE (15 bins)", lambda r: f"{r['ece']:.3f}")
    row("MCE", lambda r: f"{r['mce']:.3f}")
    row("NLL", lambda r: f"{r['nll']:.3f}")
    row("MIA loss-threshold AUROC", lambda r: f"{r['mia_threshold'].auroc:.3f}")
    row("MIA loss-threshold advantage", lambda r: f"{r['mia_threshold'].advantage:.3f}")
    row("MIA logistic-regression AUROC", lambda r: f"{r['mia_lr'].auroc:.3f}")
    row("MIA logistic-regression advantage", lambda r: f"{r['mia_lr'].advantage:.3f}")
    row("train seconds", lambda r: f"{r['seconds_train']:.1f}")
    row("evaluation seconds", lambda r: f"{r['seconds_eval']:.1f}")


if __name__ == "__main__":
    main()
