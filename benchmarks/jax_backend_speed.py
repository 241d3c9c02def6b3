"""Step time on Keras 3's JAX backend: plain Keras, lipdp's clipped DP-SGD and jax-privacy.

    KERAS_BACKEND=jax .venv/bin/python benchmarks/jax_backend_speed.py [--batch 256]
        [--rounds 3] [--steps 5] [--json out.json]

Results and their reading: benchmarks/README.md, section "The JAX backend".

Three contenders on ``step_speed.py``'s ``cnn`` network (Conv2D 32 - ReLU - AveragePooling
- Conv2D 64 - ReLU - AveragePooling - Dense 10, no biases, 50 080 parameters, 28x28x1
inputs), built once with the same initial weights, in one process:

* ``keras``: plain Keras 3 training (``SGD``, the mean cross-entropy);
* ``lipdp``: :class:`lipdp.clipped.jax.model.DPSGD_JaxModel` (flat clipping ``R = 1``,
  ``sigma = 1``, fixed batches of ``b``: per-example gradients by ``vmap`` of ``grad``);
* ``lipdp-ghost``: the same with ``gradient_method="ghost"`` (ghost norms: Conv2D by
  patches, per-row kernel gradients materialised; Dense by ``||a|| ||g||``);
* ``jax-privacy``: ``jax_privacy.keras_api.make_private`` (jax-privacy 2.0.0,
  ``DPKerasConfig`` with the same ``R``, ``sigma`` and ``b``; its default microbatching,
  ``vmap`` over the whole batch).

Every contender's compiled Keras step (``model.train_function``, ``jax.jit`` of its
``train_step``) is called on the state Keras would hand it, on one fixed batch of
synthetic data, outside ``fit``: the steps are what is compared, not the data pipeline.
After two warm-up calls (the first compiles), a round times ``--steps`` calls of each
contender in turn, the order rotated by one every round, so that the load of the shared
machine hits all alike; a ratio is the median over rounds of the per-round ratio. Wall
time (``time.perf_counter``) and CPU time (``time.process_time``, all threads: it does not
count the time spent waiting for a core, so on a loaded machine it is the stabler
measure) per step, the median over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

CONTENDERS = ["keras", "lipdp", "lipdp-ghost", "jax-privacy"]
SIGMA, CLIP = 1.0, 1.0
SHAPE, CLASSES = (28, 28, 1), 10


def cnn():
    import common  # (benchmarks/, the script's directory, is on sys.path)

    return keras.Sequential(common.plain_cnn_layers(SHAPE, CLASSES))


def _loss():
    return keras.losses.CategoricalCrossentropy(from_logits=True)


def build(contender, batch, weights):
    """The compiled model of ``contender``, its weights set to ``weights``."""
    network = cnn()
    network.set_weights(weights)
    n = 100 * batch
    if contender == "keras":
        model = network
    elif contender in ("lipdp", "lipdp-ghost"):
        from lipdp.clipped.clipping import Clipping
        from lipdp.clipped.jax.model import DPSGD_JaxModel
        from lipdp.core.parameters import DPParameters
        from lipdp.foundation.metadata import DatasetMetadata

        metadata = DatasetMetadata(
            input_shape=SHAPE, nb_classes=CLASSES, nb_samples_train=n, batch_size=batch
        )
        model = DPSGD_JaxModel(
            network,
            dp_parameters=DPParameters("global", SIGMA, 1e-5),
            clipping=Clipping("flat", CLIP),
            dataset_metadata=metadata,
            gradient_method="ghost" if contender == "lipdp-ghost" else "vmap",
        )
    else:
        from jax_privacy import keras_api

        config = keras_api.DPKerasConfig(
            epsilon=8.0, delta=1e-5, clipping_norm=CLIP, batch_size=batch,
            gradient_accumulation_steps=1, train_steps=1000, train_size=n,
            noise_multiplier=SIGMA,
        )  # fmt: skip
        model = keras_api.make_private(network, config)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=_loss())
    return model


class Stepper:
    """A contender's compiled step on a fixed batch, called outside ``fit``."""

    def __init__(self, model, batch_data):
        self.model = model
        self.data = batch_data
        model.optimizer.build(model.trainable_variables)  # what fit's first build does
        model.make_train_function()
        self.state = model._get_jax_state(  # noqa: SLF001 - the state fit would pass
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )

    def __call__(self, steps):
        for _ in range(steps):
            logs, self.state = self.model.train_function(self.state, iter([self.data]))
        jax.block_until_ready((logs, self.state))


def _timed(stepper, steps):
    wall, cpu = time.perf_counter(), time.process_time()
    stepper(steps)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def measure(batch, rounds, steps):
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, size=(batch, *SHAPE)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, size=batch)]
    data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
    keras.utils.set_random_seed(0)
    weights = cnn().get_weights()
    steppers, first = {}, {}
    for name in CONTENDERS:
        steppers[name] = Stepper(build(name, batch, weights), data)
        t0 = time.perf_counter()
        steppers[name](1)  # compiles
        first[name] = time.perf_counter() - t0
        steppers[name](1)
    results = {name: [] for name in CONTENDERS}
    for r in range(rounds):
        order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
        for name in order:
            wall, cpu = _timed(steppers[name], steps)
            results[name].append({"round": r, "wall_s": wall, "cpu_s": cpu})
            print(f"round {r}: {name:12s} wall {1e3 * wall:8.1f} ms  cpu {1e3 * cpu:8.1f} ms",
                  file=sys.stderr)  # fmt: skip
    params = int(sum(np.prod(w.shape) for w in weights))
    return {"results": results, "first_step_s": first, "parameters": params}


def _ratios(results, num, den, field):
    return [a[field] / b[field] for a, b in zip(results[num], results[den])]


def table(measured, batch) -> str:
    results = measured["results"]
    lines = [
        f"| contender (b = {batch}) | wall ms/step | CPU ms/step | wall / keras | CPU / keras "
        "| wall / jax-privacy | CPU / jax-privacy | first call s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in CONTENDERS:
        wall = statistics.median(r["wall_s"] for r in results[name])
        cpu = statistics.median(r["cpu_s"] for r in results[name])
        cells = [f"{1e3 * wall:.1f}", f"{1e3 * cpu:.1f}"]
        for other in ("keras", "jax-privacy"):
            for field in ("wall_s", "cpu_s"):
                if other not in results:
                    cells.append("-")
                    continue
                cells.append(f"{statistics.median(_ratios(results, name, other, field)):.2f}x")
        cells.append(f"{measured['first_step_s'][name]:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "devices": [str(d) for d in jax.devices()]}  # fmt: skip
    for name in ("jax", "jaxlib", "keras", "jax-privacy", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed call")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=None,
                        help="time these contenders only")  # fmt: skip
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        parser.error("run with KERAS_BACKEND=jax")
    if args.only:
        CONTENDERS[:] = [c for c in CONTENDERS if c in args.only]
    measured = measure(args.batch, args.rounds, args.steps)
    measured.update(
        date=datetime.date.today().isoformat(), versions=versions(), batch=args.batch,
        rounds=args.rounds, steps=args.steps,
    )  # fmt: skip
    print(f"{measured['parameters']} parameters; {measured['versions']}")
    print(table(measured, args.batch))
    if args.json is not None:
        args.json.write_text(json.dumps(measured, indent=1))


if __name__ == "__main__":
    main()
