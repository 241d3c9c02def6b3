"""Couplings that real data triggers and a small probe batch does not (issue 37, item 4).

The independent red team slipped six constructions past the batch-independence probe of
issue 26 (4 rows of ``N(0, 1)``, remove-one on the last row only, one weight point). Each
is written here as a small, seeded Keras layer or loss inside a clipped model
(:class:`lipdp.clipped.model.DPSGD_Sequential`, Poisson metadata, ``b = BATCH``), with a
batch of "real" data that switches the coupling on; :data:`CONSTRUCTIONS` maps a name to
``build(seed) -> Case``. With the probe off (``independence_probe=False``) one real step
on the batch and on the batch minus one row (:mod:`tests.remove_one`) differ by more
than the declared sensitivity: the coupling leaks.

* ``gated-magnitude``: the batch mean subtracted only when ``max |h| > 20`` (large
  activations: unnormalised features, an outlier row);
* ``pixel-max``: inputs divided by the batch maximum only when every input is ``>= 0``
  (pixel data), the probe drawing ``N(0, 1)``;
* ``large-batch``: the batch mean subtracted only for batches of more than 4 rows (the
  probe's);
* ``running-mean``: a running mean of the batch kept in a non-trainable variable assigned
  in ``call`` and subtracted, for batches of more than 4 rows (saved with the model,
  never noised);
* ``gated-sort``: the rows sorted feature by feature over the batch when ``max |h| > 20``;
* ``max-logit-loss``: ungated, each row's loss times ``stop_gradient(max |logits|)`` over
  the batch (the gradient sees nothing; the old probe saw it only when the maximum moved
  in or out of row 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.core.parameters import DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from tests.remove_one import _snapshot

K = keras.layers
BATCH, FEATURES, CLASSES, HIDDEN = 8, 6, 3, 8

#: Activations beyond this switch the magnitude-gated couplings on.
GATE = 20.0


class GatedBatchMean(K.Layer):
    """The identity, but the batch mean is subtracted when ``max |h| > GATE``."""

    def call(self, h):
        on = tf.reduce_max(tf.abs(h)) > GATE
        return tf.where(on, h - tf.reduce_mean(h, axis=0), h)


class PixelMaxScale(K.Layer):
    """Inputs divided by their batch maximum when they are all non-negative (pixels)."""

    def call(self, x):
        on = tf.reduce_all(x >= 0.0)
        return tf.where(on, x / (tf.reduce_max(x) + 1e-6), x)


class LargeBatchMean(K.Layer):
    """The batch mean subtracted for batches of more than 4 rows."""

    def call(self, h):
        on = tf.shape(h)[0] > 4
        return tf.where(on, h - tf.reduce_mean(h, axis=0), h)


class GatedRunningMean(K.Layer):
    """Subtracts a running mean of its inputs, updated in training from batches of more
    than 4 rows and kept in a non-trainable variable."""

    def build(self, shape):
        self.mean = self.add_weight(
            name="running_mean", shape=shape[1:], initializer="zeros", trainable=False
        )

    def call(self, h, training=None):
        if training:
            on = tf.shape(h)[0] > 4
            fresh = 0.5 * self.mean + 0.5 * tf.reduce_mean(h, axis=0)
            self.mean.assign(tf.where(on, fresh, self.mean))
        return h - self.mean


class GatedSort(K.Layer):
    """The rows sorted feature by feature over the batch when ``max |h| > GATE``."""

    def call(self, h):
        on = tf.reduce_max(tf.abs(h)) > GATE
        return tf.where(on, tf.sort(h, axis=0), h)


def max_logit_loss(y, logits):
    """Cross-entropy times ``stop_gradient(max |logits|)`` over the batch: ungated."""
    scale = tf.stop_gradient(tf.reduce_max(tf.abs(logits)))
    return scale * keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


@dataclass
class Case:
    """A model and the batch of real data that switches its coupling on."""

    model: object
    x: np.ndarray
    y: np.ndarray


def _model(layers, loss=None, clip=0.5, input_shape=(FEATURES,), **options):
    metadata = DatasetMetadata(
        input_shape=input_shape,
        nb_classes=CLASSES,
        nb_samples_train=16 * BATCH,
        batch_size=BATCH,
        sampling="poisson",
    )
    model = DPSGD_Sequential(
        layers,
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", clip),
        dataset_metadata=metadata,
        **options,
    )
    model.build((None, *input_shape))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _labels(rng):
    return rng.integers(0, CLASSES, BATCH)


def _outlier_features(rng, scale=100.0):
    """Standardised features and one row far out (row 0)."""
    x = rng.normal(size=(BATCH, FEATURES)).astype("float32")
    x[0] *= scale
    return x


def gated_magnitude(seed, **options):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = [K.Dense(HIDDEN, input_shape=(FEATURES,)), GatedBatchMean(name="gated_mean")]
    model = _model([*layers, K.Dense(CLASSES)], **options)
    return Case(model, _outlier_features(rng), _labels(rng))


def pixel_max(seed, **options):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = [PixelMaxScale(name="pixel_max", input_shape=(FEATURES,)), K.Dense(HIDDEN)]
    model = _model([*layers, K.Activation("tanh"), K.Dense(CLASSES)], **options)
    x = rng.uniform(0.0, 1.0, (BATCH, FEATURES)).astype("float32")
    x[0] = 1.0  # a bright image: the maximum is in row 0, the others are dark
    x[1:] *= 0.2
    return Case(model, x, _labels(rng))


def large_batch(seed, **options):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = [K.Dense(HIDDEN, input_shape=(FEATURES,)), LargeBatchMean(name="large_batch_mean")]
    model = _model([*layers, K.Dense(CLASSES)], **options)
    return Case(model, _outlier_features(rng, 10.0), _labels(rng))


def running_mean(seed, **options):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = [K.Dense(HIDDEN, input_shape=(FEATURES,)), GatedRunningMean(name="running_mean")]
    model = _model([*layers, K.Dense(CLASSES)], **options)
    return Case(model, _outlier_features(rng, 10.0), _labels(rng))


def gated_sort(seed, **options):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = [K.Dense(HIDDEN, input_shape=(FEATURES,)), GatedSort(name="gated_sort")]
    model = _model([*layers, K.Dense(CLASSES)], **options)
    return Case(model, _outlier_features(rng), _labels(rng))


def max_logit(seed, **options):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = [K.Dense(HIDDEN, input_shape=(FEATURES,)), K.Dense(CLASSES)]
    # Rows unclipped without the outlier, clipped with it: the scale moves the release.
    model = _model(layers, loss=max_logit_loss, **{"clip": 30.0, **options})
    return Case(model, _outlier_features(rng, 50.0), _labels(rng))


#: name -> build(seed, **model options) -> Case.
CONSTRUCTIONS = {
    "gated-magnitude": gated_magnitude,
    "pixel-max": pixel_max,
    "large-batch": large_batch,
    "running-mean": running_mean,
    "gated-sort": gated_sort,
    "max-logit-loss": max_logit,
}

#: name -> (path of the coupling layer or loss named by the refusal).
NAMED = {
    "gated-magnitude": "gated_mean",
    "pixel-max": "pixel_max",
    "large-batch": "large_batch_mean",
    "running-mean": "running_mean",
    "gated-sort": "gated_sort",
    "max-logit-loss": "max_logit_loss",
}


def saved_statistic_moves(case) -> float:
    """``running-mean``: how far the saved (never noised) running mean moves when one row
    (the first) is removed from the batch of a real step, probe off: the largest absolute
    difference."""
    model, x, y = case.model, case.x, case.y
    layer = next(layer for layer in model.dp_layers if isinstance(layer, GatedRunningMean))
    model.optimizer.build(model.trainable_variables)
    variables, values = _snapshot(model)
    model.train_on_batch(x, y)
    with_row = layer.mean.numpy().copy()
    for v, value in zip(variables, values):  # the same model, the same running mean
        v.assign(value)
    model.train_on_batch(x[1:], y[1:])
    return float(np.abs(layer.mean.numpy() - with_row).max())


__all__ = ["BATCH", "CONSTRUCTIONS", "Case", "NAMED", "saved_statistic_moves"]
