"""The public facts about a training set that the model and the accountant need.

This module imports nothing else of lipdp: models, accountants, pipelines, callbacks and
the command line all read the *same* step, epoch and normaliser arithmetic from here.

Three numbers are easy to mix up, so each is defined once:

* ``batch_size`` ``b``: original training examples per batch (the *expected* number under
  Poisson sampling). Sensitivities of the averaged gradient are ``bound / b`` (rule S5)
  and the sampling rate is ``q = b / N``.
* ``loss_normalizer``: what the summed per-row loss of one batch is divided by. With
  augmentation multiplicity ``m`` a batch holds ``b * m`` rows and the loss is their mean,
  so the normaliser is ``b * m``; it is ``b`` otherwise (and under Poisson sampling,
  where the actual batch size is random). :class:`~lipdp.clipless.layers.DP_ClipGradient`,
  the diagnostics and the dynamic clipping all clip or measure in these units.
* ``nb_steps_per_epochs``: noisy steps per epoch; :meth:`DatasetMetadata.steps_for_epochs`
  and :meth:`DatasetMetadata.epochs_for_steps` convert between steps and epochs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lipdp.foundation.config import Config

#: How training batches are drawn.
#: ``"shuffle"``: fixed-size batches of a shuffled data set (what most pipelines do);
#: the accountant nevertheless analyses Poisson subsampling, as the original package
#: did (an assumption stated in the privacy report, rule S7).
#: ``"poisson"``: every example enters each batch independently with probability
#: ``q = batch_size / N`` (variable batch sizes): exactly the accounted mechanism.
SAMPLING_MODES = ("shuffle", "poisson")


def _whole(name, value, minimum) -> int:
    # Kept local on purpose: this module depends on nothing else of lipdp.
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _example_shape(shape) -> tuple:
    """``shape`` as a tuple of ints, or (several inputs) a tuple of such tuples."""
    shape = tuple(shape)
    if shape and all(isinstance(s, (tuple, list)) for s in shape):
        return tuple(tuple(int(d) for d in s) for s in shape)
    return tuple(int(d) for d in shape)


def steps_per_epoch(nb_samples: int, batch_size: int, partial_last_batch: bool = False) -> int:
    """Steps of one epoch: ``N // b`` when the partial last batch is dropped (every DP
    run), ``ceil(N / b)`` when it is kept (``partial_last_batch``, non-private use)."""
    nb_samples = _whole("nb_samples", nb_samples, 1)
    batch_size = _whole("batch_size", batch_size, 1)
    if partial_last_batch:
        return -(-nb_samples // batch_size)
    return nb_samples // batch_size


@dataclass(frozen=True)
class DatasetMetadata(Config):
    """Public description of a training set.

    Attributes:
        input_shape: shape of one example; for a model of several inputs, a tuple of
            shapes, one per input (in the order of the model's ``inputs``).
        nb_classes: number of classes (outputs of the classifier).
        nb_samples_train: ``N``, size of the private training set.
        nb_samples_test: size of the test set.
        class_names: optional names of the classes.
        nb_steps_per_epochs: steps per epoch; :func:`steps_per_epoch` when omitted.
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
            step fitted on the private data (rule S7); privacy reports list them.

    Immutable: models, plans and callbacks read the same instance, so a value changed
    after a plan was made would make the plan wrong. Use ``dataclasses.replace``.
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
        self._set("input_shape", _example_shape(self.input_shape))
        self._set("batch_size", _whole("batch_size", self.batch_size, 1))
        self._set("nb_samples_train", _whole("nb_samples_train", self.nb_samples_train, 1))
        if self.batch_size > self.nb_samples_train:
            raise ValueError(
                f"batch_size ({self.batch_size}) is larger than the training set "
                f"({self.nb_samples_train} examples)."
            )
        self._set("multiplicity", _whole("multiplicity", self.multiplicity, 0))
        self._set("partial_last_batch", bool(self.partial_last_batch))
        if self.nb_steps_per_epochs is None:
            steps = steps_per_epoch(self.nb_samples_train, self.batch_size, self.partial_last_batch)
            self._set("nb_steps_per_epochs", steps)
        steps = _whole("nb_steps_per_epochs", self.nb_steps_per_epochs, 1)
        self._set("nb_steps_per_epochs", steps)
        self._set("class_names", list(self.class_names))
        self._set("notes", list(self.notes))

    # ------------------------------------------------------------------ sampling
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

    @property
    def loss_normalizer(self) -> int:
        """What the summed per-row loss of a batch is divided by (module docstring).

        ``rows_per_batch`` for fixed-size batches (``b * m`` rows with multiplicity
        ``m``); the expected batch size ``b`` under Poisson sampling (where
        multiplicity is refused, so this is ``rows_per_batch`` too).
        """
        return self.rows_per_batch

    # ------------------------------------------------------------ steps and epochs
    def steps_for_epochs(self, epochs: int) -> int:
        """Noisy steps of ``epochs`` epochs: ``epochs * nb_steps_per_epochs``."""
        return _whole("epochs", epochs, 0) * self.nb_steps_per_epochs

    def epochs_for_steps(self, steps: int) -> int:
        """Epochs *begun* after ``steps`` steps: ``ceil(steps / nb_steps_per_epochs)``.

        Accounting counts a partial epoch as a whole one: ``epsilon`` is non-decreasing in
        the number of releases, so this is an upper bound on the spent budget.
        """
        return math.ceil(_whole("steps", steps, 0) / self.nb_steps_per_epochs)


def default_delta_value(dataset_metadata: DatasetMetadata) -> float:
    """``delta = 1 / 10^k`` with ``10^k`` the smallest power of ten *above* ``N``.

    The policy of the original package (``10^ceil(log10 N)``), except that a training set
    whose size is exactly a power of ten gets ``1 / (10 N)`` rather than ``1 / N``: the
    usual requirement is ``delta < 1 / N`` (a mechanism that publishes one random record
    is ``(0, 1/N)``-DP). ``N = 60 000`` gives ``1e-5`` in both.
    """
    n = _whole("nb_samples_train", dataset_metadata.nb_samples_train, 1)
    exponent = len(str(n))  # 10^(digits of n) is the smallest power of ten > n
    return float(10.0**-exponent)


__all__ = ["SAMPLING_MODES", "DatasetMetadata", "default_delta_value", "steps_per_epoch"]
