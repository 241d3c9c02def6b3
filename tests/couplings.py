"""Six ways to couple the rows of a batch that a numerical probe at a few points can miss
(issue 37, item 4: the red team's constructions), as small Keras layers and a loss.

Each coupling is inactive on the probe's draws (4 rows of N(0, 1)) and active on the
batches built here (:func:`batch`): gated on a large activation, on non-negative inputs,
on a batch larger than the probe's, a running mean kept in a variable, a sort over the
rows, and an ungated loss scaled by a statistic of the batch. Each is placed in a small
clipped model with Poisson metadata (:func:`model`), where, without row isolation and with
the probe switched off, removing one row moves the released gradient by more than the
declared sensitivity (``tests/remove_one.py``).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.core import compat
from lipdp.core.metadata import DatasetMetadata
from lipdp.core.parameters import DPParameters

K = tf.keras.layers
FEATURES, CLASSES, BATCH = 6, 3, 8

#: The gate of the gated couplings: far beyond the activations of a N(0, 1) draw.
GATE = 20.0


class GatedOnLarge(K.Layer):
    """Subtracts the batch mean when some activation of the batch exceeds :data:`GATE`."""

    def call(self, inputs):
        active = tf.cast(tf.reduce_max(tf.abs(inputs)) > GATE, inputs.dtype)
        return inputs - active * tf.reduce_mean(inputs, axis=0)


class NonNegativeRescale(K.Layer):
    """Divides by the batch maximum when every input of the batch is non-negative (pixel
    data; the probe draws N(0, 1))."""

    def call(self, inputs):
        pixels = tf.reduce_all(inputs >= 0.0)
        return tf.where(pixels, inputs / (tf.reduce_max(inputs) + 1e-6), inputs)


class LargeBatchOnly(K.Layer):
    """Subtracts the batch mean only on batches of more than 4 rows (the probe's size)."""

    def call(self, inputs):
        active = tf.cast(tf.shape(inputs)[0] > 4, inputs.dtype)
        return inputs - active * tf.reduce_mean(inputs, axis=0)


class GatedRunningMean(K.Layer):
    """Keeps a running mean of its inputs in a non-trainable variable, updated (and
    subtracted) when some activation exceeds :data:`GATE`."""

    def build(self, input_shape):
        self.mean = self.add_weight(
            name="running_mean", shape=(input_shape[-1],), initializer="zeros", trainable=False
        )

    def call(self, inputs):
        active = tf.cast(tf.reduce_max(tf.abs(inputs)) > GATE, inputs.dtype)
        batch_mean = tf.reduce_mean(inputs, axis=0)
        self.mean.assign(self.mean + active * (batch_mean - self.mean))
        return inputs - active * self.mean


class GatedSort(K.Layer):
    """Sorts every feature over the rows of the batch when some activation exceeds
    :data:`GATE` (row i then holds another row's values)."""

    def call(self, inputs):
        active = tf.reduce_max(tf.abs(inputs)) > GATE
        return tf.where(active, tf.sort(inputs, axis=0), inputs)


class BatchMaxScaledLoss(tf.keras.losses.Loss):
    """Each row's cross-entropy times ``stop_gradient(max |logits| over the batch)``:
    ungated, per-row values of the right shape, a coupling gradients through the
    predictions do not show."""

    def __init__(self, name="batch_max_scaled", **kwargs):
        super().__init__(name=name, **kwargs)

    def call(self, y_true, y_pred):
        rows = tf.keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        return rows * tf.stop_gradient(tf.reduce_max(tf.abs(y_pred)))


#: name -> (coupling layer class or None, loss or None, clip radius, kind of batch)
COUPLINGS = {
    "gated-on-large": (GatedOnLarge, None, 0.5, "outlier"),
    "non-negative-inputs": (NonNegativeRescale, None, 0.5, "pixels"),
    "larger-batches": (LargeBatchOnly, None, 0.5, "outlier"),
    "running-mean": (GatedRunningMean, None, 0.5, "outlier"),
    "gated-sort": (GatedSort, None, 0.5, "outlier"),
    "batch-max-loss": (None, BatchMaxScaledLoss, 50.0, "outlier"),
}


def batch(kind, seed=0, rows=BATCH):
    """``(x, y)``: ``"outlier"``: N(0, 1) rows and row 0 of norm about 150 (activations
    beyond :data:`GATE`); ``"pixels"``: values in [0, 0.3] and row 0 in [0.7, 1]."""
    rng = np.random.default_rng(seed)
    if kind == "pixels":
        x = rng.uniform(0.0, 0.3, size=(rows, FEATURES))
        x[0] = rng.uniform(0.7, 1.0, size=FEATURES)
    else:
        x = rng.normal(size=(rows, FEATURES))
        x[0] *= 60.0
    return x.astype("float32"), rng.integers(0, CLASSES, rows)


def model(name, *, row_isolation, seed=0):
    """A clipped model with the coupling ``name`` (Poisson metadata, probe off, global
    noise), compiled, its weights seeded."""
    layer, loss, clip, _ = COUPLINGS[name]
    tf.keras.utils.set_random_seed(seed)
    stack = [compat.input_layer((FEATURES,))]
    if layer is not None:
        stack.append(layer(name="coupling"))
    # a linear hidden layer under the loss coupling: logits, and their batch maximum,
    # grow with the inputs
    stack += [K.Dense(8, activation="tanh" if loss is None else None), K.Dense(CLASSES)]
    built = DPSGD_Sequential(
        stack,
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", clip),
        dataset_metadata=DatasetMetadata(
            input_shape=(FEATURES,),
            nb_classes=CLASSES,
            nb_samples_train=16 * BATCH,
            batch_size=BATCH,
            sampling="poisson",
        ),
        independence_probe=False,
        row_isolation=row_isolation,
    )
    built.compile(
        optimizer=tf.keras.optimizers.SGD(0.1),
        loss=(loss or tf.keras.losses.SparseCategoricalCrossentropy)(
            **({} if loss else {"from_logits": True})
        ),
    )
    return built


__all__ = ["COUPLINGS", "batch", "model"]
