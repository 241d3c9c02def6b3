import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# Before TensorFlow: on TensorFlow >= 2.16, ``import lipdp`` sets TF_USE_LEGACY_KERAS=1 (unless
# set), so that tf.keras is tf-keras's Keras 2 (lipdp.compat).
import lipdp  # noqa: E402, F401, I001
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# tests/test_distribute.py trains under MirroredStrategy over two logical CPU devices.
# Devices can be split only before TensorFlow initialises them: here, once per process
# (single-device code keeps running on the first one).
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)

# Session fixtures shared by the evaluation tests (the digits CNN is trained once per
# test process, not once per test module).
from tests.evaluation_helpers import digits, trained  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same seeds (TF global seed, numpy, Python)."""
    tf.keras.utils.set_random_seed(1234)
    yield
    tf.keras.backend.clear_session()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
