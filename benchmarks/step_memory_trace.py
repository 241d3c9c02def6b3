"""Resident memory after every step of one worker of ``large_batches.py``, in one process.

    .venv/bin/python benchmarks/step_memory_trace.py lipdp-clipped-tf --batch 8192 \
        --physical 512 [--no-probe] [--epochs 3]
    .venv/bin/python benchmarks/step_memory_trace.py keras-tf --batch 512
    .venv/bin/python benchmarks/step_memory_trace.py lipdp-clipped-tf --tensors

``--tensors``: TensorFlow's CPU allocator is its BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC``),
whose counters give the bytes of tensors alive after each step and their peak during it
(``tf.config.experimental.get_memory_info``): what TensorFlow itself holds, without
glibc's heap and its run-to-run spread of ~30 MB in ``VmRSS``. How the zeros folded into
a batch-sized constant by TensorFlow's graph optimiser were found (benchmarks/README.md,
"The target cell: the constant that grew with the batch").

Results and their reading: benchmarks/README.md, section "The target cell: where the
memory goes".

``large_batches.py`` reports one peak per worker; this script prints the resident memory
(``VmRSS``) and its peak (``VmHWM``) before the model, after it is built and after every
logical step, so that the first step (the batch-independence probe, the trace) and the
steady step can be told apart, and cells of the same ``P`` and different ``b`` compared.
Same network, data, environment (1 thread) and builders as ``cross_library_speed.py``'s
workers. lipdp contenders train ``--epochs`` epochs on one logical batch of ``--batch``
rows computed ``--physical`` rows at a time (``--physical 0``: the whole batch at once);
``keras-tf`` trains one epoch in batches of ``--physical`` rows over the same rows.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def memory_mb() -> dict:
    """``{"VmRSS": MB, "VmHWM": MB}`` of this process (Linux ``/proc``)."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(line.split()[1]) // 1024
    return values


def readings(tensors: bool) -> dict:
    """:func:`memory_mb`, and with ``tensors`` TensorFlow's tensor bytes now and their
    peak since the last reading (the BFC allocator's counters, reset here), MB."""
    values = memory_mb()
    if tensors:
        import tensorflow as tf

        info = tf.config.experimental.get_memory_info("CPU:0")
        tf.config.experimental.reset_memory_stats("CPU:0")
        values.update({"tensors": info["current"] >> 20, "tensors peak": info["peak"] >> 20})
    return values


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("contender", help="a worker of cross_library_speed.py, e.g. keras-tf")
    parser.add_argument("--batch", type=int, default=8192, help="logical batch b (rows)")
    parser.add_argument("--physical", type=int, default=512, help="P (0: the whole batch)")
    parser.add_argument("--no-probe", action="store_true", help="independence_probe=False")
    parser.add_argument("--epochs", type=int, default=3, help="logical steps (lipdp)")
    parser.add_argument(
        "--tensors", action="store_true", help="also TensorFlow's tensor bytes (BFC allocator)"
    )
    return parser.parse_args()


def main():
    args = _parse()
    sys.path.insert(0, str(HERE))
    import cross_library_speed as workers

    os.environ.update(workers._environment("tensorflow"))  # noqa: SLF001 - same worker set-up
    if args.tensors:  # read when TensorFlow starts: set before it is imported
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import keras

    workers._keras_setup("tensorflow")  # noqa: SLF001
    physical = args.physical or None
    x, y = workers._data(args.batch)  # noqa: SLF001
    print("before the model", memory_mb(), flush=True)
    model = workers._keras_model(  # noqa: SLF001
        args.contender, args.batch, args.batch, args.epochs, physical, not args.no_probe
    )
    print("model built", readings(args.tensors), flush=True)

    class Trace(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            float((logs or {}).get("loss", 0.0))  # the step has finished
            print("after step", step, readings(args.tensors), flush=True)

    lipdp = args.contender.startswith("lipdp")
    model.fit(
        x,
        y,
        batch_size=args.batch if lipdp else (physical or args.batch),
        epochs=args.epochs if lipdp else 1,
        verbose=0,
        callbacks=[Trace()],
    )
    print("end", memory_mb(), flush=True)


if __name__ == "__main__":
    main()
