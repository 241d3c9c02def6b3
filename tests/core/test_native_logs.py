"""TensorFlow's native start-up lines kept off the terminal of a script
(:mod:`lipdp.foundation.native_logs`), in real processes: what ``import tensorflow`` prints
without it is the control."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

#: The control: TensorFlow imported directly prints its lines; lipdp then hands back the
#: module already imported (one process for both: each costs seconds of imports).
PLAIN = (
    "import tensorflow as tf\n"
    "tf.config.list_physical_devices()\n"
    "from lipdp.foundation.native_logs import import_tensorflow_quietly\n"
    "assert import_tensorflow_quietly() is tf\n"
)
QUIET = (
    "import sys, warnings\n"
    "from lipdp.foundation.native_logs import import_tensorflow_quietly\n"
    "tf = import_tensorflow_quietly()\n"
    "tf.config.threading.set_intra_op_parallelism_threads(1)  # runtime not initialised\n"
    "print('python line', file=sys.stderr)\n"
    "print(float(tf.constant(1.0) + 1.0))\n"
)


def _run(code, **env):
    environment = {**os.environ, **env}
    environment.pop("TF_CPP_MIN_LOG_LEVEL", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment,
        cwd=ROOT, timeout=300,
    )  # fmt: skip


def test_a_script_importing_tensorflow_through_lipdp_prints_only_its_own_lines():
    control = _run(PLAIN)
    assert control.returncode == 0, control.stderr  # and TensorFlow already imported is kept
    if not control.stderr.strip():
        pytest.skip("this TensorFlow prints nothing natively at import here: nothing to hide")
    quiet = _run(QUIET)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "2.0"
    assert quiet.stderr.strip().splitlines() == ["python line"]
    # The switch shows them again: the lines were there to hide.
    shown = _run(QUIET, LIPDP_NATIVE_LOGS="1")
    assert len(shown.stderr.strip().splitlines()) > 1
