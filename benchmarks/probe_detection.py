"""Detection rate of the batch-independence probe on the couplings of issue 37 (item 4).

    PYTHONPATH=. .venv/bin/python benchmarks/probe_detection.py [--seeds 20] [--ratios]

For each construction of ``tests/couplings.py`` (a coupling that real data switches on and
a small probe batch may not: gated on large activations, on non-negative inputs, on the
batch size, a gated running mean kept in a variable, a gated sort over the batch, an
ungated loss times the batch's largest logit), builds the model at ``--seeds`` weight
initialisations (seeds 0, 1, ...) and runs the probe
(:func:`lipdp.core.batch_independence.probe`) on the model's input spec; prints how many
initialisations it refused, and the probe's mean time per model. With ``--ratios``, also
the remove-one ratio of one real step with the probe off (``tests/remove_one.py``: the
largest over the rows of the construction's batch of real data, median and range over the
seeds): above 1, the coupling leaks.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from lipdp.core import batch_independence  # noqa: E402
from tests.couplings import CONSTRUCTIONS  # noqa: E402
from tests.remove_one import remove_one_ratios  # noqa: E402


def refused(case) -> tuple[bool, float]:
    x_spec = tf.TensorSpec((None, *case.x.shape[1:]), tf.as_dtype(case.x.dtype))
    y_spec = tf.TensorSpec((None,), tf.as_dtype(case.y.dtype))
    start = time.perf_counter()
    try:
        batch_independence.probe(case.model, x_spec, y_spec)
    except ValueError:
        return True, time.perf_counter() - start
    return False, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--ratios", action="store_true", help="also remove-one ratios, probe off")
    args = parser.parse_args()
    header = "| construction | refused | probe seconds (mean) |"
    rule = "| --- | --- | --- |"
    if args.ratios:
        header += " remove-one ratio, probe off (median [min, max]) |"
        rule += " --- |"
    print(header)
    print(rule)
    for name, build in CONSTRUCTIONS.items():
        hits, seconds, ratios = 0, [], []
        for seed in range(args.seeds):
            hit, spent = refused(build(seed, debug=True))
            hits += hit
            seconds.append(spent)
            if args.ratios:
                case = build(seed, debug=True, independence_probe=False)
                ratios.append(float(np.max(remove_one_ratios(case.model, case.x, case.y))))
        row = f"| {name} | {hits}/{args.seeds} | {np.mean(seconds):.2f} |"
        if args.ratios:
            row += f" {np.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
