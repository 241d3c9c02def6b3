"""Rule S8: the training noise cannot be reproduced from the seeds a user trains with."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.core import noise
from lipdp.core.report import privacy_report
from lipdp.foundation.metadata import DatasetMetadata

D, K, B = 6, 3, 8


def one_noisy_step(jit_compile=False):
    """Weights after one step on a zero batch (the update is the noise alone: the
    gradient of the zero-input network w.r.t. the kernel is 0)."""
    tf.keras.utils.set_random_seed(0)  # the user's seeds: identical in every run
    metadata = DatasetMetadata(input_shape=(D,), nb_classes=K, nb_samples_train=64, batch_size=B)
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0), L.DP_QuickSpectralDense(K)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=metadata,
    )
    model.project = lambda: None  # compare the raw noisy update
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(2.0),
        optimizer=tf.keras.optimizers.SGD(1.0),
        jit_compile=jit_compile,
    )
    before = model.dp_layers[1].kernel.numpy()
    model.train_on_batch(np.zeros((B, D), "float32"), np.zeros((B, K), "float32"))
    return model, model.dp_layers[1].kernel.numpy() - before


@pytest.fixture(autouse=True)
def _secure_noise_afterwards():
    yield
    noise.use_reproducible_noise(None)


def test_same_user_seeds_give_different_noise():
    _, first = one_noisy_step()
    model, second = one_noisy_step()
    assert np.abs(first).max() > 0 and np.abs(second).max() > 0
    assert not np.allclose(first, second)
    assert noise.reproducible_noise_seed() is None
    assert not any("REPRODUCIBLE" in note for note in privacy_report(model, 1).notes)


def test_reproducible_noise_is_explicit_and_flagged():
    noise.use_reproducible_noise(42)
    _, first = one_noisy_step()
    noise.use_reproducible_noise(42)
    model, second = one_noisy_step()
    np.testing.assert_array_equal(first, second)
    assert any("REPRODUCIBLE NOISE" in note for note in privacy_report(model, 1).notes)


def test_noise_under_xla_has_the_calibrated_std():
    model, update = one_noisy_step(jit_compile=True)
    ((_, delta),) = model.sensitivities()
    # One variable: global std = sigma * Delta; 18 coordinates, a loose check of the scale.
    assert 0.3 < np.std(update) / float(delta) < 2.0


WINDOW = 4  # consecutive float32 normals: a chance match has probability ~2^-90


def noise_stream(seed, n=2048):
    """The first ``n`` normal samples the noise generator draws after
    ``use_reproducible_noise(seed)`` (``None``: secure mode)."""
    noise.use_reproducible_noise(seed)
    return noise.noise_generator().normal([n]).numpy()


def windows(values):
    return {values[i : i + WINDOW].tobytes() for i in range(len(values) - WINDOW + 1)}


def test_reproducible_streams_of_different_seeds_share_no_window():
    """``Generator.from_seed(s)`` puts ``s`` in Philox's counter: seed s + 1's stream is
    seed s's without its first four values. The hashed key and counter of
    :func:`lipdp.core.noise.seeded_generator` give unrelated streams."""
    seeds = [0, 1, 2, 3, 42, 43, 2**31 - 1, 2**31]
    seen = {}
    for seed in seeds:
        for window in windows(noise_stream(seed)):
            assert seen.setdefault(window, seed) == seed, f"seeds {seen[window]} and {seed}"
    # The check is not vacuous: TensorFlow's own seeding shares most windows.
    shifted = [tf.random.Generator.from_seed(s).normal([2048]).numpy() for s in (42, 43)]
    assert len(windows(shifted[0]) & windows(shifted[1])) > 2000


def test_same_seed_same_stream_and_default_stays_secure():
    np.testing.assert_array_equal(noise_stream(7), noise_stream(7))
    assert noise.reproducible_noise_seed() == 7
    first, second = noise_stream(None), noise_stream(None)
    assert noise.reproducible_noise_seed() is None
    assert not windows(first) & windows(second)
