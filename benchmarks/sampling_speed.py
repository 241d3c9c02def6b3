"""Speed cost of Poisson sampling vs shuffled fixed-size batches, on Fashion-MNIST.

    .venv/bin/python benchmarks/sampling_speed.py [--rounds 3] [--batch-size 2048]

The CLI's Fashion-MNIST CNN (``lipdp.recipes.zoo.pooled_cnn``, widths 32/64, b = 2048, global
noise) is trained one epoch at a time on the two pipelines of
``load_and_prepare_images_data`` (``sampling="shuffle"`` and ``sampling="poisson"``), in
one process, round-robin (shuffle, poisson, shuffle, ...) after one warm-up epoch each,
so that machine noise hits both alike. Prints the wall time per epoch of each and their
ratio (median over the rounds), and the time to draw one epoch of batches without
training. Both pipelines run ``N // b`` steps per epoch; Poisson batches have ``b``
examples on average.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from common import machine_description  # noqa: E402

from lipdp.clipless import losses  # noqa: E402
from lipdp.clipless.model import DPParameters  # noqa: E402
from lipdp.pipeline import load_and_prepare_images_data  # noqa: E402
from lipdp.recipes import zoo


def setup(sampling, batch_size):
    ds_train, _, metadata = load_and_prepare_images_data(
        "fashion_mnist", batch_size=batch_size, bound_fct=10.0, sampling=sampling, seed=0
    )
    model = zoo.build_model(
        "pooled_cnn", metadata, DPParameters("global", 2.0, 1e-5), widths=(32, 64)
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(8.0), optimizer=tf.keras.optimizers.Adam(0.01)
    )
    return model, ds_train


def timed_epoch(model, ds_train):
    start = time.perf_counter()
    model.fit(ds_train, epochs=1, verbose=0)
    return time.perf_counter() - start


def timed_pass(ds_train):
    start = time.perf_counter()
    for _ in ds_train:
        pass
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2048)
    args = parser.parse_args()
    runs = {s: setup(s, args.batch_size) for s in ("shuffle", "poisson")}
    times = {s: [] for s in runs}
    passes = {s: [] for s in runs}
    for model, ds in runs.values():
        timed_epoch(model, ds)  # warm-up: tracing and compilation
    for _ in range(args.rounds):
        for sampling, (model, ds) in runs.items():
            times[sampling].append(timed_epoch(model, ds))
            passes[sampling].append(timed_pass(ds))
    shuffle, poisson = (statistics.median(times[s]) for s in ("shuffle", "poisson"))
    print(f"Fashion-MNIST, pooled_cnn (32, 64), b = {args.batch_size}, {args.rounds} rounds")
    print(f"machine: {machine_description()}\n")
    print("| sampling | s per epoch (median) | s per epoch of batches alone | rounds |")
    print("| --- | --- | --- | --- |")
    for s in ("shuffle", "poisson"):
        print(
            f"| {s} | {statistics.median(times[s]):.2f} | {statistics.median(passes[s]):.2f} "
            f"| {', '.join(f'{t:.2f}' for t in times[s])} |"
        )
    print(f"\nPoisson / shuffle, training epoch: {poisson / shuffle:.3f}x")


if __name__ == "__main__":
    main()
