"""The red team's six couplings of ``tests/couplings.py`` (issue 37), written with
``keras.ops`` for the JAX backend (``tests/couplings.py`` is TensorFlow code): the same
layers, gates, losses and batches of real data that switch them on, in networks of
``tests/clipped/jax/helpers.py``'s sizes. :data:`CONSTRUCTIONS` maps a name to ``build(seed) ->
Case``; ``Case.coupling(x)`` applies the coupling layer to a whole batch, to show that
the batch switches it on (it mixes the rows there).
"""

from __future__ import annotations

from dataclasses import dataclass

import keras
import numpy as np
from keras import ops

from tests.clipped.jax import helpers as h

K = keras.layers
HIDDEN = 8
BATCH = 8

#: Activations beyond this switch the magnitude-gated couplings on.
GATE = 20.0


def _rows(x) -> int:
    """The number of rows (static in a JAX step; Keras infers the output shape by
    :meth:`_SameShape.compute_output_shape`, not by a call on symbolic rows)."""
    return x.shape[0]


class _SameShape(K.Layer):
    def compute_output_shape(self, shape):
        return shape


class GatedBatchMean(_SameShape):
    """The identity, but the batch mean is subtracted when ``max |h| > GATE``."""

    def call(self, x):
        on = ops.max(ops.abs(x)) > GATE
        return ops.where(on, x - ops.mean(x, axis=0), x)


class PixelMaxScale(_SameShape):
    """Inputs divided by their batch maximum when they are all non-negative (pixels)."""

    def call(self, x):
        on = ops.all(x >= 0.0)
        return ops.where(on, x / (ops.max(x) + 1e-6), x)


class LargeBatchMean(_SameShape):
    """The batch mean subtracted for batches of more than 4 rows."""

    def call(self, x):
        on = _rows(x) > 4
        return ops.where(on, x - ops.mean(x, axis=0), x)


class GatedRunningMean(_SameShape):
    """Subtracts a running mean of its inputs, updated in training from batches of more
    than 4 rows and kept in a non-trainable variable."""

    def build(self, shape):
        self.mean = self.add_weight(
            name="running_mean", shape=shape[1:], initializer="zeros", trainable=False
        )

    def call(self, x, training=None):
        if training:
            on = _rows(x) > 4
            fresh = 0.5 * self.mean.value + 0.5 * ops.mean(x, axis=0)
            self.mean.assign(ops.where(on, fresh, self.mean.value))
        return x - self.mean.value


class GatedSort(_SameShape):
    """The rows sorted feature by feature over the batch when ``max |h| > GATE``."""

    def call(self, x):
        on = ops.max(ops.abs(x)) > GATE
        return ops.where(on, ops.sort(x, axis=0), x)


class MaxLogitLoss(keras.losses.Loss):
    """Cross-entropy times ``stop_gradient(max |logits|)`` over the batch: ungated."""

    def call(self, y, logits):
        scale = ops.stop_gradient(ops.max(ops.abs(logits)))
        return scale * keras.losses.categorical_crossentropy(y, logits, from_logits=True)


@dataclass
class Case:
    """A network (not private yet), the batch that switches the coupling on, the loss
    (``None``: categorical cross-entropy of logits) and the clip norm."""

    network: object
    x: np.ndarray
    y: np.ndarray
    loss: object = None
    clip: float = 0.5


def _init(seed, index):
    return keras.initializers.GlorotUniform(seed=1000 * seed + index)


def _network(seed, middle, head=(), before=()):
    layers = [keras.Input((h.FEATURES,)), *before]
    if not before:
        layers.append(K.Dense(HIDDEN, kernel_initializer=_init(seed, 0)))
    layers += [*middle, *head, K.Dense(h.CLASSES, kernel_initializer=_init(seed, 1))]
    return keras.Sequential(layers)


def _labels(rng):
    return np.eye(h.CLASSES, dtype="float32")[rng.integers(0, h.CLASSES, BATCH)]


def _outlier_features(rng, scale=100.0):
    """Standardised features and one row far out (row 0)."""
    x = rng.normal(size=(BATCH, h.FEATURES)).astype("float32")
    x[0] *= scale
    return x


def gated_magnitude(seed):
    rng = np.random.default_rng(seed)
    net = _network(seed, [GatedBatchMean(name="gated_mean")])
    return Case(net, _outlier_features(rng), _labels(rng))


def pixel_max(seed):
    rng = np.random.default_rng(seed)
    before = [PixelMaxScale(name="pixel_max"), K.Dense(HIDDEN, kernel_initializer=_init(seed, 0))]
    net = _network(seed, [K.Activation("tanh")], before=before)
    x = rng.uniform(0.0, 1.0, (BATCH, h.FEATURES)).astype("float32")
    x[0] = 1.0  # a bright image: the maximum is in row 0, the others are dark
    x[1:] *= 0.2
    return Case(net, x, _labels(rng))


def large_batch(seed):
    rng = np.random.default_rng(seed)
    net = _network(seed, [LargeBatchMean(name="large_batch_mean")])
    return Case(net, _outlier_features(rng, 10.0), _labels(rng))


def running_mean(seed):
    rng = np.random.default_rng(seed)
    net = _network(seed, [GatedRunningMean(name="running_mean")])
    return Case(net, _outlier_features(rng, 10.0), _labels(rng))


def gated_sort(seed):
    rng = np.random.default_rng(seed)
    net = _network(seed, [GatedSort(name="gated_sort")])
    return Case(net, _outlier_features(rng), _labels(rng))


def max_logit(seed):
    rng = np.random.default_rng(seed)
    net = _network(seed, [])
    # Rows unclipped without the outlier, clipped with it: the scale would move the release.
    return Case(net, _outlier_features(rng, 50.0), _labels(rng), loss=MaxLogitLoss(), clip=30.0)


#: name -> build(seed) -> Case (``tests/couplings.py``'s names).
CONSTRUCTIONS = {
    "gated-magnitude": gated_magnitude,
    "pixel-max": pixel_max,
    "large-batch": large_batch,
    "running-mean": running_mean,
    "gated-sort": gated_sort,
    "max-logit-loss": max_logit,
}
