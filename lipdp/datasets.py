"""Former home of the offline raw loaders, now :mod:`lipdp.data.sources`.

Every public name is re-exported, so ``from lipdp.datasets import load_digits`` and
``lipdp.datasets.load_fashion_mnist()`` keep working. Module-level settings are read by
:mod:`lipdp.data.sources`: to change one (e.g. ``DEBIAN_FASHION_MNIST`` in a test),
set it there, not here.
"""

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
]
