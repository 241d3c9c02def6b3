"""lipdp.data.sources: offline raw loaders, file formats, and the error when data is missing."""

import gzip
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest

from lipdp.data import sources
from lipdp.data.images import load_and_prepare_images_data
from lipdp.data.sources import load_adbench_data
from lipdp.data.tabular import prepare_tabular_data
from tests import data_helpers


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    return data_helpers.offline_home(tmp_path, monkeypatch)


# ---------------------------------------------------------------- image sets
def test_digits():
    data = sources.load_digits()
    assert data.x_train.shape == (1536, 8, 8, 1) and data.x_test.shape == (261, 8, 8, 1)
    assert data.nb_classes == 10 and set(np.unique(data.y_train)) == set(range(10))
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0


def test_debian_fashion_mnist():
    if not sources.DEBIAN_FASHION_MNIST.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must install the Debian package dataset-fashion-mnist")
        pytest.skip("dataset-fashion-mnist is not installed")
    data = sources.load_fashion_mnist()
    assert data.x_train.shape == (60000, 28, 28, 1) and data.x_test.shape == (10000, 28, 28, 1)
    assert data.nb_classes == 10
    assert np.bincount(data.y_train).tolist() == [6000] * 10
    assert data.x_train.dtype == np.float32 and data.x_train.max() == 1.0


def test_canonical_names():
    assert sources.canonical_name("Fashion-MNIST") == "fashion_mnist"
    assert sources.canonical_name("CIFAR-10") == "cifar10"
    assert sources.canonical_name("digits") == "digits"
    with pytest.raises(ValueError, match="Unknown image data set 'svhn'"):
        sources.canonical_name("svhn")


def test_idx_directory_and_missing_data_error(tmp_path, monkeypatch):
    def write(name, array):
        header = b"\x00\x00\x08" + bytes([array.ndim])
        header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        with gzip.open(tmp_path / f"{name}.gz", "wb") as f:
            f.write(header + array.astype(np.uint8).tobytes())

    rng = np.random.default_rng(0)
    train_images = rng.integers(0, 256, (5, 28, 28))
    write("train-images-idx3-ubyte", train_images)
    write("train-labels-idx1-ubyte", np.arange(5))
    write("t10k-images-idx3-ubyte", rng.integers(0, 256, (2, 28, 28)))
    write("t10k-labels-idx1-ubyte", np.arange(2))
    data = sources.load_fashion_mnist(tmp_path)
    assert data.x_train.shape == (5, 28, 28, 1) and data.y_test.tolist() == [0, 1]
    np.testing.assert_allclose(data.x_train[..., 0], train_images / 255.0, rtol=1e-6)

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", empty / "absent")
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist.*Nothing is downloaded"):
        sources.load_fashion_mnist(empty)


@pytest.mark.parametrize("name", ["mnist", "cifar10", "fashion_mnist"])
def test_missing_dataset_error(name, tmp_path, offline_home, monkeypatch):
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as info:
        load_and_prepare_images_data(name, data_dir=empty)
    assert time.perf_counter() - start < 5.0
    message = str(info.value)
    assert str(empty) in message and str(offline_home / ".keras" / "datasets") in message
    assert "TensorFlow Datasets" in message and "Nothing is downloaded" in message
    assert "load_data()" in message  # how to provide the files
    if name == "fashion_mnist":
        assert "dataset-fashion-mnist" in message
    # the image pipeline passes the loader's error on unchanged
    with pytest.raises(FileNotFoundError) as direct:
        sources.load_images(name, data_dir=empty)
    assert str(direct.value) == message


def test_npz_and_cifar_pickles_are_read(tmp_path, offline_home):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 28, 28), dtype=np.uint8)
    np.savez(tmp_path / "mnist.npz", x_train=x, y_train=np.arange(40) % 10, x_test=x[:8],
             y_test=np.arange(8) % 10)  # fmt: skip
    _, _, meta = load_and_prepare_images_data("mnist", batch_size=8, data_dir=tmp_path)
    assert (meta.nb_samples_train, meta.nb_samples_test) == (40, 8)
    data = sources.load_mnist(tmp_path / "mnist.npz")  # an .npz file directly
    np.testing.assert_allclose(data.x_train[..., 0], x / 255.0, rtol=1e-6)

    # Keras cache layout of CIFAR-10: ~/.keras/datasets/cifar-10-batches-py/
    cache = offline_home / ".keras" / "datasets" / "cifar-10-batches-py"
    cache.mkdir(parents=True)
    for name, n in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 3)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": list(range(n))}  # fmt: skip
        with open(cache / name, "wb") as f:
            pickle.dump(batch, f)
    data = sources.load_cifar10()
    assert data.x_train.shape == (20, 32, 32, 3) and data.x_test.shape == (3, 32, 32, 3)
    # channel-first rows of 1024 values: red plane first
    with open(cache / "test_batch", "rb") as f:
        raw = pickle.load(f)[b"data"]
    np.testing.assert_allclose(data.x_test[1, :, :, 0].ravel(), raw[1, :1024] / 255.0, rtol=1e-6)
    assert data.class_names[0] == "airplane"


# ------------------------------------------------------------------- ADBench
def test_adbench_is_looked_for_only_in_the_users_places_and_the_package(monkeypatch):
    monkeypatch.setenv("LIPDP_DATA_DIR", "/data/lipdp")
    dirs = sources.adbench_dirs("/mine")
    assert dirs == [Path("/mine"), Path("/data/lipdp"), sources.PACKAGED_DATA_DIR]
    assert sources.PACKAGED_DATA_DIR.is_relative_to(Path(sources.__file__).parent)


def test_adbench_file_names(tmp_path, monkeypatch):
    monkeypatch.delenv("LIPDP_DATA_DIR", raising=False)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(30, 4)), (rng.uniform(size=30) < 0.2).astype("int32")
    np.savez(tmp_path / "7_toy.npz", x=x, y=y)  # ADBench's numbered file name
    x_read, y_read = load_adbench_data("toy", data_dir=tmp_path)
    assert x_read.dtype == np.float32 and y_read.dtype == np.int64
    np.testing.assert_array_equal(x_read, x.astype("float32"))
    np.testing.assert_array_equal(y_read, y)
    x_path, _ = load_adbench_data(str(tmp_path / "7_toy.npz"))
    np.testing.assert_array_equal(x_path, x_read)


def test_shuttle_is_shipped_with_the_package(monkeypatch):
    """No LIPDP_DATA_DIR, no data_dir: the packaged copy is found (any install)."""
    monkeypatch.delenv("LIPDP_DATA_DIR", raising=False)
    assert (sources.PACKAGED_DATA_DIR / "adbench_shuttle.npz").is_file()
    x, y = load_adbench_data("shuttle")
    assert x.shape == (49097, 9) and x.dtype == np.float32
    assert y.shape == (49097,) and int(y.sum()) == 3511 and set(np.unique(y)) == {0, 1}
    _, _, meta = prepare_tabular_data(
        x, y, batch_size=1024, bound_fct=1.0, scaling="standardize", one_hot=False
    )
    assert meta.nb_samples_train == 39277 and meta.nb_steps_per_epochs == 39277 // 1024


def test_adbench_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("LIPDP_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="Nothing is downloaded"):
        load_adbench_data("no_such_set", data_dir=tmp_path)


def test_breast_cancer_uses_public_ranges_that_contain_every_row():
    """The ranges clip nothing on this set (each raw value lies inside them), every row
    lands in [-1, 1]^30 (norm <= sqrt(30), the CLI's bound), the split is stratified."""
    from sklearn.datasets import load_breast_cancer as sklearn_breast_cancer

    from lipdp.data.sources import BREAST_CANCER_RANGES, load_breast_cancer

    raw = sklearn_breast_cancer().data
    low, high = np.array([r for block in BREAST_CANCER_RANGES for r in block]).T
    assert low.shape == (30,) and np.all(raw >= low) and np.all(raw <= high)
    data = load_breast_cancer(seed=3)
    assert data.x_train.shape == (455, 30) and data.x_test.shape == (114, 30)
    assert np.abs(np.concatenate([data.x_train, data.x_test])).max() <= 1.0
    expected = (2.0 * (raw - low) / (high - low) - 1.0).astype("float32")
    rows = {tuple(np.round(r, 5)) for r in expected}
    assert all(tuple(np.round(r, 5)) in rows for r in data.x_test)
    assert abs(data.y_train.mean() - data.y_test.mean()) < 0.01  # 357 / 569 benign
    assert data.class_names == ["malignant", "benign"]
