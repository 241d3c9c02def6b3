"""Offline data sets: shapes, counts and the error when one is missing."""

import gzip
import os

import numpy as np
import pytest

from lipdp import datasets


def test_digits():
    data = datasets.load_digits()
    assert data.x_train.shape == (1536, 8, 8, 1) and data.x_test.shape == (261, 8, 8, 1)
    assert data.nb_classes == 10 and set(np.unique(data.y_train)) == set(range(10))
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0


def test_debian_fashion_mnist():
    if not datasets.DEBIAN_FASHION_MNIST.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must install the Debian package dataset-fashion-mnist")
        pytest.skip("dataset-fashion-mnist is not installed")
    data = datasets.load_fashion_mnist()
    assert data.x_train.shape == (60000, 28, 28, 1) and data.x_test.shape == (10000, 28, 28, 1)
    assert data.nb_classes == 10
    assert np.bincount(data.y_train).tolist() == [6000] * 10
    assert data.x_train.dtype == np.float32 and data.x_train.max() == 1.0


def test_idx_directory_and_missing_data_error(tmp_path):
    def write(name, array):
        header = b"\x00\x00\x08" + bytes([array.ndim])
        header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        with gzip.open(tmp_path / f"{name}.gz", "wb") as f:
            f.write(header + array.astype(np.uint8).tobytes())

    rng = np.random.default_rng(0)
    write("train-images-idx3-ubyte", rng.integers(0, 256, (5, 28, 28)))
    write("train-labels-idx1-ubyte", np.arange(5))
    write("t10k-images-idx3-ubyte", rng.integers(0, 256, (2, 28, 28)))
    write("t10k-labels-idx1-ubyte", np.arange(2))
    data = datasets.load_fashion_mnist(tmp_path)
    assert data.x_train.shape == (5, 28, 28, 1) and data.y_test.tolist() == [0, 1]

    empty = tmp_path / "empty"
    empty.mkdir()
    original = datasets.DEBIAN_FASHION_MNIST
    datasets.DEBIAN_FASHION_MNIST = empty / "absent"
    try:
        with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist.*Nothing is downloaded"):
            datasets.load_fashion_mnist(empty)
    finally:
        datasets.DEBIAN_FASHION_MNIST = original
