"""Image data sets as batched ``tf.data`` pipelines: colour spaces, augmentation, loading.

:func:`load_and_prepare_images_data`: raw images in ``[0, 1]`` (see
:mod:`lipdp.data.sources` for where files are looked for; nothing is downloaded) ->
optional augmentation (:data:`AUGMENTATIONS`) -> colour space (:data:`COLORSPACES`) ->
optional ``bound_fct`` (:mod:`lipdp.data.input_bounds`) -> batches
(:mod:`lipdp.data.sampling`). Every bound it declares comes from public facts only:
:func:`colorspace_max_norm` is computed from the image shape and the colour space.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import tensorflow as tf

from lipdp.data import sources
from lipdp.data.input_bounds import ROUNDING_MARGIN, _parse_bound_fct
from lipdp.data.sampling import (
    _check_batch_size,
    _one_hot,
    _ordered_batches,
    _partial_last_batch,
    _training_batches,
)
from lipdp.foundation import validation
from lipdp.foundation.metadata import SAMPLING_MODES, DatasetMetadata
from lipdp.foundation.validation import count

# ----------------------------------------------------------------- colour spaces
#: Colour spaces of :func:`load_and_prepare_images_data`. Conversions use ``tf.image``
#: on RGB images in ``[0, 1]``. One-channel data sets (MNIST, Fashion-MNIST, digits)
#: accept only ``"RGB"`` and ``"GRAYSCALE"``, both meaning "the single luminance
#: channel as it is"; the other spaces need three colour channels and are refused.
COLORSPACES = ("RGB", "RGB_STANDARDIZED", "HSV", "YIQ", "YUV", "GRAYSCALE")

#: Per-channel mean and standard deviation of ImageNet (the constants of torchvision's
#: ImageNet models): public statistics of a data set disjoint from the private one,
#: the default of ``"RGB_STANDARDIZED"``.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: The per-channel statistics of CIFAR-10 usually published. They are fixed public
#: constants, but were computed on CIFAR-10's own training set: when CIFAR-10 is the
#: private data set, using them (``standardization=(CIFAR10_PUBLISHED_MEAN,
#: CIFAR10_PUBLISHED_STD)``) relies on a statistic of the private data that no DP
#: mechanism released (rule S6). Hence not the default.
CIFAR10_PUBLISHED_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_PUBLISHED_STD = (0.2470, 0.2435, 0.2616)


def _colorspace_name(colorspace) -> str:
    name = str(colorspace).upper()
    if name not in COLORSPACES:
        raise ValueError(f"Unknown colorspace {colorspace!r}; supported: {', '.join(COLORSPACES)}.")
    return name


def _standardization(standardization):
    mean, std = standardization if standardization is not None else (IMAGENET_MEAN, IMAGENET_STD)
    mean, std = np.asarray(mean, "float64"), np.asarray(std, "float64")
    if mean.shape != (3,) or std.shape != (3,) or not np.all(std > 0):
        raise ValueError("standardization must be (mean, std), 3 values each, std > 0.")
    return mean, std


def convert_colorspace(images, colorspace="RGB", standardization=None):
    """Convert RGB images in ``[0, 1]`` (last axis: channels) to ``colorspace``.

    ``standardization``: ``(mean, std)`` per channel for ``"RGB_STANDARDIZED"`` -- public
    constants, never statistics of the private training set (rule S6); default
    :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`. One-channel images: see
    :data:`COLORSPACES`.
    """
    name = _colorspace_name(colorspace)
    images = tf.convert_to_tensor(images)
    channels = images.shape[-1]
    if channels == 1:
        if name in ("RGB", "GRAYSCALE"):
            return images
        raise ValueError(
            f"colorspace {name!r} needs RGB images; this data set has one channel: use "
            "'RGB' or 'GRAYSCALE' (both keep the single channel unchanged)."
        )
    if channels != 3:
        raise ValueError(f"expected 1 or 3 channels, got {channels}.")
    if name == "RGB":
        return images
    if name == "RGB_STANDARDIZED":
        mean, std = _standardization(standardization)
        return (images - tf.constant(mean, images.dtype)) / tf.constant(std, images.dtype)
    convert = {
        "HSV": tf.image.rgb_to_hsv,
        "YIQ": tf.image.rgb_to_yiq,
        "YUV": tf.image.rgb_to_yuv,
        "GRAYSCALE": tf.image.rgb_to_grayscale,
    }[name]
    return convert(images)


def colorspace_output_shape(image_shape, colorspace="RGB") -> tuple:
    """Shape of one image after :func:`convert_colorspace`."""
    h, w, c = (int(d) for d in image_shape)
    return (h, w, 1) if _colorspace_name(colorspace) == "GRAYSCALE" else (h, w, c)


def colorspace_max_norm(image_shape, colorspace="RGB", standardization=None) -> float:
    """Largest norm of an image of ``image_shape`` (RGB or one channel, values in
    ``[0, 1]``) after conversion to ``colorspace``: a public bound, no data involved.

    ``sqrt(h * w) * p`` with ``p`` the largest norm of one converted pixel. Every
    conversion but HSV is affine per pixel, so ``p`` is attained at a corner of the
    colour cube (a convex function's maximum over a polytope): it is computed exactly
    by converting the 8 corners (e.g. ``p = sqrt(3)`` for RGB, so ``sqrt(h w c)``).
    HSV channels all lie in ``[0, 1]``: ``p = sqrt(3)``. One channel: ``p = 1``. The
    result is enlarged by the relative :data:`~lipdp.data.input_bounds.ROUNDING_MARGIN`
    to cover the float32 round-off of the conversions.
    """
    h, w, c = (int(d) for d in image_shape)
    name = _colorspace_name(colorspace)
    if c == 1:
        convert_colorspace(tf.zeros([1, 1, 1, 1]), name)  # refuses unsupported spaces
        pixel = 1.0
    elif name == "HSV":
        pixel = math.sqrt(3.0)
    else:
        corners = np.array(list(itertools.product((0.0, 1.0), repeat=3)))[None, :, None, :]
        converted = convert_colorspace(tf.constant(corners, tf.float64), name, standardization)
        pixel = float(np.max(np.linalg.norm(converted.numpy().reshape(8, -1), axis=-1)))
    return math.sqrt(h * w) * pixel * (1.0 + ROUNDING_MARGIN)


# ------------------------------------------------------------------ augmentation
#: Augmentations applied with ``multiplicity >= 1`` (on the RGB images in ``[0, 1]``,
#: before the colour conversion): ``flip``, a random horizontal flip; ``pad``, a random
#: translation by at most ``pad`` pixels (zero padding of ``pad`` pixels on each side,
#: then a random crop of the original size). Both keep every pixel in the colour cube,
#: so the colour-space bound still holds; a translation can only drop pixels, never
#: increase the norm. Digits are not flipped (a mirrored digit is another symbol).
AUGMENTATIONS = {
    "cifar10": {"flip": True, "pad": 4},
    "fashion_mnist": {"flip": True, "pad": 2},
    "mnist": {"flip": False, "pad": 2},
    "digits": {"flip": False, "pad": 1},
}


def augment_images(images, seed, flip=True, pad=0):
    """Independent random flips and translations of each image of a batch.

    ``seed``: an int64 scalar; stateless random ops make the result a function of it.
    """
    images = tf.convert_to_tensor(images)
    seed = tf.cast(seed, tf.int64)
    if flip:
        images = tf.image.stateless_random_flip_left_right(images, seed=tf.stack([seed, 0]))
    if pad:
        h, w = int(images.shape[1]), int(images.shape[2])
        padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
        offsets = tf.random.stateless_uniform(
            [2, tf.shape(images)[0]],
            seed=tf.stack([seed, 1]),
            minval=0,
            maxval=2 * pad + 1,
            dtype=tf.int32,
        )
        rows = offsets[0][:, None] + tf.range(h)[None, :]
        cols = offsets[1][:, None] + tf.range(w)[None, :]
        images = tf.gather(padded, rows, axis=1, batch_dims=1)
        images = tf.gather(images, cols, axis=2, batch_dims=1)
    return images


# ------------------------------------------------------------------------ images
def load_and_prepare_images_data(
    dataset_name="mnist",
    batch_size=256,
    colorspace="RGB",
    bound_fct=None,
    drop_remainder=True,
    multiplicity=0,
    data_dir=None,
    seed=None,
    standardization=None,
    sampling="shuffle",
):
    """Image data set -> ``(ds_train, ds_test, metadata)``.

    Args:
        dataset_name: ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"`` or ``"digits"``
            (scikit-learn's 8x8 digits). Files are only read locally, from ``data_dir``,
            ``$LIPDP_DATA_DIR``, the Keras cache, TensorFlow Datasets' data directory and
            (Fashion-MNIST) the Debian package; a missing data set raises
            ``FileNotFoundError`` naming these places (:mod:`lipdp.data.sources`).
        batch_size: ``b``, original examples per training batch.
        colorspace: one of :data:`COLORSPACES`.
        bound_fct: ``None``, ``bound_clip_value(c)``, ``bound_normalize()`` (any
            ``(fn, bound)`` pair) or a number ``c`` (same as ``bound_clip_value(c)``);
            applied per image after the colour conversion. ``metadata.max_norm`` is its
            bound; with ``None`` it is :func:`colorspace_max_norm`, the largest norm an
            image can have in that colour space (``sqrt(h w c)`` for RGB), from public
            facts only.
        drop_remainder: drop the last partial training batch (default). With ``False``
            the last batch may be smaller and ``metadata.partial_last_batch`` says so;
            DP training refuses partial batches.
        multiplicity: ``0``: no augmentation. ``m >= 1``: each training batch holds
            ``m`` augmented copies (:data:`AUGMENTATIONS`) of each of its ``b`` examples,
            i.e. ``b * m`` rows with the copies of one example contiguous
            (rows ``i*m .. i*m+m-1``); labels are repeated alike. The model must accept
            ``b * m`` rows while computing sensitivities for ``b`` (the loss averaged over
            the rows is the mean over originals of the mean over their copies).
        data_dir: a directory (or ``.npz`` file) to look in first.
        seed: seed of the shuffle and of the augmentations (``None``: TF's global seed).
        standardization: ``(mean, std)`` for ``"RGB_STANDARDIZED"``, public constants;
            default :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`.
        sampling: ``"shuffle"`` (the original package's fixed-size batches of a shuffle,
            the default of this call form) or ``"poisson"``: each training example joins
            each batch with probability ``b / N``, fresh every step, ``N // b`` steps per
            epoch -- the mechanism the accountant analyses (no augmentation multiplicity,
            no ``drop_remainder``).

    Returns:
        ``ds_train``: a uniform reshuffle of the whole training set every epoch,
        ``nb_steps_per_epochs`` batches of ``(images, one-hot float32 labels)``;
        ``ds_test``: the test set in order, batches of ``batch_size`` (the last one may
        be partial), same colour conversion and bound, no augmentation;
        ``metadata``: :class:`~lipdp.foundation.metadata.DatasetMetadata`.
    """
    name = sources.canonical_name(dataset_name)
    space = _colorspace_name(colorspace)
    multiplicity = count("multiplicity", multiplicity, minimum=0)
    fn, bound = _parse_bound_fct(bound_fct)
    data = sources.load_images(name, data_dir)
    n_train, n_test = len(data.x_train), len(data.x_test)
    batch_size = _check_batch_size(batch_size, n_train)
    raw_shape = data.x_train.shape[1:]
    convert_colorspace(tf.zeros([1, *raw_shape]), space, standardization)  # validates early
    if bound is None:
        bound = colorspace_max_norm(raw_shape, space, standardization)

    augmentation = AUGMENTATIONS[name]

    def prepare(images):
        images = convert_colorspace(images, space, standardization)
        return images if fn is None else fn(images)

    def load(arrays):
        x = tf.constant(arrays[0])
        y = tf.constant(_one_hot(arrays[1], data.nb_classes))

        def gather(indices):
            return tf.gather(x, indices), tf.gather(y, indices)

        return gather

    gather_train = load((data.x_train, data.y_train))
    gather_test = load((data.x_test, data.y_test))

    def train_batch(indices, random_seed):
        images, labels = gather_train(indices)
        if multiplicity:
            images = tf.repeat(images, multiplicity, axis=0)
            labels = tf.repeat(labels, multiplicity, axis=0)
            images = augment_images(images, random_seed, **augmentation)
        return prepare(images), labels

    def test_batch(indices):
        images, labels = gather_test(indices)
        return prepare(images), labels

    validation.choice("sampling", sampling, SAMPLING_MODES)
    if sampling == "poisson" and multiplicity:
        raise ValueError("multiplicity > 0 needs sampling='shuffle' (fixed-size batches).")
    metadata = DatasetMetadata(
        input_shape=colorspace_output_shape(raw_shape, space),
        nb_classes=data.nb_classes,
        nb_samples_train=n_train,
        nb_samples_test=n_test,
        class_names=data.class_names,
        batch_size=batch_size,
        max_norm=float(bound),
        multiplicity=multiplicity,
        partial_last_batch=sampling == "shuffle"
        and _partial_last_batch(n_train, batch_size, drop_remainder),
        sampling=sampling,
    )
    ds_train = _training_batches(metadata, drop_remainder, seed, train_batch)
    ds_test = _ordered_batches(n_test, batch_size, test_batch)
    return ds_train, ds_test.prefetch(tf.data.AUTOTUNE), metadata


#: The name of the original package.
load_and_prepare_data = load_and_prepare_images_data


__all__ = [
    "AUGMENTATIONS",
    "CIFAR10_PUBLISHED_MEAN",
    "CIFAR10_PUBLISHED_STD",
    "COLORSPACES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "augment_images",
    "colorspace_max_norm",
    "colorspace_output_shape",
    "convert_colorspace",
    "load_and_prepare_data",
    "load_and_prepare_images_data",
]
