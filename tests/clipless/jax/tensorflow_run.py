"""How the JAX tests get TensorFlow's numbers: a module of this folder run in a
subprocess under ``KERAS_BACKEND=tensorflow`` (one process cannot hold both backends),
reading its inputs from files and writing its numbers to files; and the state of a
JAX model as its step receives it."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def run_tensorflow_side(module: str, *arguments, timeout=300) -> None:
    """Run ``tests.clipless.jax.<module> *arguments`` on TensorFlow; fail with its stderr."""
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(
        [sys.executable, "-m", f"tests.clipless.jax.{module}", *map(str, arguments)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def step_state(model):
    """The step's plan and key made (as before a real step), and the state's values
    ``(trainable, non_trainable)``."""
    model.make_train_function()
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )
