"""Data: from files on disk to the batches a DP model trains on.

One module per concept; this package re-exports their public names.

* :mod:`lipdp.data.sources`: raw data sets as numpy arrays, from local files only
  (digits, MNIST, Fashion-MNIST, CIFAR-10, ADBench); nothing is downloaded.
* :mod:`lipdp.data.input_bounds`: per-example input-norm bounds (clip, normalise).
* :mod:`lipdp.data.sampling`: how batches are drawn (Poisson sampling, uniform shuffle).
* :mod:`lipdp.data.images`: colour spaces, augmentation and the image pipeline.
* :mod:`lipdp.data.tabular`: feature scaling and the tabular pipeline.

The public facts about a training set that the model and the accountant need
(:class:`~lipdp.metadata.DatasetMetadata`) live in :mod:`lipdp.metadata`, which these
modules import; nothing here imports the model, the layers or the accountant.
"""

from lipdp.data.images import (
    AUGMENTATIONS,
    CIFAR10_PUBLISHED_MEAN,
    CIFAR10_PUBLISHED_STD,
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
from lipdp.data.input_bounds import ROUNDING_MARGIN, bound_clip_value, bound_normalize
from lipdp.data.sampling import poisson_batches
from lipdp.data.sources import (
    CIFAR10_CLASSES,
    DEBIAN_FASHION_MNIST,
    FASHION_MNIST_CLASSES,
    IDX_STEMS,
    IMAGE_DATASETS,
    MNIST_CLASSES,
    SHARED_DATA_DIR,
    ArrayDataset,
    adbench_dirs,
    canonical_name,
    keras_cache_dirs,
    load_adbench_data,
    load_cifar10,
    load_digits,
    load_fashion_mnist,
    load_images,
    load_mnist,
    read_idx,
)
from lipdp.data.tabular import TABULAR_SCALINGS, prepare_tabular_data

__all__ = [
    "CIFAR10_CLASSES",
    "DEBIAN_FASHION_MNIST",
    "FASHION_MNIST_CLASSES",
    "IDX_STEMS",
    "IMAGE_DATASETS",
    "MNIST_CLASSES",
    "SHARED_DATA_DIR",
    "ArrayDataset",
    "adbench_dirs",
    "canonical_name",
    "keras_cache_dirs",
    "load_adbench_data",
    "load_cifar10",
    "load_digits",
    "load_fashion_mnist",
    "load_images",
    "load_mnist",
    "read_idx",
    "ROUNDING_MARGIN",
    "bound_clip_value",
    "bound_normalize",
    "poisson_batches",
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
    "TABULAR_SCALINGS",
    "prepare_tabular_data",
]
