"""The JAX model refuses what the TensorFlow models refuse, with the same message
(:mod:`tests.private_surface`; the TensorFlow side: ``tests/core/test_private_surface.py``)."""

import keras
import pytest

from lipdp.clipped.jax.model import DPSGD_JaxModel
from lipdp.core.parameters import DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from tests import private_surface as surface


def _model(dtype="float32", nested=False, partial_last_batch=False):
    first = keras.layers.Dense(8, activation="tanh", dtype=dtype, name="wide")
    if nested:
        first = keras.Sequential([first], name="block")
    network = keras.Sequential(
        [keras.Input((surface.FEATURES,)), first, keras.layers.Dense(surface.CLASSES)]
    )
    metadata = DatasetMetadata(
        input_shape=(surface.FEATURES,), nb_classes=surface.CLASSES,
        nb_samples_train=surface.N, batch_size=surface.BATCH, sampling="shuffle",
        partial_last_batch=partial_last_batch,
    )  # fmt: skip
    return DPSGD_JaxModel(
        network, dp_parameters=DPParameters("global", 1.0, 1e-5), dataset_metadata=metadata
    )


@pytest.mark.parametrize("case", sorted(surface.MESSAGES))
def test_the_jax_model_refuses_with_the_shared_message(case):
    surface.check_refusal(case, surface.refusals(_model, keras)[case])
