"""GroupSort(2) implementations: forward + backward cost, and exactness.

    .venv/bin/python benchmarks/groupsort_speed.py [--rounds 11] [--threads 1]

``DP_GroupSort`` inherits deel-lip's ``GroupSort.call``: ``@tf.function``-decorated,
``reshape (..., C/2, 2) -> split -> minimum/maximum -> concat -> reshape``. On
channels-last tensors the split/concat on an innermost axis of size 2 are strided
copies, and the autodiff gradients of ``minimum``/``maximum`` add comparisons, selects
and zero tensors: about ten memory passes over the activation per step, against two for
ReLU. ``benchmarks/step_speed.py`` shows that this activation is most of lipdp's step
time on the CNN. Candidates measured here, all computing exactly the same function
(pairs of adjacent channels sorted):

* ``relu``: reference cost of the cheapest activation;
* ``deel-lip``: ``lipdp.layers.DP_GroupSort(2)`` as shipped;
* ``swap-where``: ``xs = swap(x)`` (the two channels of every pair exchanged, a
  ``reverse`` on the reshaped size-2 axis), ``t = sign * (xs - x) > 0`` (sign -1 on the
  first channel of a pair, +1 on the second), ``y = where(t, xs, x)``, with the custom
  gradient ``where(t, swap(g), g)``: y is an exact permutation of x and the gradient the
  same permutation of g (no arithmetic on values: outputs and gradients are bit-identical
  to deel-lip's);
* ``swap-where-xla``: the same under ``tf.function(jit_compile=True)`` (one fused kernel
  forward, one backward).

Each candidate is timed (CPU seconds of the process, TF on ``--threads`` threads) on the
activation shapes of the benchmark CNN (28x28x32 and 14x14x64, batch 256) and of the
dense network (64 features, batch 4096), forward + backward of ``sum(y * w)`` for a
fixed random ``w``, round-robin over ``--rounds`` rounds; the table gives medians and
the ratio to ``deel-lip``. Outputs and input gradients are compared with deel-lip's
(maximum absolute difference; 0 means bit-identical).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def swap_pairs(x):
    """Exchange the two channels of every pair (2i, 2i+1) on the last axis."""
    c = x.shape[-1]
    return tf.reshape(tf.reverse(tf.reshape(x, [-1, c // 2, 2]), [-1]), tf.shape(x))


@tf.custom_gradient
def groupsort2_swap_where(x):
    """GroupSort with groups of 2 (adjacent channels), exact custom gradient."""
    c = x.shape[-1]
    sign = tf.constant(np.tile([-1.0, 1.0], c // 2), x.dtype)
    xs = swap_pairs(x)
    take_partner = (xs - x) * sign > 0

    def grad(g):
        return tf.where(take_partner, swap_pairs(g), g)

    return tf.where(take_partner, xs, x), grad


groupsort2_swap_where_xla = tf.function(groupsort2_swap_where, jit_compile=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    from lipdp.layers import DP_GroupSort

    shapes = [(256, 28, 28, 32), (256, 14, 14, 64), (4096, 64)]
    print(f"TF {tf.__version__}, {os.cpu_count()} cores, TF threads: {args.threads}\n")
    print(
        "| shape | implementation | CPU ms fwd+bwd | ratio to deel-lip | max diff y | max diff g |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in shapes:
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=shape).astype("float32"))
        w = tf.constant(rng.normal(size=shape).astype("float32"))
        deel = DP_GroupSort(2)
        deel.build(shape)
        candidates = {
            "relu": tf.nn.relu,
            "deel-lip": deel,
            "swap-where": groupsort2_swap_where,
            "swap-where-xla": groupsort2_swap_where_xla,
        }
        steps, outputs = {}, {}
        for name, fn in candidates.items():

            def step(fn=fn, x=x, w=w):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = fn(x)
                    loss = tf.reduce_sum(y * w)
                return y, tape.gradient(loss, x)

            steps[name] = tf.function(step)
            outputs[name] = [t.numpy() for t in steps[name]()]
        times = {name: [] for name in steps}
        for r in range(args.rounds):
            names = list(steps)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                c0 = time.process_time()
                for _ in range(5):
                    y, g = steps[name]()
                g.numpy()
                times[name].append((time.process_time() - c0) / 5)
        ref = statistics.median(times["deel-lip"])
        for name, values in times.items():
            t = statistics.median(values)
            if name == "relu":
                diffs = "- | -"
            else:
                dy = np.abs(outputs[name][0] - outputs["deel-lip"][0]).max()
                dg = np.abs(outputs[name][1] - outputs["deel-lip"][1]).max()
                diffs = f"{dy:.1g} | {dg:.1g}"
            print(f"| {shape} | {name} | {1e3 * t:.3g} | {t / ref:.2f} | {diffs} |", flush=True)


if __name__ == "__main__":
    main()
