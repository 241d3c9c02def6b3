"""Step time and peak memory of lipdp against jax-privacy and Opacus, in one run.

    .venv/bin/python benchmarks/cross_library_speed.py [--rounds 3] [--steps 10]
        [--warmup 3] [--batch-size 256] [--physical-batch-size P] [--contenders ...]
        [--cap 600] [--json out.json]
        [--keras3-python .venv/bin/python] [--torch-python .venv-torch/bin/python]
    .venv/bin/python benchmarks/cross_library_speed.py --from-json out.json

Results and their reading: benchmarks/README.md, section "lipdp against jax-privacy and
Opacus".

**The network.** The ``cnn`` of ``step_speed.py`` / ``keras_stacks_speed.py`` in its
unconstrained form (28x28x1 inputs, 10 classes, 50 080 parameters, no biases):
Conv2D(32, 3, same) -> ReLU -> AveragePooling2D(2) -> Conv2D(64, 3, same) -> ReLU ->
AveragePooling2D(2) -> Flatten -> Dense(10); PyTorch gets the same layers (NCHW; every
worker checks the parameter count). Softmax cross-entropy, plain SGD(0.01). The Clipless
contender trains the Lipschitz CNN of ``step_speed.py`` instead (same shapes and
parameters, GroupSort and L2-norm pooling; its loss is the tau-cross-entropy).

**The contenders** (clip norm 1, noise multiplier 1, flat clipping, batches of ``b``):

* ``keras-tf`` / ``keras-jax``: plain Keras 3 on TensorFlow / on JAX (the floors);
* ``lipdp-clipped-tf``: ``lipdp.make_private(..., method="clipped",
  gradient_method="ghost")`` (``DPSGD_Sequential``: ghost norms, then the clipped sum);
* ``lipdp-clipless-tf``: Clipless DP-SGD, ``DP_Sequential`` on the Lipschitz CNN, global
  noise (``lipdp-global`` of ``keras_stacks_speed.py``);
* ``keras-lipschitz-tf`` / ``keras-lipschitz-jax``: the Lipschitz CNN of the Clipless
  contenders and its tau-cross-entropy in a plain ``keras.Sequential``, trained by plain
  Keras (no bounds, noise or projection): the cost of the Lipschitz layers alone, which
  separates it from the cost of privacy (issue 39);
* ``lipdp-clipped-jax``: the same ``make_private`` call under ``KERAS_BACKEND=jax``
  (``DPSGD_JaxModel``'s default step: per-example gradients by ``jax.vmap``);
  skipped ("not available") while ``import lipdp.clipped.jax`` fails;
* ``lipdp-clipless-jax``: the same ``DP_Sequential`` under ``KERAS_BACKEND=jax``
  (``CliplessJaxTrainer``: one ``jax.grad`` of the batch loss, host sensitivities,
  XLA-compiled);
* ``jax-privacy``: jax-privacy's Keras API (``keras_api.make_private(model,
  DPKerasConfig(...))``) on the plain Keras model: per-example gradients by ``jax.vmap``
  over the batch, clipped, summed, Gaussian noise, XLA-compiled (Keras' JAX trainer);
  fixed batches of ``b``, as every other contender here;
* ``jax-privacy-poisson``: the same with ``poisson_sampling_in_fit=True``: jax-privacy's
  own Poisson sampling inside ``fit`` (expected size ``b``), each batch padded with
  zero-weight rows to a multiple of 32 (so a new padded size compiles a new step);
* ``torch``: plain PyTorch (eager) on the equivalent ``nn.Sequential``;
* ``opacus-ghost`` / ``opacus-hooks``: Opacus ``PrivacyEngine.make_private`` with
  ``grad_sample_mode="ghost"`` (ghost clipping: norms from activations and output
  gradients, then a second backward pass on the reweighted loss) / ``"hooks"`` (the
  default: per-example gradients materialised by hooks, then clipped);
  ``poisson_sampling=False`` (fixed batches of ``b``).

**Physical batches** (``--physical-batch-size P``, issue 39): the private contenders
compute each batch of ``b`` rows ``P`` rows at a time and update once: lipdp's
``physical_batch_size=P``, Opacus' ``BatchMemoryManager(max_physical_batch_size=P)``,
jax-privacy's ``gradient_accumulation_steps=b/P`` (``fit`` on batches of ``P``; a step is
then ``b/P`` of them); the plain contenders are unchanged. ``benchmarks/large_batches.py``
runs the grid of ``(b, P)`` with these workers.

Every contender uses its library's ordinary training loop: Keras ``fit`` (one epoch of
``warmup + steps`` batches of synthetic uniform data, shuffled) or, for PyTorch, a loop
over a ``DataLoader``. A callback (Keras) or the loop (PyTorch) reads the loss after
every step, which waits for the step to finish, and records the wall clock
(``time.perf_counter``) and the process' CPU time (``time.process_time``, all threads)
there: a step's time is the difference between two such marks (data loading included).
The first ``warmup`` steps (trace and compilation) are dropped; a worker reports the
median over the other ``steps``. Peak memory is the worker's peak resident set
(``VmHWM``, the ``ru_maxrss`` of its own image: Linux carries ``ru_maxrss`` over fork and
exec, so the plain value would start at the parent's peak) at its end, and also just
before the model is built (imports and data only).

**The protocol.** One subprocess per contender and round; a round runs every contender
once, in an order rotated by one every round, so the load of the shared machine hits
them all alike. Every worker runs with 1 intra-op thread and 1 inter-op thread
(TensorFlow's threading config, XLA's ``intra_op_parallelism_threads=1`` and
``--xla_cpu_multi_thread_eigen=false`` for JAX, ``torch.set_num_threads(1)``;
``OMP_NUM_THREADS=MKL_NUM_THREADS=1`` for all): on 2 shared cores, frameworks that
spread over both would distort the ratios. A table cell is the median over rounds; a
ratio is the median over rounds of the per-round ratio (two workers of the same round).
CPU time does not count the time spent waiting for a core, so on a loaded machine it is
the stabler measure; both are reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

PARAMS = 50_080
SHAPE, CLASSES = (28, 28, 1), 10
LEARNING_RATE = 0.01
SIGMA = 1.0
CLIP = 1.0
DELTA = 1e-5
POISSON_PADDING = 32  # jax-privacy's padding multiple of its Poisson batches (b >= 32)


@dataclass(frozen=True)
class Contender:
    name: str
    backend: str  # "tensorflow", "jax" or "torch"
    python: str  # "keras3" or "torch": which interpreter runs it
    probe: str  # the import that must succeed for it to run


CONTENDERS = [
    Contender("keras-tf", "tensorflow", "keras3", "import keras"),
    Contender("lipdp-clipped-tf", "tensorflow", "keras3", "import lipdp"),
    Contender("lipdp-clipless-tf", "tensorflow", "keras3", "import lipdp"),
    Contender("keras-lipschitz-tf", "tensorflow", "keras3", "import lipdp"),
    Contender("keras-jax", "jax", "keras3", "import keras"),
    Contender("lipdp-clipped-jax", "jax", "keras3", "import lipdp.clipped.jax"),
    Contender("lipdp-clipless-jax", "jax", "keras3", "import lipdp.clipless.jax.trainer"),
    Contender("keras-lipschitz-jax", "jax", "keras3", "import lipdp.clipless.layers"),
    Contender("jax-privacy", "jax", "keras3", "import jax_privacy.keras_api"),
    Contender("jax-privacy-poisson", "jax", "keras3", "import jax_privacy.keras_api"),
    Contender("torch", "torch", "torch", "import torch"),
    Contender("opacus-ghost", "torch", "torch", "import opacus"),
    Contender("opacus-hooks", "torch", "torch", "import opacus"),
]
BY_NAME = {c.name: c for c in CONTENDERS}
#: The plain framework each contender is compared with (same backend).
FLOOR = {"tensorflow": "keras-tf", "jax": "keras-jax", "torch": "torch"}
REFERENCE = "lipdp-clipped-tf"
PACKAGES = {
    "keras3": ["tensorflow", "keras", "jax", "jaxlib", "jax-privacy", "numpy"],
    "torch": ["torch", "opacus", "numpy"],
}


# =========================================================================== worker
def _environment(backend):
    """The environment of a worker: one thread everywhere, the worktree's lipdp first."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    }
    if backend in ("tensorflow", "jax"):
        env["KERAS_BACKEND"] = backend
    return env


def _data(n):
    """``n`` rows of synthetic data: uniform images, one-hot labels."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, size=(n, *SHAPE)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, size=n)]
    return x, y


def _peak_rss_mb():
    """Peak resident memory of this process image, MB: ``VmHWM``. (``ru_maxrss`` is not
    used: Linux carries it over ``fork`` and ``exec``, so a worker's would start at the
    parent's peak.)"""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


class _Marks:
    """Wall and CPU clock marks; ``steps()`` gives the (wall, CPU) seconds of each step."""

    def __init__(self):
        self.marks = []

    def mark(self):
        self.marks.append((time.perf_counter(), time.process_time()))

    def steps(self):
        pairs = zip(self.marks, self.marks[1:])
        return [(w1 - w0, c1 - c0) for (w0, c0), (w1, c1) in pairs]


# --------------------------------------------------------------------------- Keras
def _keras_layers():
    """The unconstrained CNN (``step_speed._keras_layers("cnn")``), backend-neutral."""
    import common

    return common.plain_cnn_layers(SHAPE, CLASSES)


def _keras_compile(model, loss=None, accumulation=1):
    """SGD; ``accumulation > 1``: Keras' gradient accumulation (an update every
    ``accumulation`` batches, on their mean gradient), as jax-privacy's requires."""
    import keras

    steps = None if accumulation == 1 else accumulation
    model.compile(
        loss=loss or keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(LEARNING_RATE, gradient_accumulation_steps=steps),
    )
    return model


def _physical_option(physical, probe=True):
    """lipdp's ``physical_batch_size`` keyword, only when one is asked for (so that the
    script still runs the whole-batch step of a lipdp that predates the option);
    ``probe=False``: ``independence_probe=False`` (TensorFlow models: the step without the
    batch-independence probe run when it is traced)."""
    options = {} if physical is None else {"physical_batch_size": physical}
    return options if probe else {**options, "independence_probe": False}


def _lipdp_clipped(batch, n, physical=None, probe=True):
    """``lipdp.make_private(method="clipped")`` at sigma = 1 (the calibrated sigma is
    replaced, as make_private itself sets it); fixed batches (``sampling="shuffle"``);
    ``physical``: logical batches of ``batch`` rows computed ``physical`` rows at a time."""
    import dataclasses

    import keras

    import lipdp

    # Ghost norms are the TensorFlow step's way; the JAX step takes its own default.
    ghost = {"gradient_method": "ghost"} if keras.backend.backend() == "tensorflow" else {}
    model = lipdp.make_private(
        _keras_layers(),
        epsilon=3.0,
        delta=DELTA,
        epochs=1,
        batch_size=batch,
        dataset_size=n,
        method="clipped",
        clip_norm=CLIP,
        clipping="flat",
        sampling="shuffle",
        **ghost,
        **_physical_option(physical, probe),
    )
    model.dp_parameters = dataclasses.replace(model.dp_parameters, noise_multiplier=SIGMA)
    return _keras_compile(model)


def _lipdp_clipless(batch, n, physical=None, probe=True):
    """The Lipschitz CNN of ``step_speed.py``, Clipless DP-SGD, global noise, sigma = 1;
    ``physical`` as in :func:`_lipdp_clipped`."""
    sys.path.insert(0, str(HERE))
    import step_speed

    from lipdp.clipless import losses
    from lipdp.clipless.model import DP_Sequential, DPParameters
    from lipdp.pipeline import DatasetMetadata

    metadata = DatasetMetadata(
        input_shape=SHAPE,
        nb_classes=CLASSES,
        nb_samples_train=n,
        batch_size=batch,
        sampling="shuffle",
    )
    model = DP_Sequential(
        step_speed._lipdp_layers("cnn"),
        dp_parameters=DPParameters("global", SIGMA, DELTA),
        dataset_metadata=metadata,
        **_physical_option(physical, probe),
    )
    return _keras_compile(model, losses.DP_TauCategoricalCrossentropy(tau=8.0))


def _keras_lipschitz():
    """The Lipschitz CNN of ``_lipdp_clipless`` in a plain ``keras.Sequential``, its
    tau-cross-entropy, plain Keras training (no bounds, noise or projection)."""
    sys.path.insert(0, str(HERE))
    import keras
    import step_speed

    from lipdp.clipless import losses

    model = keras.Sequential(step_speed._lipdp_layers("cnn"))
    return _keras_compile(model, losses.DP_TauCategoricalCrossentropy(tau=8.0))


def _jax_privacy(batch, n, steps, poisson, physical=None):
    """jax-privacy 2.0's Keras API on the plain model, sigma = 1, clip 1. Its
    ``rescale_to_unit_norm`` (divide the clipped gradients by the clip norm) is turned
    off: a no-op at clip 1, and lipdp and Opacus do not rescale. ``physical``: its
    gradient accumulation, ``fit`` on batches of ``physical`` rows and one noisy update
    every ``batch / physical`` of them (``gradient_accumulation_steps``); ``steps`` counts
    ``fit``'s batches."""
    import keras
    from jax_privacy import keras_api

    config = keras_api.DPKerasConfig(
        epsilon=1e3,  # only checked to be met by noise_multiplier=1 (no calibration)
        delta=DELTA,
        clipping_norm=CLIP,
        batch_size=batch if physical is None else physical,
        gradient_accumulation_steps=_accumulation(batch, physical),
        train_steps=steps,
        train_size=n,
        poisson_sampling_in_fit=poisson,
        noise_multiplier=SIGMA,
        rescale_to_unit_norm=False,
        seed=0,
    )
    model = keras_api.make_private(keras.Sequential(_keras_layers()), config)
    return _keras_compile(model, accumulation=config.gradient_accumulation_steps)


def _accumulation(batch, physical):
    """Physical batches per logical one (``physical`` must divide ``batch``)."""
    if physical is None:
        return 1
    if batch % physical:
        raise ValueError(f"physical batch {physical} does not divide the batch {batch}")
    return batch // physical


def _keras_model(name, batch, n, steps, physical=None, probe=True):
    import keras

    if name in ("keras-tf", "keras-jax"):
        return _keras_compile(keras.Sequential(_keras_layers()))
    if name in ("lipdp-clipped-tf", "lipdp-clipped-jax"):
        return _lipdp_clipped(batch, n, physical, probe)
    if name in ("lipdp-clipless-tf", "lipdp-clipless-jax"):
        return _lipdp_clipless(batch, n, physical, probe)
    if name in ("keras-lipschitz-tf", "keras-lipschitz-jax"):
        return _keras_lipschitz()
    poisson = name == "jax-privacy-poisson"
    return _jax_privacy(batch, n, steps, poisson, physical)


def _keras_setup(backend):
    """Import Keras on its backend with one thread; versions of what was imported."""
    import keras

    assert keras.config.backend() == backend, keras.config.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        keras.utils.set_random_seed(0)
    else:  # keras.utils.set_random_seed would import TensorFlow (and its memory) too
        import random

        import numpy as np

        random.seed(0)
        np.random.seed(0)
    return {"keras": keras.__version__}


def _keras_worker(contender, batch, steps, physical=None, rows=None, probe=True):
    import keras
    import numpy as np

    info = _keras_setup(contender.backend)
    x, y = _data(rows or batch * steps)
    info["rss_before_model_mb"] = _peak_rss_mb()
    # jax-privacy's accumulation: fit's batches are the physical ones, `every` to a step.
    every = _accumulation(batch, physical) if contender.name.startswith("jax-priv") else 1
    fit_batch = batch // every
    epochs = -(-steps * every // (len(x) // fit_batch))  # whole epochs over `rows`
    fits = epochs * len(x) // fit_batch
    model = _keras_model(contender.name, batch, len(x), fits, physical, probe)
    marks = _Marks()

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seen = 0
            marks.mark()

        def on_train_batch_end(self, step, logs=None):
            float((logs or {}).get("loss", 0.0))  # the step has finished
            self.seen += 1
            if self.seen % every == 0:  # the end of a logical step
                marks.mark()

    model.fit(x, y, batch_size=fit_batch, epochs=epochs, verbose=0, callbacks=[Timer()])
    info["params"] = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    info["tensorflow_imported"] = "tensorflow" in sys.modules
    if "lipdp" in sys.modules:
        info["lipdp_file"] = sys.modules["lipdp"].__file__
    return marks.steps(), info


# --------------------------------------------------------------------------- PyTorch
def _torch_model():
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, CLASSES, bias=False),
    )


def _torch_loader(batch, rows):
    import torch

    x, y = _data(rows)
    images = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())  # NHWC -> NCHW
    labels = torch.from_numpy(y.argmax(axis=1))
    dataset = torch.utils.data.TensorDataset(images, labels)
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch, shuffle=True, drop_last=True, generator=generator
    )


def _torch_private(name, model, optimizer, criterion, loader):
    """Opacus' make_private, sigma = 1, clip 1, flat clipping, fixed batches."""
    from opacus import PrivacyEngine

    made = PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        criterion=criterion,
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        poisson_sampling=False,
        grad_sample_mode=name.removeprefix("opacus-"),
    )
    if len(made) == 4:  # ghost: (model, optimizer, criterion, loader)
        return made
    return (*made[:2], criterion, made[2])


def _torch_worker(contender, batch, steps, physical=None, rows=None, probe=True):
    """PyTorch's loop; ``physical`` (Opacus): ``BatchMemoryManager`` splits each logical
    batch of ``batch`` rows into physical ones of at most ``physical`` rows; the optimizer
    skips its step (clips and sums only) until the last one, and a step is marked then."""
    import contextlib

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    info = {"torch": torch.__version__}
    loader = _torch_loader(batch, rows or batch * steps)
    info["rss_before_model_mb"] = _peak_rss_mb()
    model = _torch_model()
    info["params"] = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    criterion = torch.nn.CrossEntropyLoss()
    if contender.name.startswith("opacus-"):
        model, optimizer, criterion, loader = _torch_private(
            contender.name, model, optimizer, criterion, loader
        )
    manager = contextlib.nullcontext(loader)
    if physical is not None and contender.name.startswith("opacus-"):
        from opacus.utils.batch_memory_manager import BatchMemoryManager

        manager = BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer
        )
    marks = _Marks()
    with manager as batches:
        marks.mark()
        while len(marks.marks) <= steps:  # whole epochs over the data
            for images, labels in batches:
                optimizer.zero_grad()
                loss = criterion(model(images), labels)
                loss.backward()
                optimizer.step()
                loss.item()
                if not getattr(optimizer, "_is_last_step_skipped", False):
                    marks.mark()  # an update was made: the end of a logical step
    return marks.steps(), info


def worker(name, batch, warmup, steps, physical=None, rows=None, probe=True):
    """One contender, one process: RESULT line with its medians and peak memory.
    ``physical``: logical batches of ``batch`` rows computed ``physical`` rows at a time
    (the private contenders; ignored by the plain ones). ``rows``: the size of the
    synthetic data set (default ``batch * (warmup + steps)``), trained on for as many
    whole epochs as the steps need."""
    contender = BY_NAME[name]
    load = [os.getloadavg()[0]]
    run = _torch_worker if contender.backend == "torch" else _keras_worker
    per_step, info = run(contender, batch, warmup + steps, physical, rows, probe)
    if info["params"] != PARAMS:
        raise AssertionError(f"{name}: {info['params']} parameters, expected {PARAMS}")
    timed = per_step[warmup:]
    load.append(os.getloadavg()[0])
    return {
        **info,
        "steps_run": len(per_step),
        "first_step_s": per_step[0][0],
        "step_s": statistics.median(w for w, _ in timed),
        "cpu_s": statistics.median(c for _, c in timed),
        "step_all_s": [w for w, _ in per_step],
        "cpu_all_s": [c for _, c in per_step],
        "peak_rss_mb": _peak_rss_mb(),
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loadavg": load,
    }


# =========================================================================== parent
def _probe(python, contender):
    """``None`` if the contender can run with ``python``, else why not."""
    if not Path(python).exists():
        return f"interpreter {python} not found"
    proc = subprocess.run(
        [python, "-c", contender.probe],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_environment(contender.backend),
    )
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return f"`{contender.probe}` fails: {lines[-1] if lines else proc.returncode}"


_VERSIONS_SNIPPET = """
import importlib.metadata as m, json, platform, sys
out = {"python": platform.python_version()}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def _versions(python, packages):
    """Package versions of an interpreter, read from its metadata (nothing imported)."""
    if not Path(python).exists():
        return {}
    out = subprocess.run(
        [python, "-c", _VERSIONS_SNIPPET, *packages], capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1]) if out.strip() else {}


def run_worker(python, contender, args):
    """One measurement in its own process; killed (and reported as such) after --cap s."""
    cmd = [python, str(Path(__file__).resolve()), "--worker", contender.name]
    cmd += ["--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup)]
    if getattr(args, "physical_batch_size", None):
        cmd += ["--physical-batch-size", str(args.physical_batch_size)]
    if getattr(args, "rows", None):
        cmd += ["--rows", str(args.rows)]
    if getattr(args, "no_probe", False):
        cmd += ["--no-probe"]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_environment(contender.backend),
    )
    try:
        out, err = proc.communicate(timeout=args.cap)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"failure": f"time > {args.cap:g} s", "wall_s": time.perf_counter() - start}
    result = {"wall_s": time.perf_counter() - start}
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
        return {**json.loads(lines[-1][len("RESULT ") :]), **result}
    tail = [line for line in err.strip().splitlines() if line.strip()][-3:]
    reason = " | ".join(tail)[:400] if tail else f"exit {proc.returncode}"
    return {"failure": "error: " + reason, **result}


# --------------------------------------------------------------------------- tables
def _rounds(results):
    """{round: {contender: result}} of the successful measurements."""
    rounds = {}
    for r in results:
        if "step_s" in r:
            rounds.setdefault(r["round"], {})[r["contender"]] = r
    return rounds


def _median_cell(rounds, name, field, scale=1e3, digits=0):
    values = [m[name][field] for m in rounds.values() if name in m]
    return f"{scale * statistics.median(values):.{digits}f}" if values else "-"


def _ratio(rounds, num, den, field):
    ratios = [m[num][field] / m[den][field] for m in rounds.values() if num in m and den in m]
    return statistics.median(ratios) if ratios else None


def _ratio_cell(rounds, num, den):
    """``CPU ratio / wall ratio``, each the median of the per-round ratios."""
    if num == den:
        return "1"
    cpu, wall = _ratio(rounds, num, den, "cpu_s"), _ratio(rounds, num, den, "step_s")
    if cpu is None:
        return "-"
    return f"{cpu:.2f}x / {wall:.2f}x"


def table(saved):
    rounds = _rounds(saved["results"])
    b = saved["settings"]["batch_size"]
    lines = [
        f"\n#### CNN (50 080 parameters), b = {b}: median over rounds of the per-worker "
        "medians; ratios: CPU / wall, median of per-round ratios\n",
        "| contender | backend | ms/step wall | ms/step CPU | vs plain, same backend "
        f"| vs {REFERENCE} | peak RSS MB | RSS before the model MB | first step s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in map(BY_NAME.get, saved["settings"]["contenders"]):
        if c.name in saved["skipped"]:
            continue
        cells = [
            c.name,
            c.backend,
            _median_cell(rounds, c.name, "step_s"),
            _median_cell(rounds, c.name, "cpu_s"),
            _ratio_cell(rounds, c.name, FLOOR[c.backend]),
            _ratio_cell(rounds, c.name, REFERENCE),
            _median_cell(rounds, c.name, "peak_rss_mb", scale=1),
            _median_cell(rounds, c.name, "rss_before_model_mb", scale=1),
            _median_cell(rounds, c.name, "first_step_s", scale=1, digits=1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _notes(saved)
    return "\n".join(lines)


def _notes(saved):
    lines = []
    if saved["skipped"]:
        lines.append("\nNot measured:\n")
        lines += [f"* {name}: not available ({why})" for name, why in saved["skipped"].items()]
    failures = [r for r in saved["results"] if "failure" in r]
    if failures:
        lines.append("\nFailed measurements:\n")
        lines += [f"* round {r['round']}, {r['contender']}: {r['failure']}" for r in failures]
    loads = [x for r in saved["results"] for x in r.get("loadavg", [])]
    if loads:
        lines.append(
            f"\nLoad average (1 min) seen by the workers: {min(loads):.1f}–{max(loads):.1f} "
            f"(median {statistics.median(loads):.1f}) on {os.cpu_count()} cores."
        )
    return lines


def header(saved):
    s = saved["settings"]
    lines = [f"Machine: {saved['machine']}.", f"Date: {saved['date']}."]
    lines.append(f"Command: {saved['command']}")
    for kind, info in saved["pythons"].items():
        versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        lines.append(f"{kind} interpreter ({info['python']}): {versions or 'missing'}.")
    lines.append(f"lipdp: commit {saved['lipdp_commit']}.")
    physical = s.get("physical_batch_size")
    lines.append(
        f"Settings: b = {s['batch_size']}"
        + (f" computed {physical} rows at a time by the private contenders" if physical else "")
        + f", {s['rounds']} round(s), {s['warmup']} warm-up + "
        f"{s['steps']} timed steps per worker, 1 thread per worker, cap {s['cap']:g} s."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument(
        "--physical-batch-size",
        type=int,
        default=None,
        help="the private contenders compute each batch this many rows at a time (lipdp's "
        "physical_batch_size, Opacus' BatchMemoryManager, jax-privacy's accumulation)",
    )
    parser.add_argument("--rows", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contenders", nargs="+", default=[c.name for c in CONTENDERS])
    parser.add_argument("--cap", type=float, default=600.0, help="seconds per worker")
    parser.add_argument("--keras3-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--torch-python", default=str(ROOT / ".venv-torch" / "bin" / "python"))
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--from-json", default=None, help="reprint the table of a saved run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def _command():
    python = sys.executable
    if python.startswith(str(ROOT)):
        python = os.path.relpath(python, ROOT)
    return " ".join([python, os.path.relpath(__file__, ROOT), *sys.argv[1:]])


def _start(args, pythons):
    sys.path.insert(0, str(HERE))
    import common

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    contenders = [BY_NAME[name] for name in args.contenders]
    skipped = {c.name: _probe(pythons[c.python], c) for c in contenders}
    return {
        "machine": common.machine_description().rsplit(", TF ", 1)[0],
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "command": _command(),
        "settings": {
            "batch_size": args.batch_size,
            "physical_batch_size": args.physical_batch_size,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "cap": args.cap,
            "contenders": args.contenders,
        },
        "pythons": {
            kind: {"python": os.path.relpath(p, ROOT), "versions": _versions(p, PACKAGES[kind])}
            for kind, p in pythons.items()
        },
        "lipdp_commit": commit,
        "skipped": {name: why for name, why in skipped.items() if why},
        "results": [],
    }


def _measure(saved, args, pythons):
    runnable = [c for c in map(BY_NAME.get, args.contenders) if c.name not in saved["skipped"]]
    started = time.perf_counter()
    for rnd in range(args.rounds if runnable else 0):
        k = rnd % len(runnable)
        for position, contender in enumerate(runnable[k:] + runnable[:k]):
            r = run_worker(pythons[contender.python], contender, args)
            r.update(round=rnd, position=position, contender=contender.name)
            saved["results"].append(r)
            status = r.get("failure") or (
                f"{1e3 * r['step_s']:.0f} ms wall, {1e3 * r['cpu_s']:.0f} ms CPU per step, "
                f"{r['peak_rss_mb']:.0f} MB"
            )
            print(
                f"[{time.perf_counter() - started:5.0f} s] round {rnd} {contender.name}: "
                f"{status} ({r['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            _dump(saved, args)
    saved["total_wall_s"] = time.perf_counter() - started


def _dump(saved, args):
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(saved, indent=1))


def main():
    args = _parse()
    if args.worker:
        result = worker(
            args.worker,
            args.batch_size,
            args.warmup,
            args.steps,
            args.physical_batch_size,
            args.rows,
            not args.no_probe,
        )
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        print(header(saved))
        print(table(saved))
        return
    pythons = {"keras3": args.keras3_python, "torch": args.torch_python}
    saved = _start(args, pythons)
    print(header(saved), flush=True)
    for name, why in saved["skipped"].items():
        print(f"{name}: not available ({why})", flush=True)
    _measure(saved, args, pythons)
    _dump(saved, args)
    print(table(saved))
    print(f"\nTotal wall time: {saved['total_wall_s']:.0f} s")


if __name__ == "__main__":
    main()
