"""L2-norm pooling on TensorFlow: forward + backward cost of its two paths (issue 39).

    .venv/bin/python benchmarks/l2_pool_speed.py [--rounds 11] [--threads 1]

``DP_ScaledL2NormPooling2D`` computes ``y = sqrt(s + eps) - sqrt(eps)`` with ``s`` the sum
of squares of each window. Candidates, on the activation shapes of the benchmark CNN
(28x28x32 and 14x14x64, batches 256 and 1024; 2x2 windows):

* ``average pooling``: Keras' ``AveragePooling2D`` (what the plain CNN uses): the floor;
* ``generic``: the layer's backend-neutral path (square, average pooling times the window
  area, root; autodiff gradient: square, average pooling, multiply, add, root, subtract
  forward, then five passes backward), which TensorFlow ran before issue 39 and still
  runs for partial windows;
* ``fused``: :func:`lipdp.clipless.layers.pooling.l2_norm_pool_xla` (TensorFlow, whole
  windows): one XLA kernel forward (window sums of squares by one reduction, the root),
  one backward (``dx = x g / r``), the custom gradient between them in the graph.

Each candidate is timed (CPU seconds of the process; TF and XLA on ``--threads``
threads) on forward + backward of ``sum(y * w)`` for a fixed random ``w``, round-robin over
``--rounds`` rounds; the table gives medians and the ratio to the generic path, and the
largest differences of outputs and input gradients from the generic path.
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


def _candidates(shape):
    from lipdp.clipless.layers import DP_ScaledL2NormPooling2D
    from lipdp.clipless.layers.fused import fused_kernels

    generic = DP_ScaledL2NormPooling2D(2)
    generic._fused = lambda shape: False  # the instance only: the backend-neutral path
    fused = DP_ScaledL2NormPooling2D(2)
    for layer in (generic, fused):
        layer.build(shape)
    if not fused._fused(shape):
        raise AssertionError(f"{shape}: the fused path does not apply")

    def fused_call(x):
        # The fused kernels run only inside the clipless training step
        # (lipdp.clipless.layers.fused): allowed here while the step is traced.
        with fused_kernels():
            return fused(x)

    return {
        "average pooling": tf.keras.layers.AveragePooling2D(2),
        "generic": generic,
        "fused": fused_call,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    shapes = [(256, 28, 28, 32), (256, 14, 14, 64), (1024, 28, 28, 32), (1024, 14, 14, 64)]
    print(f"TF {tf.__version__}, {os.cpu_count()} cores, TF threads: {args.threads}\n")
    print("| shape | path | CPU ms fwd+bwd | ratio to generic | max diff y | max diff g |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in shapes:
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=shape).astype("float32"))
        pooled = (shape[0], shape[1] // 2, shape[2] // 2, shape[3])
        w = tf.constant(rng.normal(size=pooled).astype("float32"))
        results = common.time_forward_backward(_candidates(shape), x, w, args.rounds, "generic")
        ref = results["generic"][0]
        for name, (t, dy, dg) in results.items():
            diffs = "- | -" if name == "average pooling" else f"{dy:.1g} | {dg:.1g}"
            print(f"| {shape} | {name} | {1e3 * t:.3g} | {t / ref:.2f} | {diffs} |", flush=True)


if __name__ == "__main__":
    main()
