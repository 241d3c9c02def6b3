"""Poisson sampling: the trained mechanism is exactly the accounted one (rules S5, S7)."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters, compute_gradient_bounds
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.pipeline import poisson_batches


def _meta(n=64, b=8, shape=(3,)):
    return DatasetMetadata(
        input_shape=shape, nb_classes=2, nb_samples_train=n, batch_size=b, sampling="poisson"
    )


def test_poisson_batches_sizes_and_fresh_randomness():
    x = np.arange(1000, dtype="float32")[:, None]
    ds = poisson_batches(x, x[:, 0], sampling_rate=0.05, steps_per_epoch=200, seed=3)
    epoch1 = [int(b.shape[0]) for b, _ in ds]
    epoch2 = [int(b.shape[0]) for b, _ in ds]
    assert len(epoch1) == 200 and epoch1 != epoch2
    # Binomial(1000, 0.05): mean 50, std ~6.9.
    assert np.mean(epoch1 + epoch2) == pytest.approx(50, abs=2)
    assert 5.5 < np.std(epoch1 + epoch2) < 8.5
    first = next(iter(ds))
    np.testing.assert_array_equal(first[0][:, 0], first[1])  # x and y stay aligned


def _one_batch(x, y):
    """A dataset of one hand-made batch whose batch axis is dynamic, as a Poisson
    pipeline's is (a Poisson model refuses batches of a static size)."""
    x, y = np.asarray(x, "float32"), np.asarray(y, "float32")
    spec = tuple(tf.TensorSpec((None, *a.shape[1:]), tf.float32) for a in (x, y))
    return tf.data.Dataset.from_generator(lambda: iter([(x, y)]), output_signature=spec)


def test_loss_is_divided_by_the_expected_batch_size():
    # MAE with targets far above the outputs: every example's gradient w.r.t. the bias
    # is -1/K per coordinate (K = 2); with SGD(lr=1) a batch of m examples moves the
    # bias by m / (K * b_expected), whatever m is.
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(3,), upper_bound=1.0),
            L.DP_QuickSpectralDense(2),
            L.DP_AddBias(norm_max=1e6),
        ],
        dp_parameters=DPParameters("global", 0.0, 1e-5, non_private=True),
        dataset_metadata=_meta(b=8),
    )
    model.compile(loss=losses.DP_MeanAbsoluteError(), optimizer=tf.keras.optimizers.SGD(1.0))
    for m in (3, 11):
        ds = _one_batch(np.zeros((m, 3)), 1e3 * np.ones((m, 2)))
        before = model.dp_layers[-1].bias.numpy().copy()
        model.fit(ds, epochs=1, verbose=0)
        np.testing.assert_allclose(
            model.dp_layers[-1].bias.numpy() - before, m / (2 * 8), rtol=1e-5
        )


def test_poisson_training_and_bounds_use_the_expected_batch_size():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = np.eye(2, dtype="float32")[rng.integers(0, 2, 64)]
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(3,), upper_bound=1.0),
            L.DP_QuickSpectralDense(2),
            L.DP_ClipGradient(0.5),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_meta(b=8),
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(2.0), optimizer="adam")
    (bound,) = compute_gradient_bounds(model).values()
    assert float(bound) == pytest.approx(1.0 * 0.5 / 8, rel=1e-4)
    assert model.loss_normalizer == 8  # the clip layers receive it from the model
    history = model.fit(poisson_batches(x, y, 8 / 64, 8, seed=0), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    model.fit(x, y, batch_size=8, verbose=0)  # arrays: Poisson-sampled by fit itself
    assert int(model.noisy_steps.numpy()) == 3 * 8
    fixed = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    with pytest.raises(ValueError, match="fixed-size batches are not Poisson samples"):
        model.fit(fixed, verbose=0)


def test_empty_poisson_batch_still_gets_noise():
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(3,), upper_bound=1.0),
            L.DP_QuickSpectralDense(2),
            L.DP_AddBias(norm_max=1e6),
        ],
        dp_parameters=DPParameters("global", 100.0, 1e-5),
        dataset_metadata=_meta(b=8),
    )
    model.compile(loss=losses.DP_MeanAbsoluteError(), optimizer=tf.keras.optimizers.SGD(1.0))
    before = model.dp_layers[-1].bias.numpy().copy()
    empty = _one_batch(np.zeros((0, 3)), np.zeros((0, 2)))  # a Poisson draw of no example
    model.fit(empty, epochs=1, verbose=0)
    assert np.all(model.dp_layers[-1].bias.numpy() != before)
