"""Data pipelines: :class:`DatasetMetadata` (the public facts about a training set
that the model and the accountant need) and batch samplers."""

from __future__ import annotations

from dataclasses import dataclass, field

import tensorflow as tf

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
        nb_steps_per_epochs: steps per epoch (``N // batch_size`` with fixed-size
            batches and the remainder dropped); computed when omitted.
        batch_size: ``b``, the size of every training batch; the sensitivity of the
            averaged gradient is computed for it (rule S5).
        max_norm: the public bound on the norm of one example, if known.
        sampling: ``"shuffle"`` or ``"poisson"`` (:data:`SAMPLING_MODES`); with
            ``"poisson"`` ``batch_size`` is the *expected* batch size ``q N``.
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
        if self.nb_steps_per_epochs is None:
            self.nb_steps_per_epochs = self.nb_samples_train // self.batch_size
        self.class_names = list(self.class_names)

    @property
    def sampling_rate(self) -> float:
        """``q = b / N``, the rate used for privacy amplification by subsampling."""
        return self.batch_size / self.nb_samples_train

    @property
    def nb_dropped_per_epoch(self) -> int:
        return self.nb_samples_train - self.nb_steps_per_epochs * self.batch_size

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
