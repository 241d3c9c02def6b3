"""Data pipelines: loading, batching, shuffling, colour spaces, bounds, augmentation
multiplicity, tabular preparation."""

import hashlib
import itertools
import os
import pickle
import time

import numpy as np
import pytest
import tensorflow as tf

from lipdp import datasets
from lipdp.pipeline import (
    COLORSPACES,
    DatasetMetadata,
    bound_clip_value,
    bound_normalize,
    colorspace_max_norm,
    convert_colorspace,
    load_adbench_data,
    load_and_prepare_data,
    load_and_prepare_images_data,
    prepare_tabular_data,
)


def norms(x):
    x = np.asarray(x, dtype="float64")
    return np.linalg.norm(x.reshape(len(x), -1), axis=1)


def batches(ds):
    return [(x.numpy(), y.numpy()) for x, y in ds]


def digest(image):
    return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    """HOME, KERAS_HOME and TFDS_DATA_DIR in an empty directory: no local data set."""
    home = tmp_path / "home"
    (home / ".keras").mkdir(parents=True)  # writable, so Keras' /tmp fallback is unused
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KERAS_HOME", str(home / ".keras"))
    monkeypatch.setenv("TFDS_DATA_DIR", str(home / "tfds"))
    monkeypatch.delenv("LIPDP_DATA_DIR", raising=False)
    return home


# ------------------------------------------------------------------- loading
def test_fashion_mnist_from_debian():
    if not datasets.DEBIAN_FASHION_MNIST.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must install the Debian package dataset-fashion-mnist")
        pytest.skip("dataset-fashion-mnist is not installed")
    ds_train, ds_test, meta = load_and_prepare_images_data(
        "fashion_mnist", batch_size=1000, seed=0, data_dir=None
    )
    assert (meta.nb_samples_train, meta.nb_samples_test, meta.nb_classes) == (60000, 10000, 10)
    assert meta.input_shape == (28, 28, 1) and meta.class_names[0] == "T-shirt/top"
    assert meta.max_norm == pytest.approx(28.0, rel=1e-5)  # sqrt(28 * 28 * 1)
    sizes = [int(x.shape[0]) for x, _ in ds_train]
    assert sizes == [1000] * 60 and meta.nb_steps_per_epochs == 60
    x, y = next(iter(ds_test))
    assert x.dtype == tf.float32 and y.dtype == tf.float32 and y.shape == (1000, 10)
    assert np.all(y.numpy().sum(axis=1) == 1)


def test_digits_loads():
    ds_train, ds_test, meta = load_and_prepare_data("digits", batch_size=256, seed=0)
    assert (meta.nb_samples_train, meta.nb_samples_test) == (1536, 261)
    assert meta.input_shape == (8, 8, 1) and meta.nb_classes == 10
    assert meta.nb_steps_per_epochs == 6 and meta.max_norm == pytest.approx(8.0, rel=1e-5)
    test = batches(ds_test)
    assert sum(len(x) for x, _ in test) == 261  # the test set is complete


@pytest.mark.parametrize("name", ["mnist", "cifar10", "fashion_mnist"])
def test_missing_dataset_error(name, tmp_path, offline_home, monkeypatch):
    monkeypatch.setattr(datasets, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
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


def test_npz_and_cifar_pickles_are_read(tmp_path, offline_home):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 28, 28), dtype=np.uint8)
    np.savez(tmp_path / "mnist.npz", x_train=x, y_train=np.arange(40) % 10, x_test=x[:8],
             y_test=np.arange(8) % 10)  # fmt: skip
    _, _, meta = load_and_prepare_images_data("mnist", batch_size=8, data_dir=tmp_path)
    assert (meta.nb_samples_train, meta.nb_samples_test) == (40, 8)

    # Keras cache layout of CIFAR-10: ~/.keras/datasets/cifar-10-batches-py/
    cache = offline_home / ".keras" / "datasets" / "cifar-10-batches-py"
    cache.mkdir(parents=True)
    for name, n in [(f"data_batch_{i}", 4) for i in range(1, 6)] + [("test_batch", 3)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": list(range(n))}  # fmt: skip
        with open(cache / name, "wb") as f:
            pickle.dump(batch, f)
    data = datasets.load_cifar10()
    assert data.x_train.shape == (20, 32, 32, 3) and data.x_test.shape == (3, 32, 32, 3)
    # channel-first rows of 1024 values: red plane first
    with open(cache / "test_batch", "rb") as f:
        raw = pickle.load(f)[b"data"]
    np.testing.assert_allclose(data.x_test[1, :, :, 0].ravel(), raw[1, :1024] / 255.0, rtol=1e-6)
    assert data.class_names[0] == "airplane"


# ------------------------------------------------------------------ batching
@pytest.mark.parametrize(
    "bound_fct, bound",
    [(None, 8.0), (bound_clip_value(2.0), 2.0), (bound_normalize(), 1.0), (0.5, 0.5)],
)
def test_full_batches_and_bounds(bound_fct, bound):
    ds_train, ds_test, meta = load_and_prepare_images_data(
        "digits", batch_size=100, bound_fct=bound_fct, seed=1
    )
    assert meta.max_norm == pytest.approx(bound, rel=1e-5)
    train = batches(ds_train)
    assert len(train) == meta.nb_steps_per_epochs == 1536 // 100
    assert all(x.shape == (100, 8, 8, 1) and y.shape == (100, 10) for x, y in train)
    for x, _ in train + batches(ds_test):
        assert norms(x).max() <= meta.max_norm
    if bound_fct is not None and bound < 8.0:
        assert norms(train[0][0]).max() == pytest.approx(bound, rel=1e-5)


def test_partial_last_batch_is_declared():
    ds_train, _, meta = load_and_prepare_images_data(
        "digits", batch_size=100, drop_remainder=False, seed=1
    )
    sizes = [len(x) for x, _ in batches(ds_train)]
    assert sizes == [100] * 15 + [36]
    assert meta.partial_last_batch and meta.nb_steps_per_epochs == 16 == len(sizes)
    assert meta.nb_dropped_per_epoch == 0
    _, _, meta = load_and_prepare_images_data("digits", batch_size=256, drop_remainder=False)
    assert not meta.partial_last_batch and meta.nb_steps_per_epochs == 6


def test_shuffle_is_uniform_over_the_whole_set_and_changes_each_epoch():
    ds_train, _, meta = load_and_prepare_images_data("digits", batch_size=256, seed=3)
    raw = datasets.load_digits().x_train
    expected = sorted(digest(image) for image in raw)
    orders = []
    for _ in range(3):
        epoch = np.concatenate([x for x, _ in batches(ds_train)])
        assert sorted(digest(image) for image in epoch) == expected  # every example, once
        orders.append([digest(image) for image in epoch])
    assert orders[0] != orders[1] != orders[2]
    # the first batch mixes examples from the whole set, not a window of it
    position = {h: i for i, h in enumerate(digest(image) for image in raw)}
    first = [position[h] for h in orders[1][:256]]
    assert max(first) - min(first) > 1200
    # same seed: same sequence of epochs
    again, _, _ = load_and_prepare_images_data("digits", batch_size=256, seed=3)
    epoch = np.concatenate([x for x, _ in batches(again)])
    assert [digest(image) for image in epoch] == orders[0]


# ------------------------------------------------------------- colour spaces
INVERSES = {
    "HSV": tf.image.hsv_to_rgb,
    "YIQ": tf.image.yiq_to_rgb,
    "YUV": tf.image.yuv_to_rgb,
}


@pytest.mark.parametrize("space", COLORSPACES)
def test_colour_conversions(space, rng):
    images = tf.constant(rng.uniform(0, 1, (6, 5, 7, 3)), tf.float32)
    converted = convert_colorspace(images, space)
    if space in INVERSES:
        # tf.image's YIQ matrices are rounded to 4-6 digits: not exact inverses
        np.testing.assert_allclose(INVERSES[space](converted), images, atol=1e-4)
    elif space == "GRAYSCALE":
        np.testing.assert_allclose(converted, tf.image.rgb_to_grayscale(images), atol=1e-6)
    elif space == "RGB_STANDARDIZED":
        mean = np.array([0.485, 0.456, 0.406])
        std = np.array([0.229, 0.224, 0.225])
        np.testing.assert_allclose(converted.numpy() * std + mean, images, atol=1e-6)
        custom = convert_colorspace(images, space, standardization=([0.5] * 3, [0.25] * 3))
        np.testing.assert_allclose(custom, (images - 0.5) / 0.25, atol=1e-5)
    else:
        np.testing.assert_array_equal(converted, images)

    bound = colorspace_max_norm((5, 7, 3), space)
    corners = np.array(list(itertools.product((0.0, 1.0), repeat=3)))
    flat = np.broadcast_to(corners[:, None, None, :], (8, 5, 7, 3)).astype("float32")
    attained = norms(convert_colorspace(tf.constant(flat), space))
    assert norms(converted).max() <= bound and attained.max() <= bound
    if space != "HSV":  # affine conversions: the bound is attained at a corner
        assert attained.max() >= bound * (1 - 1e-5)


def test_one_channel_colour_spaces():
    for space in ("RGB", "GRAYSCALE"):
        _, _, meta = load_and_prepare_images_data("digits", batch_size=256, colorspace=space)
        assert meta.input_shape == (8, 8, 1) and meta.max_norm == pytest.approx(8.0, rel=1e-5)
    for space in ("HSV", "YIQ", "YUV", "RGB_STANDARDIZED"):
        with pytest.raises(ValueError, match="one channel"):
            load_and_prepare_images_data("digits", batch_size=256, colorspace=space)
    with pytest.raises(ValueError, match="Unknown colorspace"):
        load_and_prepare_images_data("digits", colorspace="LAB")


def fake_cifar(tmp_path, n_train=48, n_test=8):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (n_train + n_test, 32, 32, 3), dtype=np.uint8)
    y = np.arange(n_train + n_test) % 10
    np.savez(tmp_path / "cifar10.npz", x_train=x[:n_train], y_train=y[:n_train, None],
             x_test=x[n_train:], y_test=y[n_train:, None])  # fmt: skip
    return x[:n_train] / np.float32(255.0)


@pytest.mark.parametrize("space", ["YIQ", "GRAYSCALE", "RGB_STANDARDIZED"])
def test_colour_pipeline_on_cifar_format(space, tmp_path, offline_home):
    fake_cifar(tmp_path)
    ds_train, _, meta = load_and_prepare_images_data(
        "cifar10", batch_size=16, colorspace=space, data_dir=tmp_path, seed=0
    )
    assert meta.input_shape == ((32, 32, 1) if space == "GRAYSCALE" else (32, 32, 3))
    assert meta.max_norm == pytest.approx(colorspace_max_norm((32, 32, 3), space))
    for x, _ in batches(ds_train):
        assert x.shape[1:] == meta.input_shape and norms(x).max() <= meta.max_norm


# --------------------------------------------------------------- multiplicity
def test_multiplicity_batches_hold_m_copies_of_each_original(tmp_path, offline_home):
    # Constant images of value k/255: a copy (shifted, zero-padded) keeps its maximum.
    n, b, m = 60, 12, 4
    values = np.arange(1, n + 1, dtype=np.uint8)
    x = np.broadcast_to(values[:, None, None], (n, 28, 28)).copy()
    np.savez(tmp_path / "mnist.npz", x_train=x, y_train=np.arange(n) % 10, x_test=x[:5],
             y_test=np.arange(5) % 10)  # fmt: skip
    ds_train, _, meta = load_and_prepare_images_data(
        "mnist", batch_size=b, multiplicity=m, data_dir=tmp_path, seed=2
    )
    assert meta.batch_size == b and meta.multiplicity == m and meta.rows_per_batch == b * m
    assert meta.nb_steps_per_epochs == n // b
    seen, shifted = [], 0
    train = batches(ds_train)
    assert len(train) == meta.nb_steps_per_epochs
    for images, labels in train:
        assert images.shape == (b * m, 28, 28, 1) and labels.shape == (b * m, 10)
        ids = np.rint(images.reshape(b, m, -1).max(axis=-1) * 255).astype(int)
        assert np.all(ids == ids[:, :1])  # rows i*m .. i*m+m-1: copies of one original
        assert len(set(ids[:, 0])) == b  # b distinct originals
        assert np.all(labels.reshape(b, m, 10) == labels.reshape(b, m, 10)[:, :1])
        assert np.all(labels.reshape(b, m, 10)[:, 0].argmax(-1) == (ids[:, 0] - 1) % 10)
        seen += list(ids[:, 0])
        shifted += int(np.sum(images.reshape(b * m, -1).min(axis=-1) == 0))
        assert norms(images).max() <= meta.max_norm
    assert sorted(seen) == list(range(1, n + 1))  # each original once per epoch
    assert 0 < shifted < n * m  # augmentation translates some copies, not all


def test_cifar_augmentation_is_flips_and_translations(tmp_path, offline_home):
    originals = fake_cifar(tmp_path, n_train=16)
    ds_train, _, _ = load_and_prepare_images_data(
        "cifar10", batch_size=4, multiplicity=3, data_dir=tmp_path, seed=4
    )

    def variants(image):
        padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
        for flip in (False, True):
            source = padded[:, ::-1] if flip else padded
            for dy, dx in itertools.product(range(9), range(9)):
                yield flip, dy, dx, source[dy : dy + 32, dx : dx + 32]

    flips = set()
    for images, labels in batches(ds_train)[:2]:
        for row, image in enumerate(images):
            label = labels[row].argmax()
            matches = [
                (flip, dy, dx)
                for original in originals[np.arange(16) % 10 == label]
                for flip, dy, dx, v in variants(original)
                if np.array_equal(v, image)
            ]
            assert matches, "a copy is not a flip/translation of a training image"
            flips.add(matches[0][0])
    assert flips == {False, True}


# ------------------------------------------------------------------ tabular
def tabular(n=1000, d=5, seed=0):
    rng = np.random.default_rng(seed)
    y = (rng.uniform(size=n) < 0.1).astype(int)
    x = rng.normal(3.0, 2.0, (n, d)) + 4.0 * y[:, None]
    return x, y


def training_rows(ds):
    """All rows of one pass, sorted (the training order changes every epoch)."""
    rows = np.concatenate([x for x, _ in batches(ds)])
    return rows[np.lexsort(rows.T[::-1])]


def test_tabular_split_is_stratified_and_standardisation_ignores_test():
    x, y = tabular()
    ds_train, ds_test, meta = prepare_tabular_data(
        x, y, test_size=0.2, batch_size=50, bound_fct=100.0, scaling="standardize",
        drop_remainder=False, shuffle_seed=0,
    )  # fmt: skip
    assert (meta.nb_samples_train, meta.nb_samples_test) == (800, 200)
    assert meta.nb_steps_per_epochs == 16 == len(batches(ds_train))
    assert meta.notes and "non-private" in meta.notes[0]
    y_train = np.concatenate([t.argmax(-1) for _, t in batches(ds_train)])
    y_test = np.concatenate([t.argmax(-1) for _, t in batches(ds_test)])
    assert abs(y_train.mean() - y.mean()) < 2 / 800 and abs(y_test.mean() - y.mean()) < 2 / 200
    train = training_rows(ds_train)
    np.testing.assert_allclose(train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(train.std(axis=0), 1.0, atol=1e-5)

    # Change every feature of the test rows: the prepared training data do not move.
    test_rows = np.isin(np.arange(len(x)), _test_indices(x, y))
    x_changed = x.copy()
    x_changed[test_rows] = 1e3
    ds_train2, ds_test2, _ = prepare_tabular_data(
        x_changed, y, test_size=0.2, batch_size=50, bound_fct=100.0, scaling="standardize",
        drop_remainder=False, shuffle_seed=0,
    )  # fmt: skip
    np.testing.assert_array_equal(training_rows(ds_train2), train)
    assert not np.allclose(training_rows(ds_test2), training_rows(ds_test))


def _test_indices(x, y):
    from sklearn.model_selection import train_test_split

    _, test = train_test_split(np.arange(len(x)), test_size=0.2, random_state=0, stratify=y)
    return test


def test_tabular_bounds():
    x, y = tabular(d=6)
    ds_train, ds_test, meta = prepare_tabular_data(
        x, y, batch_size=64, bound_fct=1.5, scaling="standardize"
    )
    assert meta.max_norm == 1.5 and meta.nb_steps_per_epochs == 800 // 64
    rows = [r for ds in (ds_train, ds_test) for r, _ in batches(ds)]
    assert all(len(r) == 64 for r, _ in batches(ds_train))
    assert max(norms(r).max() for r in rows) <= 1.5

    # public feature ranges: clipped, mapped to [-1, 1], bound sqrt(d) without bound_fct
    ds_train, _, meta = prepare_tabular_data(x, y, batch_size=64, feature_ranges=(0.0, 8.0))
    train = training_rows(ds_train)
    assert meta.max_norm == pytest.approx(np.sqrt(6)) and not meta.notes
    assert train.min() >= -1.0 and train.max() <= 1.0 and norms(train).max() <= meta.max_norm
    with pytest.raises(ValueError, match="Choose a feature scaling"):
        prepare_tabular_data(x, y)
    with pytest.raises(ValueError, match="no public bound"):
        prepare_tabular_data(x, y, scaling="standardize")


def test_shuttle():
    path = datasets.SHARED_DATA_DIR / "adbench_shuttle.npz"
    if not path.exists() and not os.environ.get("LIPDP_DATA_DIR"):
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide {path}")
        pytest.skip(f"{path} is absent")
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


# --------------------------------------------------------- bounds, metadata
def test_bound_functions(rng):
    x = tf.constant(rng.normal(size=(8, 3, 4)) * np.arange(8)[:, None, None], tf.float32)
    fn, bound = bound_clip_value(3.0)
    clipped = fn(x).numpy()
    before = norms(x)
    assert bound == 3.0 and norms(clipped).max() <= 3.0
    small = before <= 3.0
    np.testing.assert_array_equal(clipped[small], x.numpy()[small])
    np.testing.assert_allclose(norms(clipped)[~small], 3.0, rtol=1e-5)
    x_out, label = fn(x, "label")  # usable in a map over (x, y) batches
    assert label == "label" and np.array_equal(x_out, clipped)
    fn, bound = bound_normalize()
    out = norms(fn(x))  # the first example is 0
    assert bound == 1.0 and out[0] == 0.0 and np.all(out <= 1.0)
    np.testing.assert_allclose(out[1:], 1.0, rtol=1e-5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            bound_clip_value(bad)


def test_metadata_round_trip():
    meta = DatasetMetadata(
        input_shape=(4,), nb_classes=2, nb_samples_train=10, batch_size=3,
        multiplicity=2, partial_last_batch=True, notes=["n"],
    )  # fmt: skip
    assert meta.nb_steps_per_epochs == 4 and meta.rows_per_batch == 6
    assert DatasetMetadata(**meta.to_config()) == meta
    assert DatasetMetadata(input_shape=(4,), nb_classes=2, nb_samples_train=10,
                           batch_size=3).nb_steps_per_epochs == 3  # fmt: skip
    with pytest.raises(ValueError, match="multiplicity"):
        DatasetMetadata(input_shape=(4,), nb_classes=2, nb_samples_train=10, multiplicity=-1)
