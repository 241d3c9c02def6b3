import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# lipdp first, as a user may import it (it sets nothing; lipdp.foundation.compat).
import lipdp  # noqa: E402, F401, I001
import numpy as np  # noqa: E402
import pytest  # noqa: E402


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
    # TensorFlow's C++ start-up lines (absl's notices, the failed cuInit) would open
    # make test's output: under pytest -n the controller imports this file outside
    # pytest's capture. Imported, and its devices listed, with them discarded.
    from lipdp.foundation.native_logs import import_tensorflow_quietly

    tf = import_tensorflow_quietly()
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
        _collect_this_test_and_freeze()
        return
    tf.keras.utils.set_random_seed(1234)
    yield
    _clear_keras_session()
    _collect_this_test_and_freeze()


def _collect_this_test_and_freeze():
    """Python's cyclic garbage of the test just run collected, then every surviving object
    moved out of the collector's sight (``gc.freeze``): later collections scan only what
    later tests create. Without it, a worker's heap grows to ~2 million tracked objects
    (traced functions, models of earlier tests) and each automatic full collection scans
    them all: 36 s of one test's 40 s at the end of a worker, 47 s of a worker's 6.5 min
    (2026-12-07, ``gc.callbacks`` timing). The collection here scans only the last test's
    objects. (A frozen object that becomes cyclic garbage later is not collected: the
    cost is memory, bounded by the run.)"""
    gc.collect()
    gc.freeze()


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
