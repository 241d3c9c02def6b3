"""Private fine-tuning of a public backbone, end to end (issue 26), against training from
scratch at the same (epsilon, delta).

    .venv/bin/python benchmarks/private_finetuning.py [--epsilon 3] [--epochs 8]
        [--batch 512] [--seeds 0 1] [--quick]

Data: Fashion-MNIST (Debian package ``dataset-fashion-mnist``). Classes 0-4 (T-shirt,
trouser, pullover, dress, coat) are treated as **public**: 30 000 training images. Classes
5-9 (sandal, shirt, sneaker, bag, ankle boot) are the **private** task: 30 000 training
images, 5 000 test images, relabelled 0-4. Pixels in [0, 1].

1. **Public pre-training** (no privacy): a small CNN backbone -- two blocks Conv2D ->
   BatchNormalization -> ReLU -> MaxPooling2D, then Flatten -> Dense(64) -- with a
   5-class head, trained on the public classes (``--public-epochs``).
2. **Refused**: the backbone, nested in ``DPSGD_Sequential([backbone, head])``, is refused
   at construction: its BatchNormalization layers couple the examples of a batch (rule
   S2); the message names the nested layer.
3. **Fixed**: :func:`lipdp.fix_batch_coupling` returns a copy with every
   BatchNormalization replaced by a GroupNormalization (gamma and beta kept), and a report.
   One more public epoch adapts the fixed backbone to its new normalisation (public data:
   no privacy cost).
4. **Private fine-tuning**: the first block frozen, the second block, the Dense(64) and a
   new head trained with clipped DP-SGD (flat clipping, ghost norms and the vectorised
   fallback inside the nested backbone), Poisson batches, the noise multiplier calibrated
   for (epsilon, 1e-5) after ``--epochs`` epochs; epsilon read back from the model's
   privacy report (its ledger).
5. **From scratch**: the same fixed architecture, randomly initialised, every layer
   trained with the same DP-SGD, batch, epochs and epsilon.

Selection: no search -- one fixed configuration (learning rate, clip) for both arms,
chosen before the run; mean and spread over ``--seeds``.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import tensorflow as tf

import lipdp
from lipdp.accounting import calibrate_noise_multiplier
from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.report import privacy_report
from lipdp.data.sources import load_fashion_mnist
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.pipeline import poisson_batches

try:
    from benchmarks.common import machine_description
except ModuleNotFoundError:  # run as a script from benchmarks/
    from common import machine_description

L = tf.keras.layers
DELTA = 1e-5
PUBLIC, PRIVATE = range(5), range(5, 10)


def split_data(quick=False):
    """``(public, private_train, private_test)`` as ``(x, y one-hot over 5 classes)``."""
    data = load_fashion_mnist()

    def part(x, y, classes):
        keep = np.isin(y, list(classes))
        images = x[keep].astype("float32")  # the loader's (n, 28, 28, 1), in [0, 1]
        labels = np.eye(5, dtype="float32")[y[keep] - min(classes)]
        return images, labels

    public = part(data.x_train, data.y_train, PUBLIC)
    private = part(data.x_train, data.y_train, PRIVATE)
    test = part(data.x_test, data.y_test, PRIVATE)
    if quick:
        public, private = (tuple(a[:2000] for a in s) for s in (public, private))
    return public, private, test


def backbone(name="backbone"):
    """The CNN backbone, with BatchNormalization as a public model would have it."""
    return tf.keras.Sequential(
        [
            tf.keras.Input((28, 28, 1)),
            L.Conv2D(16, 3, padding="same", name="conv1"),
            L.BatchNormalization(name="bn1"),
            L.ReLU(name="relu1"),
            L.MaxPooling2D(2, name="pool1"),
            L.Conv2D(32, 3, padding="same", name="conv2"),
            L.BatchNormalization(name="bn2"),
            L.ReLU(name="relu2"),
            L.MaxPooling2D(2, name="pool2"),
            L.Flatten(name="flatten"),
            L.Dense(64, activation="relu", name="embedding"),
        ],
        name=name,
    )


def pretrain(model, data, epochs, seed):
    tf.keras.utils.set_random_seed(seed)
    classifier = tf.keras.Sequential([model, L.Dense(5, name="public_head")])
    classifier.compile(
        optimizer=tf.keras.optimizers.Adam(1e-3),
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = classifier.fit(*data, batch_size=128, epochs=epochs, verbose=0)
    return history.history["accuracy"][-1]


def private_model(net, metadata, sigma, lr, clip):
    model = DPSGD_Sequential(
        [net, L.Dense(5, name="head")],
        dp_parameters=DPParameters("global", sigma, DELTA),
        clipping=Clipping("flat", clip),
        dataset_metadata=metadata,
    )
    model.compile(
        optimizer=tf.keras.optimizers.Adam(lr),
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def train_privately(model, train, test, args, seed):
    """``(test accuracy, epsilon from the model's report, seconds)`` of ``args.epochs``
    epochs of private training on Poisson batches."""
    tf.keras.utils.set_random_seed(seed)
    epochs = args.epochs
    metadata = model.dataset_metadata
    batches = poisson_batches(*train, metadata.sampling_rate, metadata.nb_steps_per_epochs, seed)
    start = time.perf_counter()
    model.fit(batches, epochs=epochs, verbose=0, callbacks=[DP_Accountant()])
    seconds = time.perf_counter() - start
    accuracy = model.evaluate(*test, batch_size=1000, verbose=0, return_dict=True)["accuracy"]
    return accuracy, privacy_report(model).epsilon, seconds


def run(args):
    public, private, test = split_data(args.quick)
    metadata = DatasetMetadata(
        input_shape=(28, 28, 1),
        nb_classes=5,
        nb_samples_train=len(private[0]),
        batch_size=args.batch,
        sampling="poisson",
    )
    sigma = calibrate_noise_multiplier(
        args.epsilon, args.epochs, args.batch, nb_samples=len(private[0]), delta=DELTA
    )
    rows = []
    for seed in args.seeds:
        pretrained = backbone()
        public_accuracy = pretrain(pretrained, public, args.public_epochs, seed)
        try:
            private_model(pretrained, metadata, sigma, args.lr, args.clip)
            refused = "accepted (!)"
        except ValueError as error:
            refused = str(error)
        fixed, report = lipdp.fix_batch_coupling(pretrained)
        adapted_accuracy = pretrain(fixed, public, 1, seed)
        for layer in fixed.layers[:4]:  # conv1, its normalisation, relu1, pool1
            layer.trainable = False
        scratch_net, _ = lipdp.fix_batch_coupling(backbone("scratch"))
        tuned, scratch = (
            train_privately(
                private_model(net, metadata, sigma, args.lr, args.clip), private, test, args, seed
            )
            for net in (fixed, scratch_net)
        )
        rows.append((seed, public_accuracy, adapted_accuracy, tuned, scratch))
        logging.info("seed %d: fine-tuned %s, scratch %s", seed, tuned, scratch)
    return sigma, refused, report, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--public-epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--quick", action="store_true", help="2 000 images, 1 epoch")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.public_epochs, args.batch, args.seeds = 1, 1, 200, args.seeds[:1]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    sigma, refused, report, rows = run(args)
    total = time.perf_counter() - start
    print("# Private fine-tuning on Fashion-MNIST 5-9 (public backbone from classes 0-4)\n")
    print(f"Machine: {machine_description()}; wall time {total:.0f} s.\n")
    print(
        f"(epsilon, delta) = ({args.epsilon:g}, {DELTA:g}) after {args.epochs} epochs, batch "
        f"{args.batch} (Poisson), sigma = {sigma:.4g}, flat clipping R = {args.clip:g}, Adam "
        f"lr = {args.lr:g}; one fixed configuration, no search; seeds {args.seeds}.\n"
    )
    print(f"Unfixed backbone: {refused}\n")
    print(f"Fixer report:\n\n```\n{report}\n```\n")
    print(
        "| seed | public acc. (BN) | public acc. after fix | fine-tuned acc. | ε | s "
        "| scratch acc. | ε | s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for seed, public, adapted, tuned, scratch in rows:
        print(
            f"| {seed} | {public:.3f} | {adapted:.3f} | {tuned[0]:.3f} | {tuned[1]:.3f} | "
            f"{tuned[2]:.0f} | {scratch[0]:.3f} | {scratch[1]:.3f} | {scratch[2]:.0f} |"
        )
    tuned = np.array([r[3][0] for r in rows])
    scratch = np.array([r[4][0] for r in rows])
    print(
        f"\nMean over {len(rows)} seed(s): fine-tuned {tuned.mean():.3f}, from scratch "
        f"{scratch.mean():.3f}."
    )


if __name__ == "__main__":
    main()
