"""Small models and data for the JAX backend's tests."""

import keras
import numpy as np

from lipdp.clipped.clipping import Clipping
from lipdp.clipped.jax.model import DPSGD_JaxModel
from lipdp.core.parameters import DPParameters
from lipdp.foundation.metadata import DatasetMetadata

FEATURES, CLASSES = 6, 3


def _init(seed, index):
    """A seeded initialiser (not keras.utils.set_random_seed, which imports TensorFlow)."""
    return keras.initializers.GlorotUniform(seed=1000 * seed + index)


def mlp(seed=0):
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="tanh", kernel_initializer=_init(seed, 0)),
            keras.layers.Dense(CLASSES, kernel_initializer=_init(seed, 1)),
        ]
    )


def cnn(seed=0):
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", kernel_initializer=_init(seed, 0))(inputs)
    h = keras.layers.GroupNormalization(groups=2)(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, kernel_initializer=_init(seed, 1))(h))


def private(network, *, sigma=1.0, clip_norm=1.0, batch_size=8, n=32, sampling="poisson",
            lr=1.0, mode="flat", gradient_method=None, loss=None, **clipping):  # fmt: skip
    """A compiled DPSGD_JaxModel (SGD of learning rate ``lr``: the update is ``-lr g``)."""
    shape = tuple(network.input_shape[1:])
    metadata = DatasetMetadata(
        input_shape=shape, nb_classes=CLASSES, nb_samples_train=n, batch_size=batch_size,
        sampling=sampling,
    )  # fmt: skip
    model = DPSGD_JaxModel(
        network,
        dp_parameters=DPParameters("global", sigma, 1e-5, non_private=sigma == 0),
        clipping=Clipping(mode, clip_norm, **clipping),
        dataset_metadata=metadata,
        **({} if gradient_method is None else {"gradient_method": gradient_method}),
    )
    model.compile(
        optimizer=keras.optimizers.SGD(lr),
        loss=loss or keras.losses.CategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def data(rows, shape=(FEATURES,), seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.normal(size=(rows, *shape))).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, rows)]
    return x, y


def weights(model) -> np.ndarray:
    return np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables])


def step_update(model, x, y, mask=None) -> np.ndarray:
    """``theta_after - theta_before`` of one ``train_on_batch``."""
    before = weights(model)
    model.train_on_batch(x, y, sample_weight=mask)
    return weights(model) - before


def remove_one_moves(full, masked, deleted, x, y, row=3) -> list:
    """How far the released update moves when ``row`` leaves the batch, both ways it can:
    masked out (weight 0), and deleted with a padding row in its place. ``full``,
    ``masked`` and ``deleted`` are three identical models drawing identical noise."""
    rows = len(x)
    mask = np.ones(rows, np.float32)
    released = step_update(full, x, y, mask)
    without = mask.copy()
    without[row] = 0.0
    keep = np.delete(np.arange(rows), row)
    x_out = np.concatenate([x[keep], np.zeros_like(x[:1])])
    y_out = np.concatenate([y[keep], np.zeros_like(y[:1])])
    neighbours = (step_update(masked, x, y, without), step_update(deleted, x_out, y_out, mask))
    return [float(np.linalg.norm(released - n)) for n in neighbours]
