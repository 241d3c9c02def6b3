"""The clipped step's row scaling and float64 squares on TensorFlow: before and after
issue 39's second pass, side by side (CPU time, one thread).

    .venv/bin/python benchmarks/row_scaling_speed.py [--rounds 9] [--batch-sizes 256 1024]

Candidates, on the cotangents and per-row kernel gradients of the CNN of
``cross_library_speed.py`` (conv 1: cotangents ``(b, 28, 28, 32)``; conv 2: ``(b, 14, 14,
64)``; conv 2's per-row kernel gradients ``(b, 3, 3, 32, 64)``), standard normal entries
(every row maximum between ``2^-24`` and ``2^8``: the batch ``unit_rows`` leaves undivided):

* ``unit_rows, divided``: the row maxima, then every row times ``1 / max |G_i|`` (what
  :func:`lipdp.clipped.per_example.scale.unit_rows` did for every batch before);
* ``unit_rows``: the shipped function (the maxima only, on such a batch);
* ``square_sums, square then sum``: float64 cast, square, sum per row (before);
* ``square_sums``: the shipped function (each row's float64 dot product with itself).

Each candidate is a ``tf.function`` returning a few numbers of its result (so that the
result is computed, not copied out), timed round-robin over ``--rounds`` rounds, five calls
a round (CPU seconds of the process); medians, and the largest difference of the results
from the former formula (for ``unit_rows``: of the rows ``s_i U_i`` they stand for, which
differ by the rounding of ``1 / s_i``; for the squares: float64 round-off).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lipdp

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def divided_unit_rows(g):
    """``unit_rows`` as it was before: every batch divided by its row maxima."""
    from lipdp.clipped.per_example.scale import TINY, scaled

    flat = tf.reshape(g, tf.stack([tf.shape(g)[0], -1]))
    s = tf.maximum(tf.reduce_max(flat, axis=1), -tf.reduce_min(flat, axis=1))
    s = tf.where(s >= TINY, s, tf.ones_like(s))
    return scaled(1.0 / s, g), s


def squared_then_summed(per_row):
    """``square_sums`` as it was before."""
    return tf.add_n(
        [
            tf.reduce_sum(tf.reshape(tf.square(tf.cast(t, tf.float64)), [tf.shape(t)[0], -1]), 1)
            for t in per_row
        ]
    )


def _rows(fn):
    """``fn``'s ``(U, s)`` as the rows they stand for, ``s_i U_i`` (the first two), and
    ``U`` itself (summed: computed in full)."""

    def rows(g):
        u, s = fn(g)
        first = tf.reshape(s[:2], [2, 1, 1, 1]) * u[:2]
        return [first, tf.reduce_sum(u, axis=[1, 2, 3])[:2] * 0.0]

    return rows


def main():
    from lipdp.clipped.per_example.scale import square_sums, unit_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(f"TF {tf.__version__}, {os.cpu_count()} cores, 1 thread, load {os.getloadavg()[0]:.1f}")
    print("| b | tensor | candidate | CPU ms | ratio to before | max diff |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for b in args.batch_sizes:
        rng = np.random.default_rng(0)
        cases = {
            "conv 1 cotangents": (
                rng.normal(size=(b, 28, 28, 32)),
                {"unit_rows, divided": _rows(divided_unit_rows), "unit_rows": _rows(unit_rows)},
            ),
            "conv 2 cotangents": (
                rng.normal(size=(b, 14, 14, 64)),
                {"unit_rows, divided": _rows(divided_unit_rows), "unit_rows": _rows(unit_rows)},
            ),
            "conv 2 kernel rows": (
                rng.normal(size=(b, 3, 3, 32, 64)),
                {
                    "square_sums, square then sum": lambda t: [squared_then_summed([t])],
                    "square_sums": lambda t: [square_sums([t])],
                },
            ),
        }
        for label, (values, candidates) in cases.items():
            x = tf.constant(values.astype("float32"))
            functions, results = {}, {}
            for name, fn in candidates.items():
                # the first rows of each result: computed in full, not copied out
                functions[name] = tf.function(lambda t, fn=fn: [r[:2] for r in fn(t)])
                results[name] = [r.numpy() for r in functions[name](x)]
            times = {name: [] for name in functions}
            names = list(functions)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    start = time.process_time()
                    for _ in range(5):
                        out = functions[name](x)
                    out[0].numpy()
                    times[name].append((time.process_time() - start) / 5)
            before = names[0]
            ref = statistics.median(times[before])
            for name in names:
                t = statistics.median(times[name])
                diff = max(
                    float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(c, "float64"))))
                    for a, c in zip(results[name], results[before])
                    if np.asarray(a).shape == np.asarray(c).shape
                )
                print(f"| {b} | {label} | {name} | {1e3 * t:.1f} | {t / ref:.2f} | {diff:.1g} |")


if __name__ == "__main__":
    main()
