r"""Poisson batches for the JAX step, in numpy: :class:`PoissonBatches`.

Each step keeps every record independently with probability ``q = b / N`` (the
mechanism the accountant analyses), from a numpy generator seeded by the operating
system (rule S8: nobody can reproduce which records were sampled), fresh at every step
and every epoch.

**Padding.** A Poisson batch has a random number of rows, and ``jax.jit`` compiles one
program per shape. So a batch of ``n`` sampled rows is padded with zero rows to a size
from a short list -- ``P = b + 3 sqrt(b)`` rounded up to a multiple of ``multiple`` when
``n <= P`` (about 99.9 % of the steps), else ``n`` rounded up to a multiple of
``ceil(sqrt(b))`` -- and each row carries a weight, 1 for a sampled row and 0 for
padding, given to Keras as the sample weight. The JAX step reads the weight as a row mask
(:mod:`lipdp.clipped.jax.model`): a padding row contributes nothing, a sampled row its
clipped gradient. Whether and how much a batch is padded depends on ``n``, which the step
does not release: only the noisy average, divided by ``b`` whatever ``n`` is, leaves it.
``multiple``: the number of data-parallel devices times 8 (Keras shards a batch evenly).
"""

from __future__ import annotations

import math
import secrets

import keras
import numpy as np

from lipdp.foundation.validation import count, probability


def padded_size(rows: int, batch_size: int, multiple: int = 8) -> int:
    """The padded size of a batch of ``rows`` sampled rows (module docstring)."""
    usual = _round_up(batch_size + 3.0 * math.sqrt(batch_size), multiple)
    if rows <= usual:
        return usual
    return _round_up(rows, math.lcm(multiple, math.ceil(math.sqrt(batch_size))))


def _round_up(value, multiple) -> int:
    return int(math.ceil(value / multiple) * multiple)


class PoissonBatches(keras.utils.PyDataset):
    """``steps_per_epoch`` Poisson batches of ``(x, y)`` at rate ``sampling_rate`` per epoch,
    padded, with 0/1 row weights: ``(x, y, weights)`` (module docstring).

    Args:
        x, y: numpy arrays (or nests of arrays for ``x``) with the records first.
        sampling_rate: ``q``.
        steps_per_epoch: batches per epoch (the model's ``nb_steps_per_epochs``).
        batch_size: ``b``, the expected batch size (padding sizes).
        multiple: padded sizes are multiples of it.
        seed: ``None`` (default): the operating system's entropy. An int makes the
            sampling reproducible -- for debugging only (amplification by subsampling
            assumes the sampling is secret).
    """

    def __init__(self, x, y, sampling_rate, steps_per_epoch, batch_size, multiple=8, seed=None):
        super().__init__()
        self.x = keras.tree.map_structure(np.asarray, x)
        self.y = np.asarray(y)
        self.n = len(keras.tree.flatten(self.x)[0])
        if len(self.y) != self.n:
            raise ValueError(f"x has {self.n} examples but y has {len(self.y)}.")
        self.sampling_rate = probability("sampling_rate", sampling_rate)
        self.steps_per_epoch = count("steps_per_epoch", steps_per_epoch, minimum=1)
        self.batch_size = count("batch_size", batch_size, minimum=1)
        self.multiple = count("multiple", multiple, minimum=1)
        self.reproducible = seed is not None
        self._rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __getitem__(self, index):
        """A fresh Poisson batch (whatever ``index``: every draw is independent)."""
        kept = np.flatnonzero(self._rng.random(self.n) < self.sampling_rate)
        size = padded_size(len(kept), self.batch_size, self.multiple)
        weights = np.zeros(size, np.float32)
        weights[: len(kept)] = 1.0

        def padded(array):
            out = np.zeros((size,) + array.shape[1:], array.dtype)
            out[: len(kept)] = array[kept]
            return out

        return keras.tree.map_structure(padded, self.x), padded(self.y), weights


__all__ = ["PoissonBatches", "padded_size", "data_parallel_devices"]


def data_parallel_devices() -> int:
    """Devices a Keras 3 distribution shards the batch over (1 without one)."""
    import keras

    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return int(distribution.device_mesh.devices.size)
