"""Where the time of lipdp's private step goes on TensorFlow (issue 39): CPU time per step of
the clipped step with one component removed at a time, and of the stages of the
per-example engine, side by side with the plain Keras step, in one process.

    KERAS_BACKEND=tensorflow .venv/bin/python benchmarks/step_profile.py \
        [--batch-sizes 256 1024] [--rounds 3] [--steps 6] [--warmup 2] [--json out.json]

Results and their reading: benchmarks/README.md, section "Where the private step's time
goes".

**The network and the step** are those of ``cross_library_speed.py`` (the unconstrained
50 080-parameter CNN, softmax cross-entropy, SGD(0.01); the clipped contender is
``lipdp.make_private(..., method="clipped", gradient_method="ghost")`` at sigma = 1, clip
norm 1, flat clipping, fixed batches). The Clipless step is ``lipdp-clipless-tf`` of that
script (the Lipschitz CNN, global noise).

**Part 1, the step without one component** (``fit``, one epoch of ``warmup + steps``
batches; a callback reads a weight after every step, which waits for the step, and
marks the process' CPU time; the ``warmup`` first steps are dropped, a cell is the median
of the other steps, then the median over rounds):

* ``keras``: plain Keras 3 (the floor); ``clipped``: the private step as shipped;
* ``clipped -noise``: no Gaussian draw (``noisify`` returns the gradients);
* ``clipped -S9``: no scan for non-finite rows, ids or labels out of range (rule S9);
* ``clipped -logs``: no loss tracker, no metrics, no S9 counters in the logs;
* ``clipped -ledger``: the step counter only (no ledger row, no projection hook);
* ``clipped -engine``: the per-example engine replaced by the plain gradient of the mean
  loss (what the shared step costs around a plain gradient);
* ``clipped xla`` (only when named in ``--variants``: it compiles for a long time):
  ``compile(jit_compile=True)``;
* ``clipless`` and ``clipless -noise``/``-S9``/``-logs``: the same for the Clipless step.

A removed component is removed for measurement only: none of these variants is private.

**Part 2, the stages of the clipped gradient** (``tf.function`` on one fixed batch, the
median of ``steps`` calls after ``warmup``; each stage includes the previous ones):
forward and loss; the plain gradient (forward + backward to the variables); the
recorded forward and the backward pass to the layers' outputs; the per-example squared
norms; the clipped sums (the engine's whole output). And three pieces of the norms alone:
the input patches of each Conv2D, the per-row kernel gradients (``einsum``), their float64
squared norms.

Every worker thread count is 1 (TensorFlow intra/inter-op, OMP, MKL), as in
``cross_library_speed.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import cross_library_speed as cls  # noqa: E402  (the same models)

VARIANTS = [
    "keras",
    "clipped",
    "clipped -noise",
    "clipped -S9",
    "clipped -logs",
    "clipped -ledger",
    "clipped -engine",
    "clipped xla",
    "clipless",
    "clipless -noise",
    "clipless -S9",
    "clipless -logs",
]
#: The default: every variant but XLA, which compiles for minutes on this CNN.
STEP_VARIANTS = [v for v in VARIANTS if not v.endswith("xla")]


def _setup():
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)


def _ablate(model, removed):
    """Remove one component of ``model``'s private step (before it is traced)."""
    import tensorflow as tf

    from lipdp.core.private_model import StepGradients

    def patch(name, fn):
        object.__setattr__(model, name, fn)

    if removed == "noise":
        patch("noisify", lambda gradients, variables: list(gradients))
    elif removed == "S9":

        def everything(x, y):
            rows = tf.shape(tf.nest.flatten(x)[0])[0]
            return x, y, tf.ones([rows], tf.bool), None

        patch("_neutralised_batch", everything)
        patch("class_labels_in_range", lambda y, p: tf.ones([tf.shape(p)[0]], tf.bool))
    elif removed == "logs":
        patch("_track_loss", lambda *args: None)
        patch("compute_metrics", lambda *args, **kwargs: {"none": tf.zeros([])})
        patch("_count_neutralised", lambda *args, **kwargs: {})
    elif removed == "ledger":
        patch("_count_and_project", lambda: model.noisy_steps.assign_add(1))
    elif removed == "engine":

        def plain(x, y, kept):
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                loss = tf.reduce_mean(model.per_example_losses(y, y_pred))
            return StepGradients(tape.gradient(loss, model.trainable_variables), y_pred, x)

        patch("_private_gradients", plain)
    elif removed is not None:
        raise ValueError(f"unknown component {removed!r}")


def _step_model(variant, batch, n):
    import keras

    family, _, change = variant.partition(" ")
    if family == "keras":
        return cls._keras_compile(keras.Sequential(cls._keras_layers()))
    model = cls._lipdp_clipped(batch, n) if family == "clipped" else cls._lipdp_clipless(batch, n)
    # The batch-independence probe runs once, when the step is traced: not in a step's
    # time, and skipped here to shorten the run (rule S2 is not what is measured).
    model.independence_probe = False
    if change == "xla":
        model.compile(loss=model.loss, optimizer=model.optimizer, jit_compile=True)
    elif change:
        _ablate(model, change.removeprefix("-"))
    return model


def step_times(variant, batch, warmup, steps):
    """CPU seconds of each step of ``fit`` after ``warmup`` (median)."""
    import keras

    x, y = cls._data(batch * (warmup + steps))
    model = _step_model(variant, batch, len(x))
    marks = []
    probe = model.trainable_variables[-1]

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if not marks:
                marks.append(time.process_time())

        def on_train_batch_end(self, step, logs=None):
            probe.numpy()  # waits for the update
            marks.append(time.process_time())

    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[Timer()])
    per_step = [b - a for a, b in zip(marks, marks[1:])]
    return statistics.median(per_step[warmup:])


# ------------------------------------------------------------------------ part 2
def stage_functions(batch):
    """``{stage: tf.function of (x, y)}`` for the clipped model of the benchmark."""
    import tensorflow as tf

    from lipdp.clipped.per_example import engine
    from lipdp.clipped.per_example.convolution import patches
    from lipdp.clipped.per_example.scale import square_sums

    model = cls._lipdp_clipped(batch, batch * 10)
    variables = model.trainable_variables

    def losses_of(y):
        return lambda y_pred: model.per_example_losses(y, y_pred)

    def forward(x, y):
        return tf.reduce_sum(model.per_example_losses(y, model(x, training=True)))

    def plain(x, y):
        with tf.GradientTape() as tape:
            loss = forward(x, y)
        return tape.gradient(loss, variables)

    def to_outputs(x, y):
        records = []
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(losses_of(y)(engine._recorded_forward(model, x, records)))
        return tape.gradient(total, [r.outputs for r in records])

    def norms(x, y):
        return engine.per_example_gradients(model, x, losses_of(y)).sq_norms

    def clipped(x, y):
        rows = tf.shape(x)[0]
        return model._clipped_sum_at(x, y, tf.ones([rows], tf.bool))[0]

    convs = [layer for layer in model.dp_layers if type(layer).__name__ == "Conv2D"]

    def conv_inputs(x):
        records = []
        engine._recorded_forward(model, x, records)
        return [r.inputs for r in records if r.layer in convs], [r.outputs for r in records]

    def only_patches(x, y):
        inputs, _ = conv_inputs(x)
        return [patches(layer, a) for layer, a in zip(convs, inputs)]

    def only_rows(x, y):
        inputs, outputs = conv_inputs(x)
        result = []  # the outputs stand in for their cotangents (same shapes)
        for layer, a, z in zip(convs, inputs, outputs[: len(convs)]):
            p = patches(layer, a)
            g = tf.reshape(z, [tf.shape(z)[0], -1, layer.filters])
            result.append(tf.einsum("btd,btp->bdp", p, g))
        return result

    def only_squares(x, y):
        return square_sums(only_rows(x, y))

    functions = {
        "forward + loss": forward,
        "plain gradient": plain,
        "recorded forward + backward to outputs": to_outputs,
        "+ per-example squared norms": norms,
        "+ clipped sums (the engine)": clipped,
        "conv patches": only_patches,
        "conv patches + per-row einsum": only_rows,
        "conv patches + einsum + float64 squares": only_squares,
    }
    return {name: tf.function(fn) for name, fn in functions.items()}


def stage_times(batch, warmup, steps):
    import tensorflow as tf

    x, y = cls._data(batch)
    x, y = tf.constant(x), tf.constant(y)
    result = {}
    for name, fn in stage_functions(batch).items():
        times = []
        for _ in range(warmup + steps):
            start = time.process_time()
            tf.nest.map_structure(lambda t: t.numpy(), fn(x, y))
            times.append(time.process_time() - start)
        result[name] = statistics.median(times[warmup:])
    return result


# ------------------------------------------------------------------------ main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=STEP_VARIANTS)
    parser.add_argument("--skip-stages", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    _setup()
    import tensorflow as tf

    print(f"TF {tf.__version__}, 1 thread, load {os.getloadavg()[0]:.2f}", flush=True)
    steps = {b: {v: [] for v in args.variants} for b in args.batch_sizes}
    stages = {b: [] for b in args.batch_sizes}
    for r in range(args.rounds):
        for b in args.batch_sizes:
            order = (
                args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
            )
            for variant in order:
                steps[b][variant].append(step_times(variant, b, args.warmup, args.steps))
                print(
                    f"round {r} b={b} {variant}: {steps[b][variant][-1] * 1e3:.1f} ms", flush=True
                )
            if not args.skip_stages:
                stages[b].append(stage_times(b, args.warmup, args.steps))
    table = {}
    for b in args.batch_sizes:
        rows = {v: statistics.median(t) * 1e3 for v, t in steps[b].items()}
        if stages[b]:
            for name in stages[b][0]:
                rows[f"stage: {name}"] = statistics.median(s[name] for s in stages[b]) * 1e3
        table[b] = rows
    print(f"\nCPU ms per step (median of {args.rounds} rounds), load {os.getloadavg()[0]:.2f}")
    print("| component | " + " | ".join(f"b = {b}" for b in args.batch_sizes) + " |")
    print("| --- |" + " --- |" * len(args.batch_sizes))
    for name in table[args.batch_sizes[0]]:
        cells = " | ".join(f"{table[b][name]:.1f}" for b in args.batch_sizes)
        print(f"| {name} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps({"table": table, "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
