"""Former home of the data pipelines; every name it held is still importable from here.

The code now lives, one module per concept, in :mod:`lipdp.data`:

* :class:`~lipdp.metadata.DatasetMetadata`, :data:`~lipdp.metadata.SAMPLING_MODES`,
  :func:`~lipdp.metadata.default_delta_value`: :mod:`lipdp.metadata`;
* :func:`~lipdp.data.sampling.poisson_batches` and the uniform-shuffle batching:
  :mod:`lipdp.data.sampling`;
* :func:`~lipdp.data.input_bounds.bound_clip_value`,
  :func:`~lipdp.data.input_bounds.bound_normalize`,
  :data:`~lipdp.data.input_bounds.ROUNDING_MARGIN`: :mod:`lipdp.data.input_bounds`;
* colour spaces, augmentation and
  :func:`~lipdp.data.images.load_and_prepare_images_data` (alias
  ``load_and_prepare_data``): :mod:`lipdp.data.images`;
* :func:`~lipdp.data.tabular.prepare_tabular_data`, :data:`~lipdp.data.tabular.TABULAR_SCALINGS`
  and :func:`~lipdp.data.sources.load_adbench_data`: :mod:`lipdp.data.tabular`.

New code should import from those modules.
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
from lipdp.data.tabular import TABULAR_SCALINGS, load_adbench_data, prepare_tabular_data
from lipdp.metadata import SAMPLING_MODES, DatasetMetadata, default_delta_value

__all__ = [
    "AUGMENTATIONS",
    "CIFAR10_PUBLISHED_MEAN",
    "CIFAR10_PUBLISHED_STD",
    "COLORSPACES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ROUNDING_MARGIN",
    "SAMPLING_MODES",
    "TABULAR_SCALINGS",
    "DatasetMetadata",
    "augment_images",
    "bound_clip_value",
    "bound_normalize",
    "colorspace_max_norm",
    "colorspace_output_shape",
    "convert_colorspace",
    "default_delta_value",
    "load_adbench_data",
    "load_and_prepare_data",
    "load_and_prepare_images_data",
    "poisson_batches",
    "prepare_tabular_data",
]
