"""Shared by the evaluation tests: the digits CNN of ``lipdp train``, trained once per
test process, and a small vector model."""

import math

import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.data import sources as datasets
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.recipes import runs


@pytest.fixture(scope="session")
def digits():
    return datasets.load_digits()


def digits_cnn(data, sigma=1.0, batch_size=512):
    """The compiled CNN of ``lipdp train --no-scattering --gradient-clip none --learning-rate
    0.02`` on digits (:func:`lipdp.recipes.runs.build_model`; the command's default before
    issue 29), on the whole batches of the training set: ``(model, x_train, y_train)``."""
    recipe = runs.ModelRecipe(
        dataset="digits",
        batch_size=batch_size,
        noise_multiplier=sigma,
        sampling="shuffle",
        scattering=False,
        gradient_clip=math.inf,
        learning_rate=0.02,
    )
    return runs.model_and_arrays(recipe, data)


@pytest.fixture(scope="session")
def trained(digits):
    """The CNN of ``lipdp train`` trained with DP (sigma = 1) for 15 epochs.

    Shared by several tests: they must not train it further.
    """
    tf.keras.utils.set_random_seed(0)
    model, x, y = digits_cnn(digits)
    model.fit(x, y, batch_size=model.batch_size, epochs=15, verbose=0)
    return model, x, y


def vector_model(dp_layers, input_dim=6, batch=8, upper_bound=3.0, loss=None, lr=0.0):
    meta = DatasetMetadata(
        input_shape=(input_dim,), nb_classes=5, nb_samples_train=4 * batch, batch_size=batch
    )
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(input_dim,), upper_bound=upper_bound), *dp_layers],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=meta,
    )
    model.compile(
        loss=loss or losses.DP_TauCategoricalCrossentropy(tau=8.0),
        optimizer=tf.keras.optimizers.SGD(lr),
    )
    return model
