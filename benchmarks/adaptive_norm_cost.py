"""Cost of norm-adaptive bounds (Lip-DP-SGD): one training step, adaptive vs fixed norms.

    .venv/bin/python benchmarks/adaptive_norm_cost.py [--rounds 30] [--steps 20]

The same network twice, kernels in spectral balls of radius 2: ``adaptive_norm=False``
(bounds from the radius) and ``adaptive_norm=True`` (bounds from each kernel's current
norm: one float64 eigenvalue problem of the smaller Gram matrix per kernel and step).
Both models step in one process, round-robin (``--rounds`` rounds of ``--steps`` steps
each, same batch), and the table gives the median per-round ratio of wall and CPU time:
the machine is shared, so only ratios measured side by side are quoted.

Networks: the breast-cancer MLP (``lip_mlp``, 30 -> 32 -> 2, batch 64) and the
Fashion-MNIST CNN of the utility benchmark (``strided_cnn``, 1 -> 16 -> 64 channels,
batch 2000).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import machine_description  # noqa: E402

from lipdp.clipless import losses  # noqa: E402
from lipdp.clipless.model import DPParameters  # noqa: E402
from lipdp.foundation.metadata import DatasetMetadata  # noqa: E402
from lipdp.recipes import zoo

NETWORKS = {
    # name: (builder, input shape, classes, batch, options)
    "mlp (breast cancer)": ("lip_mlp", (30,), 2, 64, {"width": 32}),
    "cnn (fashion-mnist)": ("strided_cnn", (28, 28, 1), 10, 2000, {"clip": 0.3}),
}


def model_for(name, adaptive):
    builder, shape, classes, batch, options = NETWORKS[name]
    metadata = DatasetMetadata(
        input_shape=shape,
        nb_classes=classes,
        nb_samples_train=20 * batch,
        batch_size=batch,
        max_norm=1.0,
    )
    tf.keras.utils.set_random_seed(0)
    model = zoo.build_model(
        builder,
        metadata,
        DPParameters("global", 1.0, 1e-5),
        weight_norm_bound=2.0,
        adaptive_norm=adaptive,
        constraint="spectral",
        **options,
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(8.0), optimizer="adam")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = np.eye(classes, dtype="float32")[rng.integers(0, classes, batch)]
    model.train_on_batch(x, y)  # trace and compile outside the timing
    return model, x, y


def timed(model, x, y, steps):
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        model.train_on_batch(x, y)
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"Machine: {machine_description()}; {args.rounds} rounds x {args.steps} steps.\n")
    print(
        "| network | fixed, ms/step (median) | adaptive, ms/step (median) | "
        "adaptive / fixed, wall (median per round) | adaptive / fixed, CPU |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name in NETWORKS:
        fixed, adaptive = model_for(name, False), model_for(name, True)
        walls, cpus, per_step = [], [], {False: [], True: []}
        for _ in range(args.rounds):
            wf, cf = timed(*fixed, args.steps)
            wa, ca = timed(*adaptive, args.steps)
            walls.append(wa / wf)
            cpus.append(ca / cf)
            per_step[False].append(1000 * wf / args.steps)
            per_step[True].append(1000 * wa / args.steps)
        print(
            f"| {name} | {np.median(per_step[False]):.2f} | {np.median(per_step[True]):.2f} | "
            f"{np.median(walls):.3f} | {np.median(cpus):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
