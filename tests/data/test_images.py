"""lipdp.data.images: colour spaces, augmentation and the image pipeline (on digits and on
small generated files in the MNIST and CIFAR-10 formats)."""

import itertools
import os

import numpy as np
import pytest
import tensorflow as tf

from lipdp.data import sources
from lipdp.data.images import (
    AUGMENTATIONS,
    COLORSPACES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    augment_images,
    colorspace_max_norm,
    colorspace_output_shape,
    convert_colorspace,
    load_and_prepare_data,
    load_and_prepare_images_data,
)
from lipdp.data.input_bounds import bound_clip_value, bound_normalize
from tests import data_helpers
from tests.data_helpers import batches, norms


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    return data_helpers.offline_home(tmp_path, monkeypatch)


# ------------------------------------------------------------------ pipeline
def test_fashion_mnist_from_debian():
    if not sources.DEBIAN_FASHION_MNIST.exists():
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


def test_augmentation_is_a_function_of_the_seed(rng):
    images = tf.constant(rng.uniform(0, 1, (5, 6, 6, 3)), tf.float32)
    np.testing.assert_array_equal(augment_images(images, 3, flip=False, pad=0), images)
    a = augment_images(images, 3, flip=True, pad=2)
    np.testing.assert_array_equal(a, augment_images(images, 3, flip=True, pad=2))
    assert not np.array_equal(a, augment_images(images, 4, flip=True, pad=2))
    # digits are never mirrored; every data set gets some translation
    assert not AUGMENTATIONS["digits"]["flip"] and not AUGMENTATIONS["mnist"]["flip"]
    assert all(setting["pad"] >= 1 for setting in AUGMENTATIONS.values())


# ------------------------------------------------------------ shapes, errors
def test_colour_space_shapes_and_constants():
    for space in COLORSPACES:
        expected = (4, 5, 1) if space == "GRAYSCALE" else (4, 5, 3)
        assert colorspace_output_shape((4, 5, 3), space) == expected
        assert convert_colorspace(tf.zeros((2, 4, 5, 3)), space).shape[1:] == expected
    assert colorspace_output_shape((8, 8, 1), "rgb") == (8, 8, 1)  # case-insensitive
    # torchvision's ImageNet statistics
    assert IMAGENET_MEAN == (0.485, 0.456, 0.406) and IMAGENET_STD == (0.229, 0.224, 0.225)
    # RGB: every pixel at 1 gives sqrt(h w c)
    assert colorspace_max_norm((4, 5, 3), "RGB") == pytest.approx(np.sqrt(60), rel=1e-5)


def test_colour_space_errors():
    images = tf.zeros((1, 2, 2, 3))
    with pytest.raises(ValueError, match="Unknown colorspace 'LAB'"):
        convert_colorspace(images, "LAB")
    with pytest.raises(ValueError, match="channels"):
        convert_colorspace(tf.zeros((1, 2, 2, 2)), "RGB")
    for bad in (([0.5] * 2, [0.2] * 3), ([0.5] * 3, [0.2, 0.0, 0.2])):
        with pytest.raises(ValueError, match="standardization"):
            convert_colorspace(images, "RGB_STANDARDIZED", standardization=bad)


def test_pipeline_argument_errors():
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="multiplicity"):
            load_and_prepare_images_data("digits", batch_size=64, multiplicity=bad)
    with pytest.raises(ValueError, match="Unknown image data set"):
        load_and_prepare_images_data("svhn")
    with pytest.raises(TypeError, match="bound_fct"):
        load_and_prepare_images_data("digits", bound_fct="1.0")


def test_test_set_is_in_order_and_unaugmented():
    _, ds_test, meta = load_and_prepare_images_data(
        "digits", batch_size=100, multiplicity=2, seed=0
    )
    raw = sources.load_digits()
    images = np.concatenate([x for x, _ in batches(ds_test)])
    labels = np.concatenate([y for _, y in batches(ds_test)])
    np.testing.assert_array_equal(images, raw.x_test)
    np.testing.assert_array_equal(labels.argmax(-1), raw.y_test)
    assert meta.nb_samples_test == len(raw.x_test)


def test_poisson_image_pipeline_trains_the_accounted_mechanism():
    """sampling="poisson": batches of random size (mean b), N // b steps, the rate stated
    on the dataset and in the metadata; a DP model trains on it."""
    import numpy as np

    from lipdp.clipless import losses
    from lipdp.clipless.model import DPParameters
    from lipdp.core.callbacks import DP_Accountant
    from lipdp.recipes import zoo

    ds_train, _, metadata = load_and_prepare_images_data(
        "digits", batch_size=128, bound_fct=5.0, sampling="poisson", seed=0
    )
    assert metadata.sampling == "poisson" and not metadata.partial_last_batch
    assert ds_train.lipdp_sampling_rate == metadata.sampling_rate == 128 / metadata.nb_samples_train
    sizes = [len(x) for x, _ in ds_train]
    assert len(sizes) == metadata.nb_steps_per_epochs == metadata.nb_samples_train // 128
    assert len(set(sizes)) > 1 and abs(np.mean(sizes) - 128) < 4 * np.sqrt(128)
    model = zoo.build_model("pooled_cnn", metadata, DPParameters("global", 2.0, 1e-5))
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(8.0), optimizer="adam")
    history = model.fit(ds_train, epochs=1, verbose=0, callbacks=[DP_Accountant()])
    assert history.history["epsilon"][-1] > 0
    with pytest.raises(ValueError, match="multiplicity"):
        load_and_prepare_images_data("digits", batch_size=128, sampling="poisson", multiplicity=2)
