"""Data: from files on disk to the batches a DP model trains on.

One module per concept; this package re-exports their public names.

* :mod:`lipdp.data.sources`: raw data sets as numpy arrays, from local files only
  (digits, MNIST, Fashion-MNIST, CIFAR-10, ADBench); nothing is downloaded.
* :mod:`lipdp.data.input_bounds`: per-example input-norm bounds (clip, normalise).
* :mod:`lipdp.data.sampling`: how batches are drawn (Poisson sampling, uniform shuffle).
* :mod:`lipdp.data.images`: colour spaces, augmentation and the image pipeline.
* :mod:`lipdp.data.tabular`: feature scaling and the tabular pipeline.

The public facts about a training set that the model and the accountant need
(:class:`~lipdp.foundation.metadata.DatasetMetadata`) live in
:mod:`lipdp.foundation.metadata`, which these modules import; nothing here imports the
model, the layers or the accountant.
"""

# Each submodule's __all__ is its public surface; the package re-exports their union.
from lipdp.data import images, input_bounds, sampling, sources, tabular
from lipdp.data.images import *  # noqa: F403
from lipdp.data.input_bounds import *  # noqa: F403
from lipdp.data.sampling import *  # noqa: F403
from lipdp.data.sources import *  # noqa: F403
from lipdp.data.tabular import *  # noqa: F403

__all__ = sorted(
    {
        name
        for module in (sources, input_bounds, sampling, images, tabular)
        for name in module.__all__
    }
)
