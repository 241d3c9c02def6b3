"""The JAX step's privacy, measured on real steps: remove-one sensitivity, the noise's
standard deviation, its source (rule S8), hostile records (S9), the step count and the
ledger (S10), epsilon planned = epsilon logged (S11)."""

import jax
import keras
import numpy as np
import pytest

import lipdp
from lipdp.accounting import get_eps_delta
from lipdp.clipped.jax import keys
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.core.report import privacy_report
from tests.clipped.jax import helpers as h

R, B = 0.5, 8


def _same(count, **options):
    """``count`` models with the same weights and, under reproducible noise, the same key."""
    return [h.private(h.mlp(seed=0), clip_norm=R, batch_size=B, **options) for _ in range(count)]


def test_removing_one_record_moves_the_update_by_at_most_r_over_b(reproducible_noise):
    """A real step on a batch and on the batch without row 3 -- masked out, or deleted
    with a padding row in its place --, identical noise key (SGD of rate 1: the update is
    the released gradient): the releases differ by at most ``R (1 + slack) / b``; the row
    is large, so by almost that."""
    reproducible_noise(11)
    x, y = h.data(12, scale=20.0)
    for moved in h.remove_one_moves(*_same(3), x, y, row=3):
        assert 0.9 * R / B <= moved <= R / B * (1 + ROUNDOFF_SLACK) + 1e-6


class _Subclassed(keras.Model):
    """A model written by subclassing: it learns its input shape when first called."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer=h._init(0, 0))
        self.head = keras.layers.Dense(h.CLASSES, kernel_initializer=h._init(0, 1))

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def test_a_subclassed_model_made_private_moves_by_at_most_r_over_b(reproducible_noise):
    """``make_private`` on a subclassed model (built by a call): the remove-one check of
    the test above, on three identical models."""

    def made():
        network = _Subclassed()
        network(np.zeros((1, h.FEATURES), np.float32))
        model = lipdp.make_private(
            network, epsilon=3.0, delta=1e-5, epochs=1, batch_size=B, dataset_size=64,
            clip_norm=R,
        )  # fmt: skip
        model.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        )
        return model

    reproducible_noise(11)
    x, y = h.data(12, scale=20.0)
    for moved in h.remove_one_moves(made(), made(), made(), x, y, row=3):
        assert 0.9 * R / B <= moved <= R / B * (1 + ROUNDOFF_SLACK) + 1e-6


def test_noise_standard_deviation_is_sigma_r_over_b():
    """Zero learning signal (every row masked out): the update is the noise alone, whose
    standard deviation is ``sigma R (1 + slack) / b`` on every coordinate; each step draws
    anew (an OS-seeded key per call)."""
    sigma = 3.0
    model = h.private(h.mlp(), sigma=sigma, clip_norm=R, batch_size=B)
    x, y = h.data(16)
    zeros = np.zeros(16, np.float32)
    draws = np.stack([h.step_update(model, x, y, zeros) for _ in range(24)])
    expected = sigma * R * (1 + ROUNDOFF_SLACK) / B
    assert model.noise_stddev() == pytest.approx(expected)
    assert np.std(draws) == pytest.approx(expected, rel=0.06)
    assert abs(np.mean(draws)) < 4 * expected / np.sqrt(draws.size)
    correlation = np.corrcoef(draws[:-1].ravel(), draws[1:].ravel())[0, 1]
    assert abs(correlation) < 0.1


def test_noise_ignores_keras_seeds_and_is_reproducible_only_when_asked(reproducible_noise):
    x, y = h.data(16)
    zeros = np.zeros(16, np.float32)

    model = h.private(h.mlp(seed=0))

    def draw(model):
        keras.utils.set_random_seed(5)  # Keras', numpy's, Python's (and TensorFlow's) seeds
        return h.step_update(model, x, y, zeros)

    assert not np.allclose(draw(model), draw(model))  # same Keras seed, other noise
    assert not model.privacy_ledger.reproducible()
    reproducible_noise(3)
    a, b = h.private(h.mlp(seed=0)), h.private(h.mlp(seed=0))
    np.testing.assert_array_equal(draw(a), draw(b))
    assert a.privacy_ledger.reproducible()
    assert "REPRODUCIBLE" in str(privacy_report(a, epochs=1))


def test_the_key_moves_at_every_step_inside_fit(reproducible_noise):
    """After ``k`` steps the key is the seed's key split ``k`` times (computed here)."""
    reproducible_noise(21)
    model = h.private(h.mlp(), batch_size=B, n=32)
    x, y = h.data(32)
    model.fit(lipdp.private_batches(model, x, y, seed=0), epochs=1, verbose=0)
    key = keys.seeded_key(21)
    for _ in range(4):
        key = jax.random.key_data(
            jax.random.split(jax.random.wrap_key_data(key, impl=keys.IMPL))[0]
        )
    np.testing.assert_array_equal(model.noise_key.numpy(), np.asarray(key))
    assert int(model.noisy_steps.numpy()) == 4


def test_hostile_records_are_neutralised_and_counted(reproducible_noise):
    """Rows with a NaN or an infinity change nothing: the step equals the step without
    them (same key), and the logs count them."""
    reproducible_noise(5)
    x, y = h.data(12)
    hostile = x.copy()
    hostile[2, 0], hostile[7, 4] = np.nan, np.inf
    labels = y.copy()
    labels[9, 1] = -np.inf
    clean_mask = np.ones(12, np.float32)
    clean_mask[[2, 7, 9]] = 0.0
    a, b = _same(2)
    logs = a.train_on_batch(
        hostile, labels, sample_weight=np.ones(12, np.float32), return_dict=True
    )
    b.train_on_batch(x, y, sample_weight=clean_mask)
    np.testing.assert_allclose(h.weights(a), h.weights(b), rtol=1e-6, atol=1e-7)
    assert np.all(np.isfinite(h.weights(a)))
    assert logs["non_finite_examples"] == 3


def test_arrays_with_non_finite_rows_are_refused_before_training():
    model = h.private(h.mlp(), sampling="shuffle", batch_size=8, n=16)
    x, y = h.data(16)
    x[5, 1] = np.nan
    with pytest.raises(
        ValueError, match=r"x has 1 example\(s\) with NaN or infinite values \(rows 5\)"
    ):
        model.fit(x, y, epochs=1, verbose=0)


def test_epsilon_logged_is_the_plan_s_and_the_target():
    x, y = h.data(64)
    model = lipdp.make_private(
        h.mlp(), epsilon=3.0, delta=1e-5, epochs=2, batch_size=8, dataset_size=64,
        sampling="poisson", clip_norm=R,
    )  # fmt: skip
    planned = get_eps_delta(model, 2)[0]
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    history = model.fit(lipdp.private_batches(model, x, y), epochs=2, verbose=0,
                        callbacks=[DP_Accountant()])  # fmt: skip
    logged = history.history["epsilon"]
    assert logged[-1] == planned == get_eps_delta(model, 2)[0]
    assert 3.0 - 0.05 < logged[-1] <= 3.0 and logged[0] < logged[1]
    assert int(model.noisy_steps.numpy()) == 16
    (entry,) = model.privacy_ledger.entries()
    assert (
        entry.count == 16
        and entry.mechanism.noise_multiplier == model.dp_parameters.noise_multiplier
    )
    assert "16 x noisy gradient steps" in str(privacy_report(model))


def test_a_keras_file_keeps_the_step_count_and_the_ledger_but_no_key(tmp_path):
    x, y = h.data(32)
    model = h.private(h.mlp(), batch_size=B, n=32)
    model.fit(lipdp.private_batches(model, x, y), epochs=1, verbose=0)
    assert np.any(model.noise_key.numpy() != 0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert int(loaded.noisy_steps.numpy()) == 4
    assert loaded.privacy_ledger.describe() == model.privacy_ledger.describe()
    assert get_eps_delta(loaded, 1) == get_eps_delta(model, 1)
    np.testing.assert_array_equal(loaded.noise_key.numpy(), [0, 0])
    np.testing.assert_allclose(h.weights(loaded), h.weights(model))
    loaded.fit(lipdp.private_batches(loaded, x, y), epochs=1, verbose=0)
    assert int(loaded.noisy_steps.numpy()) == 8
    assert loaded.privacy_ledger.entries()[0].count == 8
    with pytest.raises(ValueError, match="saved to .keras files"):
        model.save(str(tmp_path / "model.h5"))


def test_set_weights_never_rewinds_the_privacy_state():
    x, y = h.data(32)
    model = h.private(h.mlp(), batch_size=B, n=32)
    saved = model.get_weights()
    model.fit(lipdp.private_batches(model, x, y), epochs=1, verbose=0)
    model.set_weights(saved)  # the step count and the ledger come back as zeros...
    assert int(model.noisy_steps.numpy()) == 4  # ...and are restored
    assert model.privacy_ledger.entries()[0].count == 4


def test_set_weights_and_load_weights_keep_the_model_s_own_noise_key(tmp_path):
    """Rule S8: weights copied from another model (or loaded mid-fit by a callback) never
    bring that model's key, which would replay its noise; the file holds no key anyway."""
    x, y = h.data(32)
    donor = h.private(h.mlp(seed=1), batch_size=B, n=32)
    donor.fit(lipdp.private_batches(donor, x, y), epochs=1, verbose=0)
    model = h.private(h.mlp(), batch_size=B, n=32)
    model.fit(lipdp.private_batches(model, x, y), epochs=1, verbose=0)
    own = np.array(model.noise_key.numpy())
    assert np.any(own != donor.noise_key.numpy())
    model.set_weights(donor.get_weights())
    np.testing.assert_array_equal(model.noise_key.numpy(), own)
    path = str(tmp_path / "donor.weights.h5")
    donor.save_weights(path)
    model.load_weights(path)
    np.testing.assert_array_equal(model.noise_key.numpy(), own)
