"""Cost of the batch-independence probe at the first trace of a training step.

    .venv/bin/python benchmarks/probe_cost.py [--repeats 5] [--batch-size 512] [--baseline FILE]

On the two networks of ``lipdp train`` on digits (8x8x1 images, 10 classes, Poisson
batches of ``b = --batch-size``, the data set's default 512): the clipless CNN
(``method="lipdp"``, ``scattering=False``: ``pooled_cnn``) and the small Keras CNN of
``method="dp-sgd"`` (``scattering=False``). For each, in one process: the probe's first
run on a fresh model (TensorFlow's kernels cold for that model), the best of
``--repeats`` further runs (warm), the first training step (traced; probe off, so that the
numbers add up) and a later step. The probe runs once per model and input spec, when the
step is first traced: its cost is to be read against the first step's. ``--baseline
FILE``: another version of ``lipdp/core/batch_independence.py`` (e.g. ``git show
main:lipdp/core/batch_independence.py > /tmp/old.py``) whose probe is timed side by side,
each round running both on the same model (first runs: each on a fresh model, the
baseline first).
"""

import argparse
import importlib.util
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from lipdp.core import batch_independence  # noqa: E402
from lipdp.core.metadata import DatasetMetadata  # noqa: E402
from lipdp.recipes.runs import ModelRecipe, build_model  # noqa: E402

N_TRAIN, CLASSES, SHAPE = 1536, 10, (8, 8, 1)


def model(method, batch_size, probe=True):
    metadata = DatasetMetadata(
        input_shape=SHAPE,
        nb_classes=CLASSES,
        nb_samples_train=N_TRAIN,
        batch_size=batch_size,
        max_norm=5.0,
        sampling="poisson",
    )
    recipe = ModelRecipe(dataset="digits", method=method, scattering=False, batch_size=batch_size)
    built = build_model(recipe, metadata)
    built.independence_probe = probe
    return built


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load(path):
    spec = importlib.util.spec_from_file_location("baseline_batch_independence", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--baseline", help="another batch_independence.py, timed side by side")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (args.batch_size, *SHAPE)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, args.batch_size)]
    specs = tf.TensorSpec((None, *SHAPE)), tf.TensorSpec((None, CLASSES))
    versions = {"this": batch_independence}
    if args.baseline:
        versions = {"baseline": load(args.baseline), **versions}
    print(
        "| network | probe | first run (s) | warm (best, s) | warm (median, s) | passes "
        "| first step (s) | later step (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for method in ("lipdp", "dp-sgd"):
        trained = model(method, args.batch_size, probe=False)
        first = seconds(lambda: trained.train_on_batch(x, y))
        later = min(seconds(lambda: trained.train_on_batch(x, y)) for _ in range(args.repeats))
        cold, warm, passes = {}, {name: [] for name in versions}, {}
        for name, module in versions.items():
            probed = model(method, args.batch_size)
            start = time.perf_counter()
            result = module.probe(probed, *specs)
            cold[name] = time.perf_counter() - start
            passes[name] = getattr(result, "passes", 4)
        probed = model(method, args.batch_size)
        for _ in range(args.repeats):  # interleaved rounds on one model
            for name, module in versions.items():
                warm[name].append(seconds(lambda m=module: m.probe(probed, *specs)))
        for name in versions:
            print(
                f"| {method} | {name} | {cold[name]:.2f} | {min(warm[name]):.2f} "
                f"| {np.median(warm[name]):.2f} | {passes[name]} | {first:.2f} | {later:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
