"""Former home of the data pipelines; every name it held is still importable from here.

The code now lives, one module per concept, in :mod:`lipdp.data`:

* :class:`~lipdp.foundation.metadata.DatasetMetadata`,
  :data:`~lipdp.foundation.metadata.SAMPLING_MODES`,
  :func:`~lipdp.foundation.metadata.default_delta_value`: :mod:`lipdp.foundation.metadata`;
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

from lipdp.data import images, input_bounds, sampling, tabular
from lipdp.data.images import *  # noqa: F403  (the re-export is the point)
from lipdp.data.input_bounds import *  # noqa: F403
from lipdp.data.sampling import *  # noqa: F403
from lipdp.data.tabular import *  # noqa: F403
from lipdp.foundation.metadata import SAMPLING_MODES, DatasetMetadata, default_delta_value  # noqa: F401

__all__ = sorted(
    {name for module in (images, input_bounds, sampling, tabular) for name in module.__all__}
    | {"SAMPLING_MODES", "DatasetMetadata", "default_delta_value"}
)
