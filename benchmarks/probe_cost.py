"""Cost of the batch-independence probe at the first trace of a training step.

    .venv/bin/python benchmarks/probe_cost.py [--rounds 3] [--batch-size 512] [--baseline FILE]

The probe runs once per model and input spec, inside the first training step (when it is
traced), so its cost is what it adds to that step. On the two networks of ``lipdp train``
on digits (8x8x1 images, 10 classes, Poisson batches of ``b = --batch-size``, the data
set's default 512) -- the clipless CNN (``method="lipdp"``, ``scattering=False``:
``pooled_cnn``) and the small Keras CNN of ``method="dp-sgd"`` (``scattering=False``) --
each measurement runs in a fresh process: the first ``train_on_batch`` of a model (cold:
the process's first, TensorFlow's kernels and autograph's conversions not yet made), then
the first step of a second, fresh model in the same process (warm: as every later model
of a test run), and a later step. Versions: the probe off (``independence_probe=False``),
this probe, and with ``--baseline FILE`` the probe of another version of
``lipdp/core/batch_independence.py`` (e.g. ``git show
main:lipdp/core/batch_independence.py > /tmp/old.py``). ``--rounds`` rounds, the versions
interleaved in each; medians are printed, with the probe's share (the difference with the
probe off).
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

N_TRAIN, CLASSES, SHAPE = 1536, 10, (8, 8, 1)


def load(path):
    spec = importlib.util.spec_from_file_location("baseline_batch_independence", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def child(method, version, batch_size, baseline):
    """One process: the first step of two fresh models and a later step (seconds)."""
    import numpy as np

    from lipdp.core import batch_independence
    from lipdp.foundation.metadata import DatasetMetadata
    from lipdp.recipes.runs import ModelRecipe, build_model

    if version == "baseline":
        batch_independence.probe = load(baseline).probe  # what probe_when_traced calls
    metadata = DatasetMetadata(
        input_shape=SHAPE,
        nb_classes=CLASSES,
        nb_samples_train=N_TRAIN,
        batch_size=batch_size,
        max_norm=5.0,
        sampling="poisson",
    )
    recipe = ModelRecipe(dataset="digits", method=method, scattering=False, batch_size=batch_size)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (batch_size, *SHAPE)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, batch_size)]
    times = []
    for _ in range(2):
        model = build_model(recipe, metadata)
        model.independence_probe = version != "off"
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    later = []
    for _ in range(5):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        later.append(time.perf_counter() - start)
    return {"cold": times[0], "warm": times[1], "later": min(later)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--baseline", help="another batch_independence.py, timed side by side")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "VERSION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.batch_size, args.baseline)))
        return
    versions = ["off", "this"] + (["baseline"] if args.baseline else [])
    results = {}
    for _ in range(args.rounds):
        for method in ("lipdp", "dp-sgd"):
            for version in versions:
                command = [sys.executable, __file__, "--child", method, version]
                command += ["--batch-size", str(args.batch_size)]
                if args.baseline:
                    command += ["--baseline", args.baseline]
                out = subprocess.run(command, capture_output=True, text=True, check=True)
                results.setdefault((method, version), []).append(
                    json.loads(out.stdout.strip().splitlines()[-1])
                )
    import numpy as np

    print(
        "| network | probe | first step, cold process (s) | its probe share (s) "
        "| first step, warm process (s) | its probe share (s) | later step (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method in ("lipdp", "dp-sgd"):
        off = {k: np.median([r[k] for r in results[(method, "off")]]) for k in ("cold", "warm")}
        for version in versions:
            runs = results[(method, version)]
            cold, warm = (np.median([r[k] for r in runs]) for k in ("cold", "warm"))
            later = np.median([r["later"] for r in runs])
            name = {"off": "off", "this": "this version", "baseline": "baseline"}[version]
            print(
                f"| {method} | {name} | {cold:.2f} | {cold - off['cold']:+.2f} | {warm:.2f} "
                f"| {warm - off['warm']:+.2f} | {later:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
