"""A small DP model and data set shared by the callback and report tests."""

import numpy as np
from autodp import mechanism_zoo, transformer_zoo

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata

N, B = 512, 64


def small_model(sigma=2.0):
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(6,), upper_bound=1.0), L.DP_QuickSpectralDense(3)],
        dp_parameters=DPParameters("global", sigma, 1e-5),
        dataset_metadata=DatasetMetadata(
            input_shape=(6,), nb_classes=3, nb_samples_train=N, batch_size=B
        ),
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(2.0), optimizer="sgd")
    return model


def small_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6)).astype("float32")
    return x, np.eye(3, dtype="float32")[rng.integers(0, 3, N)]


def autodp_epsilon(sigma, steps, delta=1e-5):
    """Independent computation with autodp's transformers."""
    step = transformer_zoo.AmplificationBySampling()(
        mechanism_zoo.GaussianMechanism(sigma=sigma), B / N, improved_bound_flag=True
    )
    composed = transformer_zoo.Composition()([step], [steps])
    # autodp's Brent search divides 0 by 0 on flat stretches of its objective and recovers
    # (scipy's RuntimeWarning only; lipdp.accounting.reference silences it the same way).
    with np.errstate(invalid="ignore", divide="ignore"):
        return composed.get_approxDP(delta=delta)
