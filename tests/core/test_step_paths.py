"""Rule S12: every path into a noisy step keeps the bounds, or is refused.

``fit`` and ``train_on_batch`` project hand-set weights before the first step;
``set_weights`` and ``load_weights`` project after setting; mixed precision is refused;
a Poisson pipeline whose rate or steps differ from the metadata's is refused.
"""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.pipeline import poisson_batches

D, K, B, N = 6, 3, 8, 64


def make_model(sampling="shuffle", run_eagerly=False):
    metadata = DatasetMetadata(
        input_shape=(D,), nb_classes=K, nb_samples_train=N, batch_size=B, sampling=sampling
    )
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0),
            L.DP_QuickSpectralDense(8),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(K, constraint="spectral"),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=metadata,
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="sgd", run_eagerly=run_eagerly
    )
    return model


def data(n=N):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, D)).astype("float32"),
        np.eye(K, dtype="float32")[rng.integers(0, K, size=n)],
    )


def spectral_norm(variable):
    return float(np.linalg.norm(variable.numpy().reshape(-1, variable.shape[-1]), 2))


def test_train_on_batch_projects_hand_set_weights_before_the_step():
    model = make_model(run_eagerly=True)
    kernel = model.dp_layers[-1].kernel
    kernel.assign(3.0 * kernel / spectral_norm(kernel))  # by hand, outside set_weights
    seen = []
    original = model.train_step

    def spy(batch):
        seen.append(spectral_norm(kernel))  # what the step's gradient is computed with
        return original(batch)

    model.train_step = spy
    model.train_on_batch(*data(B))
    assert seen and seen[0] <= 1 + 1e-3


def test_set_weights_and_load_weights_project(tmp_path):
    model = make_model()
    weights = model.get_weights()
    index = [i for i, w in enumerate(model.weights) if w is model.dp_layers[-1].kernel][0]
    weights[index] = 3.0 * weights[index] / np.linalg.norm(weights[index], 2)
    model.set_weights(weights)
    assert spectral_norm(model.dp_layers[-1].kernel) <= 1 + 1e-3
    # A checkpoint holding an infeasible kernel (written by plain Keras code).
    path = str(tmp_path / "model.weights.h5")  # the weights format of Keras 2.13+ and 3
    tf.keras.Model.set_weights(model, weights)  # bypass the projection to write one
    assert spectral_norm(model.dp_layers[-1].kernel) == pytest.approx(3.0, rel=1e-5)
    model.save_weights(path)
    fresh = make_model()
    fresh.load_weights(path)
    assert spectral_norm(fresh.dp_layers[-1].kernel) <= 1 + 1e-3


def test_mixed_precision_is_refused():
    model = make_model()
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="Mixed precision is not supported"):
            model.compile(loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")
        with pytest.raises(ValueError, match="mixed_float16"):
            model.fit(*data(), batch_size=B, epochs=1, verbose=0)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    half = L.DP_QuickSpectralDense(K, dtype="mixed_float16")
    metadata = DatasetMetadata(input_shape=(D,), nb_classes=K, nb_samples_train=N, batch_size=B)
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0), half],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=metadata,
    )
    with pytest.raises(ValueError, match="float16"):
        model.compile(loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")


def test_poisson_pipeline_must_match_the_metadata():
    model = make_model(sampling="poisson")
    x, y = data()
    metadata = model.dataset_metadata
    steps = metadata.nb_steps_per_epochs
    with pytest.raises(ValueError, match="samples at rate 0.5 but"):
        model.fit(poisson_batches(x, y, 4 * metadata.sampling_rate, steps), verbose=0)
    with pytest.raises(ValueError, match="steps per epoch"):
        model.fit(poisson_batches(x, y, metadata.sampling_rate, steps + 1), verbose=0)
    history = model.fit(poisson_batches(x, y, metadata.sampling_rate, steps), verbose=0)
    assert len(history.epoch) == 1


def test_poisson_batches_are_not_reproducible_from_the_global_seed():
    x, y = data()
    drawn = []
    for _ in range(2):
        tf.keras.utils.set_random_seed(7)
        batches = poisson_batches(x, y, 0.5, 3)
        drawn.append([b[0].numpy() for b in batches])
    assert any(a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(*drawn))
    seeded = [[b[0].numpy() for b in poisson_batches(x, y, 0.5, 3, seed=3)] for _ in range(2)]
    assert all(np.array_equal(a, b) for a, b in zip(*seeded))  # an explicit seed is honoured
