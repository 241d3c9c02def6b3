import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# lipdp first, as a user may import it (it sets nothing; lipdp.foundation.compat).
import lipdp  # noqa: E402, F401, I001
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@contextlib.contextmanager
def _native_start_up_lines_discarded():
    """Discard what native code writes to file descriptor 2 inside the block.

    Importing TensorFlow prints, from C++, lines that say nothing about lipdp: on 2.15 the
    CUDA factory registrations ("Unable to register cuDNN factory ...", ERROR level), on
    2.21 absl's start-up notices and the failed cuInit. Under ``pytest -n`` the controller
    process imports this file outside pytest's capture, so they opened ``make test``'s
    output. TF_CPP_MIN_LOG_LEVEL=3 during the import would not do: TensorFlow reads the level
    once, at its first message, so the whole process, tests included, would keep 3 and hide
    every later C++ error; absl's notices ignore the variable anyway. Here only the import
    and the device set-up are silenced, the level stays 2 for the tests, and Python's own
    stderr (warnings, tracebacks of a failed import, which propagates) keeps the real
    descriptor. ``LIPDP_NATIVE_LOGS=1`` shows the lines.
    """
    if os.environ.get("LIPDP_NATIVE_LOGS") == "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    if python_stderr is sys.__stderr__:
        sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if sys.stderr is not python_stderr:
            sys.stderr.close()
            sys.stderr = python_stderr


#: ``KERAS_BACKEND=jax`` (``make test-jax``): only the JAX test directories run
#: (tests/clipped/jax, tests/clipless/jax: each conftest.py skips itself on other backends;
#: tests/backends, written for every backend, runs in the default suite too),
#: without TensorFlow; every other directory is ignored (their modules import TensorFlow
#: programs that refuse the JAX backend).
JAX_RUN = os.environ.get("KERAS_BACKEND") == "jax"
_TESTS = os.path.dirname(os.path.abspath(__file__))
_JAX_TESTS = [
    os.path.join(_TESTS, "clipped", "jax"),
    os.path.join(_TESTS, "clipless", "jax"),
    os.path.join(_TESTS, "backends"),
]


def pytest_ignore_collect(collection_path, config):
    """On a JAX run, everything outside the JAX test directories is ignored (``None``:
    pytest decides)."""
    if not JAX_RUN:
        return None
    path = str(collection_path)
    for tests in _JAX_TESTS:
        if path == tests or path.startswith(tests + os.sep) or tests.startswith(path + os.sep):
            return None
    return True


if not JAX_RUN:
    with _native_start_up_lines_discarded():
        import tensorflow as tf

        # tests/core/test_distribute.py trains under MirroredStrategy over two logical CPU
        # devices. Devices can be split only before TensorFlow initialises them: here, once
        # per process (single-device code keeps running on the first one).
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 2,
        )

    from lipdp.foundation.compat import keras_3

    KERAS_3 = keras_3()

    # Session fixtures shared by the evaluation tests (the digits CNN is trained once per
    # test process, not once per test module).
    from tests.evaluation_helpers import digits, trained  # noqa: F401
from tests.marks import is_thorough, thorough  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the tests listed in ``tests/marks.py`` as thorough (before ``-m`` selects)."""
    for item in items:
        if is_thorough(item.nodeid):
            item.add_marker(thorough)


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same seeds (TF global seed, numpy, Python)."""
    if JAX_RUN:
        # Not keras.utils.set_random_seed: it imports TensorFlow when installed, which the
        # JAX path does not need (tests/clipped/jax seeds its weights explicitly).
        import random

        import keras

        random.seed(1234)
        np.random.seed(1234)
        yield
        keras.backend.clear_session(free_memory=False)
        return
    tf.keras.utils.set_random_seed(1234)
    yield
    _clear_keras_session()


def _clear_keras_session():
    """Keras' global state (layer names, graph) reset after every test, without the full
    garbage collection Keras 3's ``clear_session`` runs by default (``free_memory=True``):
    that ``gc.collect()`` over a heap of traced TensorFlow functions was 42 % of the
    default tier's worker time (3.1 s per test at a load of 8-11 on 2 cores, 2026-11-29);
    Python's own collector still runs on its thresholds. Keras 2's ``clear_session`` takes
    no argument and collects nothing."""
    if KERAS_3:
        tf.keras.backend.clear_session(free_memory=False)
    else:
        tf.keras.backend.clear_session()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
