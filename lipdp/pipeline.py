"""Data pipelines: :class:`DatasetMetadata` (the public facts about a training set
that the model and the accountant need), batch samplers, input bounds, and the
preparation of image and tabular data sets.

Images (:func:`load_and_prepare_images_data`): raw images in ``[0, 1]`` (see
:mod:`lipdp.datasets` for where files are looked for; nothing is downloaded) ->
optional augmentation -> colour space -> optional ``bound_fct`` -> batches. Tabular
data (:func:`prepare_tabular_data`): stratified split -> feature scaling -> per-example
norm clipping -> batches.

Training batches are drawn from a uniform shuffle of the *whole* training set every
epoch (a permutation of the example indices; the shuffle buffer holds all ``N``
indices) and have exactly ``batch_size`` examples when ``drop_remainder=True``.
A fixed ``seed`` makes runs reproducible; privacy amplification by subsampling assumes
the sampling randomness is unknown to the adversary, so publish no seed you train with.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from lipdp import datasets as _datasets
from lipdp.datasets import load_adbench_data

logger = logging.getLogger(__name__)

#: How training batches are drawn.
#: ``"shuffle"``: fixed-size batches of a shuffled data set (what most pipelines do);
#: the accountant nevertheless analyses Poisson subsampling, as the original package
#: did (an assumption stated in the privacy report, rule S7).
#: ``"poisson"``: every example enters each batch independently with probability
#: ``q = batch_size / N`` (variable batch sizes): exactly the accounted mechanism.
SAMPLING_MODES = ("shuffle", "poisson")


@dataclass
class DatasetMetadata:
    """Public description of a training set.

    Attributes:
        input_shape: shape of one example.
        nb_classes: number of classes (outputs of the classifier).
        nb_samples_train: ``N``, size of the private training set.
        nb_samples_test: size of the test set.
        class_names: optional names of the classes.
        nb_steps_per_epochs: steps per epoch; computed when omitted: ``N // batch_size``
            with fixed-size batches and the remainder dropped, ``ceil(N / batch_size)``
            when ``partial_last_batch``.
        batch_size: ``b``, the number of (original) training examples in every batch;
            the sensitivity of the averaged gradient is computed for it (rule S5).
        max_norm: the public bound on the norm of one example, if known.
        sampling: ``"shuffle"`` or ``"poisson"`` (:data:`SAMPLING_MODES`); with
            ``"poisson"`` ``batch_size`` is the *expected* batch size ``q N``.
        multiplicity: augmentation multiplicity ``m``. ``0``: no augmentation. ``m >= 1``:
            every batch holds ``m`` augmented copies of each of its ``batch_size``
            examples, ``batch_size * m`` rows, the copies of an example contiguous. The
            DP "example" is still the original image: the loss averaged over the
            ``b * m`` rows is the mean over originals of the mean over their copies, so
            its sensitivity is that of a batch of ``b`` examples (``G / b``).
        partial_last_batch: ``True`` when the last training batch of an epoch has fewer
            than ``batch_size`` examples (``drop_remainder=False`` and ``N % b != 0``).
            DP training refuses such batches (rule S5); for non-private use only.
        notes: assumptions the privacy guarantee does *not* cover, e.g. a preprocessing
            step fitted on the private data (rule S7); privacy reports should list them.
    """

    input_shape: tuple
    nb_classes: int
    nb_samples_train: int
    nb_samples_test: int = 0
    class_names: list = field(default_factory=list)
    nb_steps_per_epochs: int | None = None
    batch_size: int = 1
    max_norm: float | None = None
    sampling: str = "shuffle"
    multiplicity: int = 0
    partial_last_batch: bool = False
    notes: list = field(default_factory=list)

    def __post_init__(self):
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {self.sampling!r}.")
        self.input_shape = tuple(int(d) for d in self.input_shape)
        if int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}.")
        if int(self.nb_samples_train) < 1:
            raise ValueError(f"nb_samples_train must be >= 1, got {self.nb_samples_train}.")
        if self.batch_size > self.nb_samples_train:
            raise ValueError(
                f"batch_size ({self.batch_size}) is larger than the training set "
                f"({self.nb_samples_train} examples)."
            )
        if int(self.multiplicity) != self.multiplicity or self.multiplicity < 0:
            raise ValueError(f"multiplicity must be an integer >= 0, got {self.multiplicity}.")
        self.multiplicity = int(self.multiplicity)
        self.partial_last_batch = bool(self.partial_last_batch)
        if self.nb_steps_per_epochs is None:
            if self.partial_last_batch:
                self.nb_steps_per_epochs = -(-self.nb_samples_train // self.batch_size)
            else:
                self.nb_steps_per_epochs = self.nb_samples_train // self.batch_size
        self.class_names = list(self.class_names)
        self.notes = list(self.notes)

    @property
    def sampling_rate(self) -> float:
        """``q = b / N``, the rate used for privacy amplification by subsampling."""
        return self.batch_size / self.nb_samples_train

    @property
    def nb_dropped_per_epoch(self) -> int:
        return max(0, self.nb_samples_train - self.nb_steps_per_epochs * self.batch_size)

    @property
    def rows_per_batch(self) -> int:
        """Rows of a full training batch: ``batch_size * max(1, multiplicity)``."""
        return self.batch_size * max(1, self.multiplicity)

    def to_config(self) -> dict:
        return {
            "input_shape": list(self.input_shape),
            "nb_classes": self.nb_classes,
            "nb_samples_train": self.nb_samples_train,
            "nb_samples_test": self.nb_samples_test,
            "class_names": list(self.class_names),
            "nb_steps_per_epochs": self.nb_steps_per_epochs,
            "batch_size": self.batch_size,
            "max_norm": self.max_norm,
            "sampling": self.sampling,
            "multiplicity": self.multiplicity,
            "partial_last_batch": self.partial_last_batch,
            "notes": list(self.notes),
        }


def poisson_batches(x, y, sampling_rate, steps_per_epoch, seed=None) -> tf.data.Dataset:
    """Batches drawn by Poisson sampling: each example enters each batch independently
    with probability ``sampling_rate``, fresh randomness every step and every epoch.

    This is the sampling the accountant analyses (amplification by subsampling with
    rate ``q``); use it with ``DatasetMetadata(sampling="poisson")``. Batch sizes are
    random (possibly 0); the model divides the summed loss by the expected size.
    """
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")
    x = tf.convert_to_tensor(x)
    y = tf.convert_to_tensor(y)
    n = int(x.shape[0])
    if int(y.shape[0]) != n:
        raise ValueError(f"x has {n} examples but y has {int(y.shape[0])}.")

    def draw(step_seed):
        keep = tf.random.stateless_uniform([n], seed=tf.stack([step_seed, 0])) < sampling_rate
        return tf.boolean_mask(x, keep), tf.boolean_mask(y, keep)

    # Dataset.random re-draws its seeds at every iteration (every epoch).
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
    return seeds.take(int(steps_per_epoch)).map(draw)


# ----------------------------------------------------------------- input bounds
#: Relative margin below the target norm used by the bound functions, and above the
#: exact bound by :func:`colorspace_max_norm`: rounding a float64 result to float32
#: changes each coordinate by a relative 2**-24 at most, so a float32 example rescaled
#: in float64 to ``(1 - ROUNDING_MARGIN) * bound`` has a norm ``<= bound`` exactly.
ROUNDING_MARGIN = 2.0**-20


def _per_example_norms(x: tf.Tensor) -> tf.Tensor:
    """Euclidean norm of each example (over all non-batch axes), broadcastable to ``x``."""
    if x.shape.rank is None or x.shape.rank < 1:
        raise ValueError("bound functions expect a batch: a tensor of rank >= 1.")
    axes = list(range(1, x.shape.rank))
    return tf.sqrt(tf.reduce_sum(tf.square(x), axis=axes, keepdims=True))


def _check_positive(name, value) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}.")
    return value


def _rescale(x, target, only_shrink):
    """Examples of ``x`` rescaled to norm ``target`` (or left alone if already below
    and ``only_shrink``), computed in float64 with :data:`ROUNDING_MARGIN`."""
    x = tf.convert_to_tensor(x)
    wide = tf.cast(x, tf.float64)
    norms = _per_example_norms(wide)
    scale = tf.math.divide_no_nan(tf.constant(target * (1.0 - ROUNDING_MARGIN), tf.float64), norms)
    if only_shrink:
        scale = tf.where(norms > target, scale, tf.ones_like(scale))
    return tf.cast(wide * scale, x.dtype)


def bound_clip_value(value):
    """``(fn, value)``: ``fn`` scales every example whose norm exceeds ``value`` down to
    norm ``value`` (others are unchanged).

    ``fn`` takes a *batch* (axis 0 indexes examples; the norm is over all other axes)
    and returns it clipped; called as ``fn(x, y, ...)`` it returns ``(fn(x), y, ...)``
    so that it can be mapped over a batched ``tf.data`` pipeline (never over single
    examples: their first axis would be taken as the batch). Clipped examples get the
    norm ``value * (1 - ROUNDING_MARGIN)``, so that norms are ``<= value`` even after
    rounding to float32.
    """
    value = _check_positive("value", value)

    def clip(x, *rest):
        clipped = _rescale(x, value, only_shrink=True)
        return (clipped, *rest) if rest else clipped

    return clip, value


def bound_normalize():
    """``(fn, 1.0)``: ``fn`` divides each example of a batch by its norm (examples of
    norm 0 stay 0; norms become ``1 - ROUNDING_MARGIN``); same calling convention as
    :func:`bound_clip_value`."""

    def normalize(x, *rest):
        out = _rescale(x, 1.0, only_shrink=False)
        return (out, *rest) if rest else out

    return normalize, 1.0


def _parse_bound_fct(bound_fct):
    """``None``, a number (clip to it) or a ``(fn, bound)`` pair -> ``(fn, bound)``."""
    if bound_fct is None:
        return None, None
    if isinstance(bound_fct, (int, float, np.floating, np.integer)) and not isinstance(
        bound_fct, bool
    ):
        return bound_clip_value(bound_fct)
    if isinstance(bound_fct, (tuple, list)) and len(bound_fct) == 2 and callable(bound_fct[0]):
        return bound_fct[0], _check_positive("the bound of bound_fct", bound_fct[1])
    raise TypeError(
        "bound_fct must be None, a positive number, or a (fn, bound) pair such as "
        f"bound_clip_value(1.0) or bound_normalize(); got {bound_fct!r}."
    )


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
    result is enlarged by the relative :data:`ROUNDING_MARGIN` to cover the float32
    round-off of the conversions.
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


# --------------------------------------------------------------------- batching
def _check_batch_size(batch_size, n) -> int:
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size}.")
    if batch_size > n:
        raise ValueError(f"batch_size ({batch_size}) is larger than the training set ({n}).")
    return int(batch_size)


def _shuffled_batches(n, batch_size, drop_remainder, seed, make_batch) -> tf.data.Dataset:
    """Batches of a fresh uniform permutation of ``range(n)`` every epoch, mapped by
    ``make_batch(indices, random_seed)`` (a per-batch int64 seed, fresh every epoch)."""
    indices = tf.data.Dataset.range(n).shuffle(n, seed=seed, reshuffle_each_iteration=True)
    indices = indices.batch(batch_size, drop_remainder=drop_remainder)
    seeds = tf.data.Dataset.random(
        seed=None if seed is None else seed + 1, rerandomize_each_iteration=True
    )
    batches = tf.data.Dataset.zip((indices, seeds))
    return batches.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _ordered_batches(n, batch_size, make_batch) -> tf.data.Dataset:
    indices = tf.data.Dataset.range(n).batch(batch_size)
    return indices.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _one_hot(labels, nb_classes) -> np.ndarray:
    return np.eye(nb_classes, dtype="float32")[np.asarray(labels, dtype="int64")]


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
):
    """Image data set -> ``(ds_train, ds_test, metadata)``.

    Args:
        dataset_name: ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"`` or ``"digits"``
            (scikit-learn's 8x8 digits). Files are only read locally, from ``data_dir``,
            ``$LIPDP_DATA_DIR``, the Keras cache, TensorFlow Datasets' data directory and
            (Fashion-MNIST) the Debian package; a missing data set raises
            ``FileNotFoundError`` naming these places (:mod:`lipdp.datasets`).
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

    Returns:
        ``ds_train``: a uniform reshuffle of the whole training set every epoch,
        ``nb_steps_per_epochs`` batches of ``(images, one-hot float32 labels)``;
        ``ds_test``: the test set in order, batches of ``batch_size`` (the last one may
        be partial), same colour conversion and bound, no augmentation;
        ``metadata``: :class:`DatasetMetadata`.
    """
    name = _datasets.canonical_name(dataset_name)
    space = _colorspace_name(colorspace)
    if int(multiplicity) != multiplicity or multiplicity < 0:
        raise ValueError(f"multiplicity must be an integer >= 0, got {multiplicity}.")
    multiplicity = int(multiplicity)
    fn, bound = _parse_bound_fct(bound_fct)
    data = _datasets.load_images(name, data_dir)
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

    ds_train = _shuffled_batches(n_train, batch_size, drop_remainder, seed, train_batch)
    ds_test = _ordered_batches(n_test, batch_size, test_batch)
    partial = (not drop_remainder) and n_train % batch_size != 0
    metadata = DatasetMetadata(
        input_shape=colorspace_output_shape(raw_shape, space),
        nb_classes=data.nb_classes,
        nb_samples_train=n_train,
        nb_samples_test=n_test,
        class_names=data.class_names,
        batch_size=batch_size,
        max_norm=float(bound),
        multiplicity=multiplicity,
        partial_last_batch=partial,
    )
    return ds_train.prefetch(tf.data.AUTOTUNE), ds_test.prefetch(tf.data.AUTOTUNE), metadata


#: The name of the original package.
load_and_prepare_data = load_and_prepare_images_data


# ----------------------------------------------------------------------- tabular
#: Feature scalings of :func:`prepare_tabular_data`.
TABULAR_SCALINGS = ("ranges", "none", "standardize")


def _feature_ranges(feature_ranges, d):
    low, high = (np.broadcast_to(np.asarray(v, "float64"), (d,)) for v in feature_ranges)
    if not np.all(np.isfinite(low) & np.isfinite(high) & (high > low)):
        raise ValueError("feature_ranges must be finite (low, high) with high > low per feature.")
    return low, high


def prepare_tabular_data(
    x,
    y,
    test_size=0.2,
    batch_size=256,
    bound_fct=None,
    seed=0,
    drop_remainder=True,
    *,
    scaling=None,
    feature_ranges=None,
    one_hot=True,
    shuffle_seed=None,
):
    """Tabular data ``(x, y)`` -> ``(ds_train, ds_test, metadata)``.

    1. Stratified split (scikit-learn, ``random_state=seed``); ``len(test) =
       ceil(test_size * n)`` for a fraction.
    2. Feature scaling, ``scaling`` one of :data:`TABULAR_SCALINGS`:

       * ``"ranges"`` (sound; the default when ``feature_ranges`` is given): each
         feature is clipped to its *public* range ``feature_ranges = (low, high)``
         (scalars or one value per feature, from domain knowledge or a data
         dictionary -- not from the private data) and mapped affinely to ``[-1, 1]``.
         No private statistic is used, and every example has norm ``<= sqrt(d)``.
       * ``"none"``: features are used as given.
       * ``"standardize"``: mean and standard deviation of every feature, fitted on
         the *training split only* (the test split does not influence them).
         **Non-private**: these statistics of the private training set are not
         released through a DP mechanism, so the (epsilon, delta) guarantee does not
         cover them (rule S6). ``metadata.notes`` records it, a warning is logged.
         For a comparison with published results only.

       With neither ``scaling`` nor ``feature_ranges`` a ``ValueError`` asks for a choice.
    3. Per-example norm bound: ``bound_fct`` is ``None``, a number ``c`` (each example
       clipped to norm ``c``) or a ``(fn, bound)`` pair (:func:`bound_clip_value`,
       :func:`bound_normalize`). ``None`` is allowed with ``"ranges"`` only (bound
       ``sqrt(d)``); the other scalings have no public bound and need one.

    The set of label values (``np.unique(y)``) is treated as public. Labels are one-hot
    float32 (``one_hot=True``) or class indices as a float32 column ``(n, 1)``.
    ``shuffle_seed`` seeds the per-epoch shuffle of the training set.
    """
    from sklearn.model_selection import train_test_split

    x = np.asarray(x, dtype="float32")
    if x.ndim != 2:
        raise ValueError(f"x must have shape (n, d), got {x.shape}.")
    y = np.asarray(y).reshape(-1)
    if len(y) != len(x):
        raise ValueError(f"x has {len(x)} rows but y has {len(y)} labels.")
    d = x.shape[1]
    if scaling is None:
        if feature_ranges is None:
            raise ValueError(
                "Choose a feature scaling: feature_ranges=(low, high) with public ranges "
                "(sound), scaling='none', or scaling='standardize' (fitted on the private "
                "training split: not covered by the DP guarantee)."
            )
        scaling = "ranges"
    if scaling not in TABULAR_SCALINGS:
        raise ValueError(f"scaling must be one of {TABULAR_SCALINGS}, got {scaling!r}.")
    if (scaling == "ranges") != (feature_ranges is not None):
        raise ValueError("feature_ranges is required with scaling='ranges' and only then.")
    fn, bound = _parse_bound_fct(bound_fct)
    if bound is None and scaling != "ranges":
        raise ValueError(
            f"With scaling={scaling!r} the norm of an example has no public bound: pass "
            "bound_fct=c (clip every example to norm c) or a (fn, bound) pair."
        )

    classes = np.unique(y)
    labels = np.searchsorted(classes, y)
    x_train, x_test, y_train, y_test = train_test_split(
        x, labels, test_size=test_size, random_state=seed, stratify=labels
    )
    notes = []
    if scaling == "ranges":
        low, high = _feature_ranges(feature_ranges, d)

        def scale(v):
            v = np.clip(v.astype("float64"), low, high)
            return (2.0 * (v - low) / (high - low) - 1.0).astype("float32")

        x_train, x_test = scale(x_train), scale(x_test)
        if bound is None:
            bound = math.sqrt(d)
    elif scaling == "standardize":
        mean = x_train.astype("float64").mean(axis=0)
        std = x_train.astype("float64").std(axis=0)
        std = np.where(std > 0, std, 1.0)
        x_train = ((x_train - mean) / std).astype("float32")
        x_test = ((x_test - mean) / std).astype("float32")
        note = (
            "non-private preprocessing: features standardised with the mean and standard "
            "deviation of the private training split; the (epsilon, delta) guarantee does "
            "not cover these statistics."
        )
        notes.append(note)
        logger.warning(note)
    if fn is not None:
        x_train = np.asarray(fn(tf.constant(x_train)))
        x_test = np.asarray(fn(tf.constant(x_test)))

    nb_classes = len(classes)
    if one_hot:
        y_train, y_test = _one_hot(y_train, nb_classes), _one_hot(y_test, nb_classes)
    else:
        y_train = y_train.astype("float32")[:, None]
        y_test = y_test.astype("float32")[:, None]
    n_train = len(x_train)
    batch_size = _check_batch_size(batch_size, n_train)
    tensors = {
        "train": (tf.constant(x_train), tf.constant(y_train)),
        "test": (tf.constant(x_test), tf.constant(y_test)),
    }

    def gather(split):
        xs, ys = tensors[split]
        return lambda indices, *_: (tf.gather(xs, indices), tf.gather(ys, indices))

    ds_train = _shuffled_batches(n_train, batch_size, drop_remainder, shuffle_seed, gather("train"))
    ds_test = _ordered_batches(len(x_test), batch_size, gather("test"))
    metadata = DatasetMetadata(
        input_shape=(d,),
        nb_classes=nb_classes,
        nb_samples_train=n_train,
        nb_samples_test=len(x_test),
        class_names=[str(c) for c in classes],
        batch_size=batch_size,
        max_norm=float(bound),
        partial_last_batch=(not drop_remainder) and n_train % batch_size != 0,
        notes=notes,
    )
    return ds_train.prefetch(tf.data.AUTOTUNE), ds_test.prefetch(tf.data.AUTOTUNE), metadata


__all__ = [
    "AUGMENTATIONS",
    "COLORSPACES",
    "SAMPLING_MODES",
    "DatasetMetadata",
    "augment_images",
    "bound_clip_value",
    "bound_normalize",
    "colorspace_max_norm",
    "colorspace_output_shape",
    "convert_colorspace",
    "load_adbench_data",
    "load_and_prepare_data",
    "load_and_prepare_images_data",
    "poisson_batches",
    "prepare_tabular_data",
]
