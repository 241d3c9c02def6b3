"""GroupSort(2) implementations: forward + backward cost, and exactness.

    .venv/bin/python benchmarks/groupsort_speed.py [--rounds 11] [--threads 1]

deel-lip's ``GroupSort.call`` (which ``DP_GroupSort`` used to inherit) is
``@tf.function``-decorated ``reshape (..., C/2, 2) -> split -> minimum/maximum -> concat
-> reshape``. On channels-last tensors the split/concat on an innermost axis of size 2
are strided copies, and the autodiff gradients of ``minimum``/``maximum`` add
comparisons, selects and zero tensors: about ten memory passes over the activation per
step, against two for ReLU; ``benchmarks/step_speed.py`` showed this activation was most
of lipdp's step time on the CNN. Candidates measured here, all computing the same
function (pairs of adjacent channels sorted):

* ``relu``: reference cost of the cheapest activation;
* ``deel-lip``: ``deel.lip.layers.GroupSort(2)``;
* ``lipdp sort_pairs``: :func:`lipdp.clipless.layers.activations.sort_pairs` (what
  ``DP_GroupSort(2)`` now runs): ``s = swap(x)``, ``y = where(t, s, x)`` with a
  custom gradient ``where(t, swap(g), g)``; ``y`` is an exact permutation of ``x`` and
  the gradient the same permutation of ``g``, so outputs and gradients are bit-identical
  to deel-lip's except at ties, where deel-lip's gradient is not a permutation;
* ``lipdp sort_pairs, XLA (one function)``: the same under
  ``tf.function(jit_compile=True)`` (what ``DP_GroupSort(2)`` ran on large activations
  before issue 39);
* ``lipdp sort_pairs_xla``: :func:`lipdp.clipless.layers.activations.sort_pairs_xla`
  (since issue 39): the forward and the backward as two XLA functions with the custom
  gradient between them in the graph; from 64 channels on the ``(-1, 2)`` pair view.

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
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA's CPU kernels on one thread too, as in cross_library_speed.py (set before TF starts).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)
# This checkout's lipdp, not an installed one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py: the timing loop)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    import deel.lip.layers

    from lipdp.clipless.layers.activations import sort_pairs, sort_pairs_xla

    shapes = [(256, 28, 28, 32), (256, 14, 14, 64), (1024, 28, 28, 32), (4096, 64)]
    print(f"TF {tf.__version__}, {os.cpu_count()} cores, TF threads: {args.threads}\n")
    print(
        "| shape | implementation | CPU ms fwd+bwd | ratio to deel-lip | max diff y | max diff g |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in shapes:
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=shape).astype("float32"))
        w = tf.constant(rng.normal(size=shape).astype("float32"))
        upstream = deel.lip.layers.GroupSort(2)
        upstream.build(shape)
        candidates = {
            "relu": tf.nn.relu,
            "deel-lip": upstream,
            "lipdp sort_pairs": sort_pairs,
            "lipdp sort_pairs, XLA (one function)": tf.function(sort_pairs, jit_compile=True),
            "lipdp sort_pairs_xla": sort_pairs_xla,
        }
        results = common.time_forward_backward(candidates, x, w, args.rounds, "deel-lip")
        ref = results["deel-lip"][0]
        for name, (t, dy, dg) in results.items():
            diffs = "- | -" if name == "relu" else f"{dy:.1g} | {dg:.1g}"
            print(f"| {shape} | {name} | {1e3 * t:.3g} | {t / ref:.2f} | {diffs} |", flush=True)


if __name__ == "__main__":
    main()
