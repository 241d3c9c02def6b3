"""Step time of clipped DP-SGD with a nested backbone: ghost norms inside the nested model
against the whole backbone on the vectorised fallback (as before issue 26's change), and
against the same layers listed flat.

    .venv/bin/python benchmarks/nested_backbone_speed.py [--batch 256] [--rounds 15]
        [--steps 5]

The backbone (28x28x1 inputs, 5 classes): two blocks ``Conv2D(16 | 32, 3, same) ->
GroupNormalization(4) -> ReLU -> MaxPooling2D(2)``, the first frozen, then ``Flatten ->
Dense(64, relu)``; the model is ``DPSGD_Sequential([backbone, Dense(5)])`` (flat clipping,
ghost norms, sigma = 1, SGD). Three variants, each its own model with the same weights:

* ``nested``: the engine runs the nested chain layer by layer: ghost norms for the
  ``Conv2D`` and ``Dense`` inside, the vectorised fallback for each ``GroupNormalization``
  alone;
* ``nested-as-one-layer``: the same model traced with the recursion switched off
  (``lipdp.clipped.per_example.engine._chain_layers`` patched to return ``None`` while
  the step is traced): every trainable variable of the backbone materialised per row by
  ``tf.vectorized_map`` over the backbone's own vector-Jacobian product -- the engine
  before the change;
* ``flat``: the backbone's layers listed in ``DPSGD_Sequential`` directly.

All three are traced (3 warm-up steps) in one process, then timed round-robin: ``--rounds``
rounds of ``--steps`` steps each, the order rotated every round, so that the load of the
shared machine hits all variants alike; a ratio is the median over rounds of the
per-round ratio. Synthetic data (standard normal images, random labels).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from unittest import mock

import numpy as np
import tensorflow as tf

from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.foundation.metadata import DatasetMetadata

try:
    from benchmarks.common import machine_description
except ModuleNotFoundError:  # run as a script from benchmarks/
    from common import machine_description

L = tf.keras.layers
SHAPE, CLASSES = (28, 28, 1), 5


def _block(filters, trainable):
    block = tf.keras.Sequential(
        [L.Conv2D(filters, 3, padding="same"), L.GroupNormalization(4), L.ReLU(), L.MaxPooling2D(2)]
    )
    block.trainable = trainable
    return block


def backbone():
    return tf.keras.Sequential(
        [
            tf.keras.Input(SHAPE),
            _block(16, trainable=False),
            _block(32, trainable=True),
            L.Flatten(),
            L.Dense(64, activation="relu"),
        ],
        name="backbone",
    )


def flat_layers(net):
    """The backbone's layers, blocks expanded, frozen ones kept frozen."""
    layers = []
    for layer in net.layers:
        inner = layer.layers if isinstance(layer, tf.keras.Sequential) else [layer]
        layers += inner
    return layers


def dp_model(layers, batch):
    model = DPSGD_Sequential(
        [L.InputLayer(input_shape=SHAPE), *layers],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", 1.0),
        dataset_metadata=DatasetMetadata(
            input_shape=SHAPE, nb_classes=CLASSES, nb_samples_train=60_000, batch_size=batch
        ),
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.01),
    )
    return model


def variants(batch):
    """``{name: (model, context the step is traced in)}``, all with the same weights."""
    tf.keras.utils.set_random_seed(0)
    net = backbone()
    head = L.Dense(CLASSES)
    nested = dp_model([net, head], batch)
    twin_net, twin_head = backbone(), L.Dense(CLASSES)
    as_one = dp_model([twin_net, twin_head], batch)
    as_one.set_weights(nested.get_weights())
    flat_net, flat_head = backbone(), L.Dense(CLASSES)
    flat_net.set_weights(net.get_weights())
    flat_head.build((None, 64))
    flat_head.set_weights(head.get_weights())
    flat = dp_model([*flat_layers(flat_net), flat_head], batch)
    no_recursion = mock.patch("lipdp.clipped.per_example.engine._chain_layers", return_value=None)
    return {
        "nested": (nested, contextlib.nullcontext()),
        "nested-as-one-layer": (as_one, no_recursion),
        "flat": (flat, contextlib.nullcontext()),
    }


def timed_steps(model, x, y, steps):
    start = time.perf_counter()
    for _ in range(steps):
        model.train_on_batch(x, y)
    return (time.perf_counter() - start) / steps


def run(args):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, *SHAPE)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, args.batch)]
    models = variants(args.batch)
    for name, (model, tracing) in models.items():
        with tracing:  # the step is traced at its first call
            for _ in range(3):
                model.train_on_batch(x, y)
        logging.info("%s: traced", name)
    names = list(models)
    times = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(timed_steps(models[name][0], x, y, args.steps))
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    times = run(args)
    reference = np.array(times["nested"])
    logging.info("%s, batch %d", machine_description(), args.batch)
    logging.info("| variant | median step (ms) | ratio to nested (median over rounds) |")
    logging.info("| --- | --- | --- |")
    for name, values in times.items():
        values = np.array(values)
        ratio = np.median(values / reference)
        logging.info("| %s | %.1f | %.2fx |", name, 1000 * np.median(values), ratio)


if __name__ == "__main__":
    main()
