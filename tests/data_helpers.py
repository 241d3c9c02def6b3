"""Shared helpers of the data tests (``tests/test_data_*.py``)."""

import hashlib

import numpy as np


def norms(x):
    """Euclidean norm of each example, over all non-batch axes, in float64."""
    x = np.asarray(x, dtype="float64")
    return np.linalg.norm(x.reshape(len(x), -1), axis=1)


def batches(ds):
    """One pass over a ``(x, y)`` data set, as numpy arrays."""
    return [(x.numpy(), y.numpy()) for x, y in ds]


def digest(image):
    return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


def offline_home(tmp_path, monkeypatch):
    """HOME, KERAS_HOME and TFDS_DATA_DIR in an empty directory: no local data set.

    Wrapped in a fixture by the test modules that need it.
    """
    home = tmp_path / "home"
    (home / ".keras").mkdir(parents=True)  # writable, so Keras' /tmp fallback is unused
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KERAS_HOME", str(home / ".keras"))
    monkeypatch.setenv("TFDS_DATA_DIR", str(home / "tfds"))
    monkeypatch.delenv("LIPDP_DATA_DIR", raising=False)
    return home
