"""Shared fixtures of the accounting tests: the MNIST tutorial configuration."""

import tensorflow as tf

from lipdp.accounting import DPGD_Mechanism
from lipdp.clipless import layers, losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata

DELTA = 1e-5
TUTORIAL_Q = 1000 / 60000
#: epsilon published by the original package's MNIST tutorial (DESIGN.md section 1).
PUBLISHED = {89: 2.95271, 90: 2.97062, 91: 2.98762, 92: 3.00462}


def mnist_model(
    strategy="global", sigma=2.0, nm_coef=1.0, bias=False, compile=True, tail=(), dynamic=None
):
    metadata = DatasetMetadata(
        input_shape=(28, 28, 1), nb_classes=10, nb_samples_train=60000, batch_size=1000
    )
    dp_layers = [
        layers.DP_BoundedInput(input_shape=(28, 28, 1), upper_bound=1.0),
        layers.DP_Flatten(),
        layers.DP_QuickSpectralDense(10, nm_coef=nm_coef),
    ]
    if bias:
        dp_layers.append(layers.DP_AddBias(norm_max=1.0, nm_coef=nm_coef))
    model = DP_Sequential(
        dp_layers + list(tail),
        dp_parameters=DPParameters(strategy, sigma, DELTA, dynamic_clipping=dynamic),
        dataset_metadata=metadata,
    )
    if compile:
        model.compile(
            loss=losses.DP_TauCategoricalCrossentropy(tau=8.0),
            optimizer=tf.keras.optimizers.SGD(0.1),
        )
    return model


def autodp_epsilon(sigma, q, steps, delta=DELTA):
    """The reference: a fresh autodp mechanism (the original package's way)."""
    return DPGD_Mechanism("global", q, sigma, steps, delta).epsilon
