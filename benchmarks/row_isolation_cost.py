"""Cost of row isolation (``row_isolation=True``): one training step, isolated vs batched.

    .venv/bin/python benchmarks/row_isolation_cost.py [--rounds 15] [--steps 10]
        [--networks dp-sgd-cnn mlp clipless-cnn] [--no-memory] [--json out.json]

Three networks, each built twice -- ``row_isolation=False`` (layers run on the batch, the
default) and ``row_isolation=True`` (every layer lipdp does not own, its activation and the
loss run one row at a time, forward and backward: :mod:`lipdp.core.isolation`):

* ``dp-sgd-cnn``: the network of ``lipdp train --method dp-sgd`` on digits
  (``lipdp.recipes.runs.keras_layers``: Conv2D(16, 3, tanh) -> MaxPool2D(2) -> Flatten
  -> Dense(10), 8x8x1 inputs), clipped DP-SGD with ghost norms, batch 512 (its default);
* ``mlp``: a dense network of ordinary Keras layers, 64 features -> Dense(128, relu) ->
  Dense(128, relu) -> Dense(10), clipped DP-SGD with ghost norms, batch 512;
* ``clipless-cnn``: the clipless CNN of ``lipdp train`` on digits without scattering
  (``pooled_cnn``, the DP layers of lipdp and a ``DP_ClipGradient``), batch 512: under
  isolation only its loss runs row by row (lipdp's own DP layers run on the batch).

**Time.** Both models of a network step in one process, round-robin (``--rounds`` rounds
of ``--steps`` ``train_on_batch`` calls each, the order alternated every round, same
batch), after a first step that traces the step (its wall time is reported: the trace
cost, the batched model's including the batch-independence probe, which an isolated model
does not need). A ratio is the median over rounds of the per-round ratio of wall times
(and of CPU times): the machine is shared, so only ratios measured side by side are quoted.

**Memory.** One subprocess per network and variant: the peak resident memory (polled every
millisecond) while the model is built, traces its step and takes ``--steps`` more, above
the memory once the modules are imported and the data built.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

BATCH = 512
NETWORKS = ("dp-sgd-cnn", "mlp", "clipless-cnn")


def data(name):
    rng = np.random.default_rng(0)
    shape, classes = ((64,), 10) if name == "mlp" else ((8, 8, 1), 10)
    x = rng.uniform(0.0, 1.0, size=(BATCH, *shape)).astype("float32")
    y = np.eye(classes, dtype="float32")[rng.integers(0, classes, BATCH)]
    return x, y


def build(name, isolated):
    import keras
    import tensorflow as tf

    from lipdp.clipless import losses
    from lipdp.clipless.layers import DP_ClipGradient
    from lipdp.clipless.model import DP_Sequential
    from lipdp.clipped.model import Clipping, DPSGD_Sequential
    from lipdp.core.parameters import DPParameters
    from lipdp.foundation import compat
    from lipdp.foundation.metadata import DatasetMetadata
    from lipdp.recipes import runs, zoo

    x, y = data(name)
    metadata = DatasetMetadata(
        input_shape=x.shape[1:],
        nb_classes=y.shape[1],
        nb_samples_train=20 * BATCH,
        batch_size=BATCH,
        max_norm=8.0,
    )
    params = DPParameters("global", 1.0, 1e-5)
    tf.keras.utils.set_random_seed(0)
    if name == "clipless-cnn":
        recipe = runs.ModelRecipe(dataset="digits", method="lipdp", scattering=False).resolved()
        architecture, options = runs.architecture(recipe)
        stack = zoo.ZOO[architecture](metadata, **options) + [DP_ClipGradient(1.0)]
        model = DP_Sequential(
            stack, dp_parameters=params, dataset_metadata=metadata, row_isolation=isolated
        )
        loss = losses.DP_TauCategoricalCrossentropy(8.0)
    else:
        if name == "dp-sgd-cnn":
            recipe = runs.ModelRecipe(dataset="digits", method="dp-sgd")
            layers = runs.keras_layers(recipe, metadata.input_shape, metadata.nb_classes)
        else:
            L = keras.layers
            layers = [
                compat.input_layer(x.shape[1:]),
                L.Dense(128, activation="relu"),
                L.Dense(128, activation="relu"),
                L.Dense(10),
            ]
        model = DPSGD_Sequential(
            layers,
            dp_parameters=params,
            clipping=Clipping("flat", 1.0),
            dataset_metadata=metadata,
            row_isolation=isolated,
        )
        loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, optimizer=keras.optimizers.SGD(0.01))
    return model, x, y


def timed(model, x, y, steps):
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        model.train_on_batch(x, y)
    return time.perf_counter() - wall, time.process_time() - cpu


def time_network(name, rounds, steps) -> dict:
    models, first = {}, {}
    for isolated in (False, True):
        model, x, y = build(name, isolated)
        start = time.perf_counter()
        model.train_on_batch(x, y)  # traces the step
        first[isolated] = time.perf_counter() - start
        timed(model, x, y, 2)  # warm
        models[isolated] = model
    walls, cpus = [], []
    per_step = {False: [], True: []}
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        result = {isolated: timed(models[isolated], x, y, steps) for isolated in order}
        walls.append(result[True][0] / result[False][0])
        cpus.append(result[True][1] / result[False][1])
        for isolated in (False, True):
            per_step[isolated].append(result[isolated][0] / steps)
    return {
        "network": name,
        "batch": BATCH,
        "step_ms_batched": 1e3 * float(np.median(per_step[False])),
        "step_ms_isolated": 1e3 * float(np.median(per_step[True])),
        "wall_ratio": float(np.median(walls)),
        "wall_ratio_quartiles": [float(q) for q in np.percentile(walls, [25, 75])],
        "cpu_ratio": float(np.median(cpus)),
        "first_step_s_batched": first[False],
        "first_step_s_isolated": first[True],
    }


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_worker(name, variant, steps) -> None:
    """Subprocess: the peak resident memory (MB) while the model is built and steps,
    above the memory after the imports and the data (``variant``: batched or isolated),
    polled every millisecond."""
    import threading

    import keras  # noqa: F401
    import tensorflow as tf  # noqa: F401

    import lipdp.clipless.model  # noqa: F401
    import lipdp.clipped.model  # noqa: F401

    data(name)
    start, peak, done = _rss_mb(), [0.0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    model, x, y = build(name, variant == "isolated")
    for _ in range(steps + 1):
        model.train_on_batch(x, y)
    done.set()
    poller.join()
    print(json.dumps({"peak_mb": max(peak[0], _rss_mb()) - start}))


def memory(name, steps) -> dict:
    result = {}
    for variant in ("batched", "isolated"):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", name, variant, "--steps", str(steps)],
            capture_output=True,
            text=True,
            check=True,
        )
        result[variant] = json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]
    return {"peak_mb_batched": result["batched"], "peak_mb_isolated": result["isolated"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=NETWORKS)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return memory_worker(*args.worker, args.steps)
    from common import machine_description

    print(f"Machine: {machine_description()}; {args.rounds} rounds x {args.steps} steps.\n")
    rows = []
    for name in args.networks:
        started = time.perf_counter()
        row = time_network(name, args.rounds, args.steps)
        if not args.no_memory:
            row.update(memory(name, args.steps))
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(
        "| network | batch | step batched (ms) | step isolated (ms) | wall ratio (IQR) | CPU ratio "
        "| first step batched / isolated (s) | peak MB batched / isolated |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        memory_cell = (
            f"{r['peak_mb_batched']:.0f} / {r['peak_mb_isolated']:.0f}"
            if "peak_mb_batched" in r
            else "-"
        )
        q1, q3 = r["wall_ratio_quartiles"]
        print(
            f"| {r['network']} | {r['batch']} | {r['step_ms_batched']:.1f} | "
            f"{r['step_ms_isolated']:.1f} | {r['wall_ratio']:.2f} ({q1:.2f}-{q3:.2f}) | "
            f"{r['cpu_ratio']:.2f} | {r['first_step_s_batched']:.1f} / "
            f"{r['first_step_s_isolated']:.1f} | {memory_cell} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
