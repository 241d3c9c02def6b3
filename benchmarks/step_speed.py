"""Speed and memory of one training step: lipdp vs plain Keras vs tensorflow-privacy.

    .venv/bin/python benchmarks/step_speed.py [--archs cnn dense] [--batches 64 256 1024 4096]
        [--mode isolated paired] [--cap 150] [--mem-cap-gb 8] [--repeats 7] [--rounds 15]
        [--contenders ...] [--variants ...] [--json out.json] [--plot out.png]
    .venv/bin/python benchmarks/step_speed.py --from-json out.json [--plot out.png]

Results and their reading: benchmarks/README.md.

Runs on either stack: Keras 2 (``.venv-keras2``: TF 2.15, tensorflow-privacy) or Keras 3
(``.venv``: no tensorflow-privacy, so the ``tfp-*`` contenders fail there);
``keras_stacks_speed.py`` runs the workers of both side by side.

Two architectures, the same for every contender:

* ``cnn`` (28x28x1 inputs, 10 classes; the getting-started Lipschitz CNN):
  DP_BoundedInput -> DP_QuickSpectralConv2D(32, 3) -> DP_GroupSort(2) ->
  DP_ScaledL2NormPooling2D(2) -> DP_QuickSpectralConv2D(64, 3) -> DP_GroupSort(2) ->
  DP_ScaledL2NormPooling2D(2) -> DP_Flatten -> DP_QuickSpectralDense(10)
  (50 080 parameters);
* ``dense`` (tabular, 9 features, 2 classes): DP_BoundedInput -> DP_QuickSpectralDense(64)
  -> DP_GroupSort(2) -> DP_QuickSpectralDense(64) -> DP_GroupSort(2) ->
  DP_QuickSpectralDense(2) (4 800 parameters).

Plain SGD (learning rate 0.01) everywhere and no biases anywhere, so that every
contender trains exactly the same parameters.

``--mode isolated`` (step time, throughput and peak memory; one subprocess per
architecture x batch size x contender):

* ``lipdp-global`` / ``lipdp-per-layer``: Clipless DP-SGD (DP_Sequential, sigma = 1);
* ``lipdp-no-noise``: the same constrained network with
  ``DPParameters(..., non_private=True, noise_multiplier=0)``: projections still run,
  no noise;
* ``keras``: plain Keras training of the unconstrained equivalent (Conv2D/Dense + ReLU,
  AveragePooling2D, same shapes): the floor;
* ``tfp-dpkeras``: tensorflow-privacy ``DPKerasSGDOptimizer`` (per-example clipping,
  num_microbatches = batch size) on the unconstrained network;
* ``tfp-vectorized``: ``VectorizedDPKerasSGDOptimizer``, same;
* ``tfp-dpsequential``: ``tensorflow_privacy.DPSequential`` with the default layer
  registry and ``use_xla=True``. The dense network gets the fast ("ghost") clipping;
  Conv2D is not in tensorflow-privacy 0.9.0's registry, so for the CNN it falls back to
  per-example gradients by ``tf.vectorized_map`` (XLA-compiled).
* ``dpsgd-ghost`` / ``dpsgd-jacobian``: lipdp's clipped DP-SGD
  (``lipdp.clipped.model.DPSGD_Sequential``, flat clipping, sigma = 1) on the unconstrained
  network, per-example norms by ghost norms (book-keeping) / by the full Jacobian.

The isolated worker (TF threads: ``--threads``, default TF's own) builds the model,
makes Keras' ``train_function`` (what ``fit`` runs every step, under ``tf.function``)
over an in-memory ``tf.data`` pipeline of synthetic data (two distinct batches,
cycled), runs 3 warm-up steps (the first traces/compiles), then
``--repeats`` repeats of ``K`` steps (``K`` so that a repeat lasts about 0.4 s); the step
time is the median over repeats of the mean step time of a repeat. Peak memory is
``ru_maxrss`` of the worker at the end; a ``baseline`` worker imports the same modules and
builds the same data and iterator, and its peak is subtracted. The parent kills a worker
that runs longer than ``--cap`` seconds (whole subprocess: import, build, compile,
timing) or whose resident memory exceeds ``--mem-cap-gb``, and reports it as such.
Ratios are to the ``keras`` floor at the same batch size.

``--mode paired`` (where lipdp's time goes; one subprocess per architecture x batch
size holding all the variants below, timed round-robin — ``--rounds`` rounds, the
order rotated every round — so that the load of the shared machine hits all variants
alike; a ratio is the median over rounds of the per-round ratio):

* ``keras``: the floor, as above;
* ``keras-groupsort`` / ``keras-l2pool`` (CNN only): the floor with lipdp's
  DP_GroupSort(2) instead of ReLU / DP_ScaledL2NormPooling2D instead of average pooling;
* ``lipdp-layers-keras``: the DP layers in a plain ``tf.keras.Sequential`` (standard Keras
  train step: no bounds, no noise, no projection): the cost of the architecture
  (input clipping, GroupSort, L2-norm pooling, tau-cross-entropy);
* ``lipdp-bare``: DP_Sequential, no noise (non_private) and ``project`` replaced by a
  no-op on the instance: what remains of lipdp's train step (the bounds, computed at
  trace time into constants, and the batch-size assertion);
* ``lipdp-no-project``: global noise, no projection;
* ``lipdp-no-noise``, ``lipdp-global``, ``lipdp-per-layer``: as above;
* GroupSort implementations, each on lipdp-global: ``lipdp-deel-gs`` (deel-lip's
  ``GroupSort.call``, what lipdp used before the fused pair sort of
  ``lipdp.clipless.layers.activations.sort_pairs``); ``lipdp-no-xla-gs`` (the pair sort with
  ``jit_compile=False``);
* candidate optimisations, each on lipdp-global: ``lipdp-power1`` (1 power iteration
  per projection instead of 8); ``lipdp-xla-project`` (``project`` wrapped in
  ``tf.function(jit_compile=True)``);
* optional (``--variants``): ``lipdp-jit`` (``model.compile(jit_compile=True)``),
  ``keras-jit``.

The paired workers run TensorFlow on ``--paired-threads`` threads (default 1) and time
CPU seconds of the process (``time.process_time``) as well as wall time: CPU time does
not count the time spent waiting for a core, so on a loaded shared machine it is the
stabler measure of the work a step costs.
Each lipdp variant also times ``model.project()`` alone (under ``tf.function``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONTENDERS = [
    "lipdp-global",
    "lipdp-per-layer",
    "lipdp-no-noise",
    "keras",
    "tfp-dpkeras",
    "tfp-vectorized",
    "tfp-dpsequential",
    "dpsgd-ghost",
    "dpsgd-jacobian",
]
PAIRED_VARIANTS = [
    "keras",
    "keras-groupsort",
    "keras-l2pool",
    "lipdp-layers-keras",
    "lipdp-bare",
    "lipdp-no-project",
    "lipdp-no-noise",
    "lipdp-global",
    "lipdp-per-layer",
    "lipdp-deel-gs",
    "lipdp-no-xla-gs",
    "lipdp-power1",
    "lipdp-xla-project",
]
#: Also accepted by --variants (slow: XLA-compiled whole steps).
OPTIONAL_VARIANTS = ["lipdp-jit", "keras-jit"]
ARCHS = ("cnn", "dense")
LEARNING_RATE = 0.01
SIGMA = 1.0
CLIP = 1.0
TARGET_REPEAT_SECONDS = 0.4
MAX_STEPS_PER_REPEAT = 200


# --------------------------------------------------------------------------- models
def _shape(arch):
    return ((28, 28, 1), 10) if arch == "cnn" else ((9,), 2)


def _data(arch, batch):
    import numpy as np

    shape, classes = _shape(arch)
    rng = np.random.default_rng(0)
    n = 2 * batch  # two distinct batches, cycled
    x = rng.uniform(0.0, 1.0, size=(n, *shape)).astype("float32")
    y = np.eye(classes, dtype="float32")[rng.integers(0, classes, size=n)]
    return x, y


def _upstream_groupsort_class():
    """DP_GroupSort computed by deel-lip's ``GroupSort.call`` (lipdp before the fused
    pair sort: ``@tf.function``, reshape/split/minimum/maximum/concat, autodiff
    gradient); same outputs, slower, and its gradient at ties is not a permutation
    (``tests/clipless/test_deel_lip_findings.py``)."""
    import deel.lip.layers

    from lipdp.clipless import layers

    class UpstreamGroupSort(layers.DP_GroupSort):
        def call(self, x):
            return deel.lip.layers.GroupSort.call(self, x)

    return UpstreamGroupSort


def _lipdp_layers(arch, power_iterations=None, groupsort="lipdp"):
    """``groupsort``: ``"lipdp"`` (shipped), ``"no-xla"`` (shipped, XLA off) or
    ``"deel-lip"`` (deel-lip's ``call``)."""
    import functools

    from lipdp.clipless import layers

    kw = {} if power_iterations is None else {"power_iterations": power_iterations}
    gs = {
        "lipdp": lambda: layers.DP_GroupSort,
        "no-xla": lambda: functools.partial(layers.DP_GroupSort, jit_compile=False),
        "deel-lip": _upstream_groupsort_class,  # imported only when asked for
    }[groupsort]()
    if arch == "cnn":
        return [
            layers.DP_BoundedInput(input_shape=(28, 28, 1), upper_bound=10.0),
            layers.DP_QuickSpectralConv2D(32, 3, **kw),
            gs(2),
            layers.DP_ScaledL2NormPooling2D(2),
            layers.DP_QuickSpectralConv2D(64, 3, **kw),
            gs(2),
            layers.DP_ScaledL2NormPooling2D(2),
            layers.DP_Flatten(),
            layers.DP_QuickSpectralDense(10, **kw),
        ]
    return [
        layers.DP_BoundedInput(input_shape=(9,), upper_bound=3.0),
        layers.DP_QuickSpectralDense(64, **kw),
        gs(2),
        layers.DP_QuickSpectralDense(64, **kw),
        gs(2),
        layers.DP_QuickSpectralDense(2, **kw),
    ]


def _keras_layers(arch, activation="relu", pooling="average"):
    """The unconstrained network; ``activation="groupsort"`` / ``pooling="l2"`` swap in
    lipdp's DP_GroupSort(2) / DP_ScaledL2NormPooling2D (ablations of the paired mode)."""
    import tensorflow as tf

    from lipdp.clipless import layers

    L = tf.keras.layers

    def act():
        return layers.DP_GroupSort(2) if activation == "groupsort" else L.ReLU()

    def pool():
        return layers.DP_ScaledL2NormPooling2D(2) if pooling == "l2" else L.AveragePooling2D(2)

    if arch == "cnn":
        return [
            L.Conv2D(32, 3, padding="same", use_bias=False, input_shape=(28, 28, 1)),
            act(),
            pool(),
            L.Conv2D(64, 3, padding="same", use_bias=False),
            act(),
            pool(),
            L.Flatten(),
            L.Dense(10, use_bias=False),
        ]
    return [
        L.Dense(64, use_bias=False, input_shape=(9,)),
        act(),
        L.Dense(64, use_bias=False),
        act(),
        L.Dense(2, use_bias=False),
    ]


def _build_lipdp(arch, variant, batch):
    import tensorflow as tf

    from lipdp.clipless import losses
    from lipdp.clipless.model import DP_Sequential, DPParameters
    from lipdp.pipeline import DatasetMetadata

    shape, classes = _shape(arch)
    metadata = DatasetMetadata(
        input_shape=shape, nb_classes=classes, nb_samples_train=100 * batch, batch_size=batch
    )
    if variant in ("lipdp-no-noise", "lipdp-bare"):
        params = DPParameters("global", 0.0, 1e-5, non_private=True)
    elif variant == "lipdp-per-layer":
        params = DPParameters("per-layer", SIGMA, 1e-5)
    else:
        params = DPParameters("global", SIGMA, 1e-5)
    groupsort = {"lipdp-deel-gs": "deel-lip", "lipdp-no-xla-gs": "no-xla"}.get(variant, "lipdp")
    model = DP_Sequential(
        _lipdp_layers(
            arch,
            power_iterations=1 if variant == "lipdp-power1" else None,
            groupsort=groupsort,
        ),
        dp_parameters=params,
        dataset_metadata=metadata,
    )
    # Instance-level patches: other models in the same process are unaffected.
    original_project = model.project
    if variant in ("lipdp-no-project", "lipdp-bare"):
        model.project = lambda: None
    if variant == "lipdp-xla-project":
        model.project = tf.function(original_project, jit_compile=True)
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=8.0),
        optimizer=tf.keras.optimizers.SGD(LEARNING_RATE),
        jit_compile=variant == "lipdp-jit",
    )
    model.timed_project = original_project if variant != "lipdp-xla-project" else model.project
    return model


def _build_dpsgd(arch, method, batch):
    import tensorflow as tf

    from lipdp.clipless.model import DPParameters
    from lipdp.clipped.model import Clipping, DPSGD_Sequential
    from lipdp.pipeline import DatasetMetadata

    shape, classes = _shape(arch)
    metadata = DatasetMetadata(
        input_shape=shape, nb_classes=classes, nb_samples_train=100 * batch, batch_size=batch
    )
    model = DPSGD_Sequential(
        _keras_layers(arch),
        dp_parameters=DPParameters("global", SIGMA, 1e-5),
        clipping=Clipping("flat", CLIP),
        dataset_metadata=metadata,
        gradient_method=method,
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(LEARNING_RATE),
    )
    return model


def _build(arch, contender, batch):
    """The compiled model of a contender or variant."""
    import tensorflow as tf

    from lipdp.clipless import losses

    if contender.startswith("lipdp") and contender != "lipdp-layers-keras":
        return _build_lipdp(arch, contender, batch)
    if contender == "lipdp-layers-keras":
        model = tf.keras.Sequential(_lipdp_layers(arch))
        model.compile(
            loss=losses.DP_TauCategoricalCrossentropy(tau=8.0),
            optimizer=tf.keras.optimizers.SGD(LEARNING_RATE),
        )
        return model
    if contender in ("keras", "keras-jit", "keras-groupsort", "keras-l2pool"):
        model = tf.keras.Sequential(
            _keras_layers(
                arch,
                activation="groupsort" if contender == "keras-groupsort" else "relu",
                pooling="l2" if contender == "keras-l2pool" else "average",
            )
        )
        model.compile(
            loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
            optimizer=tf.keras.optimizers.SGD(LEARNING_RATE),
            jit_compile=contender == "keras-jit",
        )
        return model
    if contender.startswith("dpsgd-"):
        return _build_dpsgd(arch, contender.removeprefix("dpsgd-"), batch)
    import tensorflow_privacy as tfp

    if contender in ("tfp-dpkeras", "tfp-vectorized"):
        cls = tfp.DPKerasSGDOptimizer if contender == "tfp-dpkeras" else (
            tfp.VectorizedDPKerasSGDOptimizer
        )  # fmt: skip
        model = tf.keras.Sequential(_keras_layers(arch))
        model.compile(
            # tensorflow-privacy's optimizers need the vector of per-example losses.
            loss=tf.keras.losses.CategoricalCrossentropy(
                from_logits=True, reduction=tf.keras.losses.Reduction.NONE
            ),
            optimizer=cls(
                l2_norm_clip=CLIP,
                noise_multiplier=SIGMA,
                num_microbatches=batch,
                learning_rate=LEARNING_RATE,
            ),
        )
        return model
    if contender == "tfp-dpsequential":
        from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry

        model = tfp.DPSequential(
            l2_norm_clip=CLIP,
            noise_multiplier=SIGMA,
            use_xla=True,
            layer_registry=layer_registry.make_default_layer_registry(),
            layers=_keras_layers(arch),
        )
        model.compile(
            loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
            optimizer=tf.keras.optimizers.SGD(LEARNING_RATE),
        )
        model.fast_clipping = bool(model._enable_fast_peg_computation)
        return model
    raise ValueError(f"unknown contender {contender!r}")


# --------------------------------------------------------------------------- workers
def _sync(logs):
    for value in logs.values() if isinstance(logs, dict) else [logs]:
        if hasattr(value, "numpy"):
            value.numpy()


def _iterator(arch, batch):
    import tensorflow as tf

    x, y = _data(arch, batch)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
    iterator = iter(ds)
    next(iterator)
    return iterator


def _train_function(model):
    """What ``fit`` calls every step. Keras 2's ``make_train_function`` returns it; Keras
    3's only sets ``model.train_function`` (and returns None on the first call)."""
    model.make_train_function()
    return model.train_function


def _warm_up(train_function, iterator):
    """3 steps; returns (first step seconds, steps per ~TARGET_REPEAT_SECONDS repeat)."""
    t0 = time.perf_counter()
    _sync(train_function(iterator))
    first = time.perf_counter() - t0
    warm = []
    for _ in range(2):
        t0 = time.perf_counter()
        _sync(train_function(iterator))
        warm.append(time.perf_counter() - t0)
    steps = math.ceil(TARGET_REPEAT_SECONDS / min(warm))
    return first, int(max(1, min(MAX_STEPS_PER_REPEAT, steps)))


def _time_steps(train_function, iterator, steps):
    """Mean (wall, CPU) seconds per step over ``steps`` steps; CPU time is the whole
    process's (all threads): it does not count time spent waiting for a core, so it is
    far less sensitive than wall time to the load of a shared machine."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        logs = train_function(iterator)
    _sync(logs)
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def _set_threads(threads):
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def _project_function(model):
    """``model.project`` under ``tf.function`` (as in the train step), traced once."""
    import tensorflow as tf

    project = model.timed_project
    if not isinstance(project, tf.types.experimental.GenericFunction):
        project = tf.function(project)
    project()
    return project


def _time_calls(function, calls=20):
    """Mean CPU seconds per call (see :func:`_time_steps`)."""
    c0 = time.process_time()
    for _ in range(calls):
        function()
    return (time.process_time() - c0) / calls


def _time_project(model, repeats):
    project = _project_function(model)
    return statistics.median([_time_calls(project) for _ in range(repeats)])


def isolated_worker(arch, contender, batch, repeats, cap, threads):
    start_all = time.perf_counter()
    import numpy as np
    import tensorflow as tf

    # The same imports in every worker, baseline included (its peak memory is subtracted).
    # tensorflow-privacy is absent from the Keras 3 stack: there, only its own contenders
    # need it (and fail without it).
    try:
        import tensorflow_privacy  # noqa: F401
    except ImportError:
        if contender.startswith("tfp-"):
            raise

    import lipdp.clipless.model  # noqa: F401

    _set_threads(threads)
    tf.keras.utils.set_random_seed(0)
    iterator = _iterator(arch, batch)
    result = {"arch": arch, "contender": contender, "batch": batch}
    result["tensorflow_privacy_imported"] = "tensorflow_privacy" in sys.modules
    if contender == "baseline":
        result["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return result
    model = _build(arch, contender, batch)
    result["params"] = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    if hasattr(model, "fast_clipping"):
        result["fast_clipping"] = model.fast_clipping
    train_function = _train_function(model)
    result["first_step_s"], steps = _warm_up(train_function, iterator)
    per_step, cpu = [], []
    load = [os.getloadavg()[0]]
    for _ in range(repeats):
        # Stop early rather than be killed: the parent's cap covers the whole worker.
        remaining = cap - (time.perf_counter() - start_all) - 5.0
        if per_step and steps * statistics.median(per_step) > remaining:
            break
        wall, cpu_time = _time_steps(train_function, iterator, steps)
        per_step.append(wall)
        cpu.append(cpu_time)
    load.append(os.getloadavg()[0])
    result.update(
        step_s=statistics.median(per_step),
        step_min_s=min(per_step),
        step_all_s=per_step,
        cpu_s=statistics.median(cpu),
        cpu_all_s=cpu,
        steps_per_repeat=steps,
        repeats=len(per_step),
        loadavg=load,
    )
    if hasattr(model, "timed_project"):
        result["project_s"] = _time_project(model, repeats)
    result["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def paired_worker(arch, batch, variants, repeats, threads):
    import tensorflow as tf

    _set_threads(threads)
    tf.keras.utils.set_random_seed(0)
    iterator = _iterator(arch, batch)
    functions, steps, first, models, projects = {}, {}, {}, {}, {}
    if arch == "dense":  # no pooling layer to swap
        variants = [v for v in variants if v != "keras-l2pool"]
    for v in variants:
        models[v] = _build(arch, v, batch)
        functions[v] = _train_function(models[v])
        first[v], steps[v] = _warm_up(functions[v], iterator)
        if hasattr(models[v], "timed_project") and v not in ("lipdp-bare", "lipdp-no-project"):
            projects[v] = _project_function(models[v])
    walls = {v: [] for v in variants}
    times = {v: [] for v in variants}  # CPU seconds per step
    project_times = {v: [] for v in projects}
    load = [os.getloadavg()[0]]
    for r in range(repeats):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            wall, cpu = _time_steps(functions[v], iterator, steps[v])
            walls[v].append(wall)
            times[v].append(cpu)
            if v in projects:
                project_times[v].append(_time_calls(projects[v], 10))
    load.append(os.getloadavg()[0])
    result = {"arch": arch, "batch": batch, "loadavg": load, "threads": threads, "variants": {}}

    def ratio(a, b):
        return statistics.median([x / y for x, y in zip(a, b)])

    for v in variants:
        entry = {
            "step_s": statistics.median(times[v]),
            "step_all_s": times[v],
            "wall_s": statistics.median(walls[v]),
            "wall_all_s": walls[v],
            "first_step_s": first[v],
            "steps_per_repeat": steps[v],
        }
        if "keras" in times:
            entry["ratio_keras"] = ratio(times[v], times["keras"])
            entry["wall_ratio_keras"] = ratio(walls[v], walls["keras"])
        if "lipdp-no-noise" in times:
            entry["ratio_no_noise"] = ratio(times[v], times["lipdp-no-noise"])
            entry["wall_ratio_no_noise"] = ratio(walls[v], walls["lipdp-no-noise"])
        if v in projects:
            entry["project_s"] = statistics.median(project_times[v])
        result["variants"][v] = entry
    return result


# --------------------------------------------------------------------------- parent
def _rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return 0.0
    return 0.0


def run_worker(worker_args, args, cap, describe, repeats, threads):
    cmd = [sys.executable, __file__, *worker_args, "--repeats", str(repeats)]
    cmd += ["--cap", str(cap), "--threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, failure = 0.0, None
    while proc.poll() is None:
        peak = max(peak, _rss_mb(proc.pid))
        if peak > args.mem_cap_gb * 1024:
            failure = f"memory > {args.mem_cap_gb:g} GB"
        elif time.perf_counter() - start > cap:
            failure = f"time > {cap:g} s"
        if failure:
            proc.kill()
            proc.wait()
            break
        time.sleep(0.1)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if failure is None:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode == 0 and lines:
            result = json.loads(lines[-1][len("RESULT ") :])
            result["wall_s"] = wall
            return result
        tail = [line for line in err.strip().splitlines() if line.strip()][-1:]
        failure = "error: " + (tail[0][:120] if tail else f"exit code {proc.returncode}")
        if "ResourceExhausted" in err or "MemoryError" in err or proc.returncode == -9:
            failure = "out of memory (TF allocation error)"
    return {**describe, "failure": failure, "wall_s": wall, "peak_polled_mb": peak}


def machine_description():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import tensorflow as tf

    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"TF {tf.__version__}, {datetime.date.today().isoformat()}"
    )


def _ms(seconds):
    ms = 1e3 * seconds
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _table(title, batches, rows):
    lines = [f"\n{title}\n", "| | " + " | ".join(f"b={b}" for b in batches) + " |"]
    lines.append("| --- |" + " --- |" * len(batches))
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    return lines


def isolated_tables(results, archs, batches, contenders):
    lines = []
    key = {(r["arch"], r["contender"], r["batch"]): r for r in results}
    for arch in archs:
        time_rows, speed_rows, mem_rows, project_rows, cpu_rows = [], [], [], [], []
        for c in contenders:
            t_cells, s_cells, m_cells, p_cells, c_cells = [], [], [], [], []
            for b in batches:
                r, floor, base = (key.get((arch, n, b)) for n in (c, "keras", "baseline"))
                if r is None or "failure" in r:
                    c_cells.append("-")
                else:
                    cell = _ms(r["cpu_s"])
                    if floor is not None and "cpu_s" in floor:
                        cell += f" ({r['cpu_s'] / floor['cpu_s']:.2f}x)"
                    c_cells.append(cell)
                if r is None:
                    t_cells.append("-")
                    s_cells.append("-")
                    m_cells.append("-")
                    p_cells.append("-")
                    continue
                if "failure" in r:
                    t_cells.append(r["failure"])
                    s_cells.append("-")
                    m_cells.append(f"{r['failure']} (polled peak {r['peak_polled_mb']:.0f})")
                    p_cells.append("-")
                    continue
                cell = _ms(r["step_s"])
                if floor is not None and "step_s" in floor:
                    cell += f" ({r['step_s'] / floor['step_s']:.2f}x)"
                if r["repeats"] < 3:
                    cell += f" [{r['repeats']} rep.]"
                t_cells.append(cell)
                s_cells.append(f"{b / r['step_s']:,.0f}")
                if base is not None and "maxrss_mb" in base:
                    m_cells.append(f"{r['maxrss_mb'] - base['maxrss_mb']:.0f}")
                else:
                    m_cells.append(f"[{r['maxrss_mb']:.0f}]")
                p_cells.append(_ms(r["project_s"]) if "project_s" in r else "-")
            time_rows.append((c, t_cells))
            cpu_rows.append((c, c_cells))
            speed_rows.append((c, s_cells))
            mem_rows.append((c, m_cells))
            if any(p != "-" for p in p_cells):
                project_rows.append((c, p_cells))
        base_cells = []
        for b in batches:
            base = key.get((arch, "baseline", b))
            base_cells.append(f"{base['maxrss_mb']:.0f}" if base and "maxrss_mb" in base else "-")
        lines += _table(f"#### {arch}: median step time, ms (ratio to keras)", batches, time_rows)
        lines += _table(f"#### {arch}: throughput, examples/s", batches, speed_rows)
        lines += _table(
            f"#### {arch}: CPU time per step (all threads), ms (ratio to keras)", batches, cpu_rows
        )
        lines += _table(
            f"#### {arch}: peak resident memory, MB above the baseline process",
            batches,
            mem_rows + [("(baseline process, absolute MB)", base_cells)],
        )
        if project_rows:
            lines += _table(
                f"#### {arch}: `model.project()` alone (tf.function), CPU ms per call",
                batches,
                project_rows,
            )
    return "\n".join(lines)


def paired_tables(results, archs, batches):
    lines = []
    key = {(r["arch"], r["batch"]): r for r in results}
    for arch in archs:
        variants = []
        for b in batches:
            r = key.get((arch, b))
            for v in (r or {}).get("variants", {}):
                if v not in variants:
                    variants.append(v)
        rows, ratio_rows = [], []
        for v in variants:
            cells, ratio_cells = [], []
            for b in batches:
                r = key.get((arch, b))
                if r is None or "failure" in r:
                    cells.append(r["failure"] if r else "-")
                    ratio_cells.append("-")
                    continue
                e = r["variants"].get(v)
                if e is None:
                    cells.append("-")
                    ratio_cells.append("-")
                    continue
                cell = _ms(e["step_s"])
                if "ratio_keras" in e:
                    cell += f" ({e['ratio_keras']:.2f}x; wall {e['wall_ratio_keras']:.2f}x)"
                cells.append(cell)
                ratio_cells.append(
                    f"{e['ratio_no_noise']:.3f} (wall {e['wall_ratio_no_noise']:.3f})"
                    if "ratio_no_noise" in e
                    else "-"
                )
            rows.append((v, cells))
            if v.startswith("lipdp") and v != "lipdp-layers-keras":
                ratio_rows.append((v, ratio_cells))
        lines += _table(
            f"#### {arch}, paired: median CPU ms per step (median per-round ratio to keras: "
            "CPU time; wall time)",
            batches,
            rows,
        )
        if any(c != "-" for _, cells in ratio_rows for c in cells):
            lines += _table(
                f"#### {arch}, paired: median per-round ratio to lipdp-no-noise, "
                "CPU time (wall time)",
                batches,
                ratio_rows,
            )
        p_rows = []
        for v in variants:
            cells = []
            for b in batches:
                e = ((key.get((arch, b)) or {}).get("variants") or {}).get(v, {})
                cells.append(_ms(e["project_s"]) if "project_s" in e else "-")
            if any(c != "-" for c in cells):
                p_rows.append((v, cells))
        lines += _table(
            f"#### {arch}, paired: `model.project()` alone, CPU ms per call", batches, p_rows
        )
    return "\n".join(lines)


def plot(results, archs, batches, contenders, path):
    """Wall time (top row) and CPU time (bottom row) per step vs batch size, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(archs), figsize=(6.5 * len(archs), 9), squeeze=False)
    for row, (field, label) in enumerate([("step_s", "wall"), ("cpu_s", "CPU")]):
        for ax, arch in zip(axes[row], archs):
            for c in contenders:
                pts = sorted(
                    (r["batch"], 1e3 * r[field])
                    for r in results
                    if r["arch"] == arch and r.get("contender") == c and field in r
                )
                if pts:
                    style = "--" if c.startswith("tfp") else "-"
                    ax.plot(*zip(*pts), style, marker="o", label=c)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(batches)
            ax.set_xticklabels([str(b) for b in batches])
            ax.set_xlabel("batch size")
            ax.set_ylabel(f"median {label} time per step (ms)")
            ax.set_title(f"{arch}: {label} time per step (missing points: memory/time cap)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("ARCH", "CONTENDER", "BATCH"))
    parser.add_argument("--paired-worker", nargs="+", metavar="ARCH BATCH VARIANT")
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 256, 1024, 4096])
    parser.add_argument(
        "--mode", nargs="+", default=["isolated", "paired"], choices=["isolated", "paired"]
    )
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS)
    parser.add_argument("--variants", nargs="+", default=PAIRED_VARIANTS)
    parser.add_argument("--repeats", type=int, default=7, help="repeats per isolated worker")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the paired workers")
    parser.add_argument(
        "--threads", type=int, default=0, help="TF threads, isolated workers (0: TF default)"
    )
    parser.add_argument("--paired-threads", type=int, default=1, help="TF threads, paired")
    parser.add_argument("--cap", type=float, default=150.0, help="seconds per isolated worker")
    parser.add_argument("--mem-cap-gb", type=float, default=8.0)
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument("--plot", default=None, help="PNG of step time vs batch size")
    parser.add_argument(
        "--from-json", default=None, help="print the tables (and plot) of a saved --json run"
    )
    args = parser.parse_args()

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        archs = [
            a for a in ARCHS if any(r["arch"] == a for r in saved["isolated"] + saved["paired"])
        ]
        batches = sorted({r["batch"] for r in saved["isolated"] + saved["paired"]})
        contenders = []
        for r in saved["isolated"]:
            if r["contender"] != "baseline" and r["contender"] not in contenders:
                contenders.append(r["contender"])
        if saved["isolated"]:
            print("\n### Isolated runs (one process per contender)")
            print(isolated_tables(saved["isolated"], archs, batches, contenders))
            if args.plot:
                plot(saved["isolated"], archs, batches, contenders, args.plot)
        if saved["paired"]:
            print("\n### Paired runs (all variants in one process, timed round-robin)")
            print(paired_tables(saved["paired"], archs, batches))
        return

    if args.worker:
        arch, contender, batch = args.worker
        result = isolated_worker(arch, contender, int(batch), args.repeats, args.cap, args.threads)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.paired_worker:
        arch, batch, *variants = args.paired_worker
        result = paired_worker(arch, int(batch), variants, args.repeats, args.threads)
        print("RESULT " + json.dumps(result))
        return

    print(f"Machine: {machine_description()}.")
    print(f"Command: {' '.join([Path(sys.executable).name] + sys.argv)}", flush=True)
    isolated, paired = [], []
    started = time.perf_counter()

    def dump():
        if args.json:
            Path(args.json).write_text(json.dumps({"isolated": isolated, "paired": paired}))

    def log(msg):
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", file=sys.stderr, flush=True)

    if "isolated" in args.mode:
        for arch in args.archs:
            for batch in args.batches:
                for c in ["baseline"] + args.contenders:
                    describe = {"arch": arch, "contender": c, "batch": batch}
                    r = run_worker(
                        ["--worker", arch, c, str(batch)],
                        args,
                        args.cap,
                        describe,
                        args.repeats,
                        args.threads,
                    )
                    isolated.append(r)
                    status = r.get("failure") or (
                        f"{1e3 * r['step_s']:.3g} ms/step" if "step_s" in r else "ok"
                    )
                    rss = r.get("maxrss_mb", r.get("peak_polled_mb", 0))
                    log(f"{arch} b={batch} {c}: {status} (rss {rss:.0f} MB, {r['wall_s']:.0f} s)")
                    dump()
        print("\n### Isolated runs (one process per contender)")
        print(isolated_tables(isolated, args.archs, args.batches, args.contenders))
        if args.plot:
            plot(isolated, args.archs, args.batches, args.contenders, args.plot)
            print(f"\nPlot: {args.plot}")
    if "paired" in args.mode:
        for arch in args.archs:
            for batch in args.batches:
                describe = {"arch": arch, "batch": batch}
                cap = max(args.cap, 60.0 * len(args.variants))
                r = run_worker(
                    ["--paired-worker", arch, str(batch), *args.variants],
                    args,
                    cap,
                    describe,
                    args.rounds,
                    args.paired_threads,
                )
                paired.append(r)
                log(f"paired {arch} b={batch}: {r.get('failure', 'ok')} ({r['wall_s']:.0f} s)")
                dump()
        print("\n### Paired runs (all variants in one process, timed round-robin)")
        print(paired_tables(paired, args.archs, args.batches))
    print(f"\nTotal wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
