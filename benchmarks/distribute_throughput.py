"""Throughput of private training under MirroredStrategy over two logical CPU devices vs
one device, the same global batch, with the cost of the noise and of the projections
isolated.

    .venv/bin/python benchmarks/distribute_throughput.py [--batches 256 1024] [--rounds 7]

Results and their reading: benchmarks/README.md ("Several devices").

One process; the CPU is split into two logical devices before TensorFlow starts. The
network is step_speed.py's ``cnn`` (the getting-started Lipschitz CNN, 50 080
parameters; its unconstrained twin for DP-SGD), synthetic 28x28 inputs, SGD. For every
placement (``one``: no strategy, the first logical device; ``mirrored``: both) the
variants are

* ``lipdp``: Clipless DP-SGD, sigma = 1 (noise drawn once per step, on replica 0);
* ``lipdp-no-noise``: the same, non-private (projections, no noise);
* ``lipdp-no-project``: noise, projections skipped (an instance patch, as step_speed's);
* ``dpsgd``: lipdp's clipped DP-SGD (ghost norms, flat clipping), sigma = 1.

Each variant's Keras ``train_function`` is traced once, then timed in rounds: in every
round each (placement, variant) pair runs about 0.4 s of steps, in an order rotated
every round, so that the load of the shared machine hits all of them alike. A ratio is
the median over rounds of the per-round ratio; times are medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

from lipdp.core.distribute import mirrored_strategy  # noqa: E402

try:
    from benchmarks import step_speed
    from benchmarks.common import machine_description
except ModuleNotFoundError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_speed
    from common import machine_description

VARIANTS = ("lipdp", "lipdp-no-noise", "lipdp-no-project", "dpsgd")
PLACEMENTS = ("one", "mirrored")


def build(variant, batch):
    if variant == "dpsgd":
        return step_speed._build_dpsgd("cnn", "ghost", batch)
    name = {"lipdp": "lipdp-global"}.get(variant, variant)
    return step_speed._build_lipdp("cnn", name, batch)


def train_function(strategy, variant, batch):
    """``(train_function, iterator)`` of ``variant`` built and fed under ``strategy``."""
    with strategy.scope():
        model = build(variant, batch)
    x, y = step_speed._data("cnn", batch)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    data = data.repeat()
    if strategy.num_replicas_in_sync > 1:
        data = strategy.experimental_distribute_dataset(data)
    iterator = iter(data)
    return step_speed._train_function(model), iterator  # Keras 3's returns None


def timed_round(pairs, steps):
    """Seconds per step of every (placement, variant) pair, in the given order."""
    result = {}
    for key, (function, iterator) in pairs:
        t0 = time.perf_counter()
        for _ in range(steps[key]):
            logs = function(iterator)
        step_speed._sync(logs)
        result[key] = (time.perf_counter() - t0) / steps[key]
    return result


def measure(batch, rounds):
    strategies = {
        "one": tf.distribute.get_strategy(),
        "mirrored": mirrored_strategy([d.name for d in tf.config.list_logical_devices("CPU")[:2]]),
    }
    functions = {
        (placement, variant): train_function(strategies[placement], variant, batch)
        for placement in PLACEMENTS
        for variant in VARIANTS
    }
    steps = {}
    for key, (function, iterator) in functions.items():
        _, steps[key] = step_speed._warm_up(function, iterator)
    items = list(functions.items())
    results = []
    for r in range(rounds):
        shift = r % len(items)
        results.append(timed_round(items[shift:] + items[:shift], steps))
    return results


def median(results, fn):
    return statistics.median(fn(r) for r in results)


def table(batch, results):
    lines = [
        f"### Global batch {batch}",
        "",
        "| variant | one device (ms/step) | mirrored, 2 devices (ms/step) | throughput "
        "mirrored / one |",
        "| --- | --- | --- | --- |",
    ]
    for variant in VARIANTS:
        one = median(results, lambda r, v=variant: r[("one", v)])
        two = median(results, lambda r, v=variant: r[("mirrored", v)])
        ratio = median(results, lambda r, v=variant: r[("one", v)] / r[("mirrored", v)])
        lines.append(f"| {variant} | {1e3 * one:.1f} | {1e3 * two:.1f} | {ratio:.2f}x |")
    lines += [
        "",
        "| overhead (time ratio) | one device | mirrored |",
        "| --- | --- | --- |",
    ]
    for label, other in (("noise", "lipdp-no-noise"), ("projection", "lipdp-no-project")):
        cells = [
            median(results, lambda r, p=p, o=other: r[(p, "lipdp")] / r[(p, o)]) for p in PLACEMENTS
        ]
        lines.append(f"| {label}: lipdp / {other} | {cells[0]:.3f} | {cells[1]:.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"# Mirrored training on 2 logical CPU devices vs one ({machine_description()})\n")
    print(f"{args.rounds} rounds per batch size; medians over rounds.\n")
    for batch in args.batches:
        t0 = time.perf_counter()
        results = measure(batch, args.rounds)
        print(table(batch, results))
        print(f"\n(wall time {time.perf_counter() - t0:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
