"""The feature cache of a run (``RunConfig.cache_features``): a network opening with the
scattering transform trains its head on features computed once. It must be the same
mechanism and the same model as recomputing the front-end at every step: compared here
with reproducible noise and the same batches, weight for weight."""

import dataclasses

import keras
import numpy as np
import pytest

from lipdp.accounting.budget import get_eps_delta
from lipdp.clipless import layers as L
from lipdp.clipless.features import apply_front_end, fixed_front_end
from lipdp.core import noise
from lipdp.recipes import runs, zoo
from tests.remove_one import TOLERANCE, remove_one_ratios

SMALL = 1024  # digits rows kept: one epoch of two batches per run


@pytest.fixture(scope="module")
def digits():
    data = runs.load_data("digits")
    return dataclasses.replace(data, x_train=data.x_train[:SMALL], y_train=data.y_train[:SMALL])


@pytest.fixture
def reproducible_noise():
    noise.use_reproducible_noise(0)
    yield
    noise.use_reproducible_noise(None)


def _trained(data, method, cache):
    noise.use_reproducible_noise(0)  # the same stream for both runs
    recipe = runs.ModelRecipe(
        dataset="digits", method=method, scattering=True, batch_size=512, sampling="shuffle"
    )
    prepared = runs.prepare(runs.RunConfig(model=recipe, epochs=2, cache_features=cache), data)
    runs.fit(prepared)
    return prepared


@pytest.mark.usefixtures("reproducible_noise")
@pytest.mark.parametrize("method", ["lipdp", "dp-sgd"])
def test_cached_features_train_the_same_model_as_recomputed_ones(digits, method):
    cached = _trained(digits, method, cache=True)
    recomputed = _trained(digits, method, cache=False)
    front = cached.model.layers[: cached.front_end]
    cached_types = [type(x) for x in front if not isinstance(x, keras.layers.InputLayer)]
    expected = [L.DP_ScatteringTransform, L.DP_GroupNormalization]
    assert cached_types == ([L.DP_BoundedInput] if method == "lipdp" else []) + expected
    assert recomputed.front_end == 0
    for a, b in zip(cached.model.get_weights(), recomputed.model.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert cached.model.privacy_ledger.describe() == recomputed.model.privacy_ledger.describe()
    assert int(cached.model.noisy_steps.numpy()) == int(recomputed.model.noisy_steps.numpy()) == 4
    assert get_eps_delta(cached.model, 2) == get_eps_delta(recomputed.model, 2)


@pytest.mark.usefixtures("reproducible_noise")
def test_the_returned_model_is_the_whole_network(digits):
    prepared = _trained(digits, "lipdp", cache=True)
    model, first = prepared.model, prepared.model.layers[0]
    assert isinstance(first, L.DP_BoundedInput) and first.upper_bound == 5.0
    assert any(isinstance(layer, L.DP_ScatteringTransform) for layer in model.layers)
    accuracy = runs.metrics_on_test_set(model, digits)["accuracy"]  # takes images
    assert 0.0 <= accuracy <= 1.0
    # Its bounds are those of the network built the usual way: the same sensitivities.
    fresh = runs.build_model(prepared.run.model, model.dataset_metadata)
    expected = {entry.key: float(delta) for entry, delta in fresh.sensitivities()}
    got = {entry.key: float(delta) for entry, delta in model.sensitivities()}
    assert got == pytest.approx(expected, rel=1e-9)


def _extreme_images() -> np.ndarray:
    """Finite records an attacker would pick: blank, constant, huge (clipped to the input
    bound), a checkerboard and a single bright pixel."""
    checker = np.indices((8, 8)).sum(axis=0) % 2
    pixel = np.zeros((8, 8))
    pixel[3, 4] = 1e6
    images = [np.zeros((8, 8)), np.ones((8, 8)), np.full((8, 8), 1e30), checker, pixel]
    return np.stack(images)[..., None].astype("float32")


@pytest.mark.usefixtures("reproducible_noise")
@pytest.mark.parametrize("method", ["lipdp", "dp-sgd"])
def test_the_head_on_cached_features_moves_by_at_most_its_sensitivity(digits, method):
    """The attacker's check on the step the cache really runs: one step of the head on a
    batch of cached features and on the same batch minus one row (ordinary and extreme
    records, wrong labels), identical noise."""
    recipe = runs.ModelRecipe(dataset="digits", method=method, scattering=True, batch_size=64)
    prepared = runs.prepare(runs.RunConfig(model=recipe, epochs=1), digits)
    head, features = runs.feature_head(prepared)
    front = prepared.model.layers[: prepared.front_end]
    extreme = apply_front_end(front, _extreme_images())
    x = np.concatenate([features[:11], extreme])
    labels = np.concatenate([digits.y_train[:11], [3, 7, 1, 9, 0]])
    y = runs.one_hot(labels, 10)
    ratios = remove_one_ratios(head, x, y)
    assert ratios.max() <= 1 + TOLERANCE
    assert ratios.max() > 0.5  # the check is not vacuous: some record comes close


def test_epsilon_planned_before_fit_is_the_one_reported_after(digits):
    recipe = runs.ModelRecipe(dataset="digits", scattering=True)
    prepared = runs.prepare(runs.RunConfig(model=recipe, epochs=2), digits)
    planned = get_eps_delta(prepared.model, 2)
    history = runs.fit(prepared)
    assert prepared.front_end and history.history["epsilon"][-1] == pytest.approx(planned[0])
    assert get_eps_delta(prepared.model, 2) == pytest.approx(planned)


def test_fixed_front_end_is_an_allow_list():
    meta_free = dict(input_shape=(8, 8, 1), upper_bound=5.0, nb_classes=10)
    assert fixed_front_end(zoo.scattering_net(**meta_free)) == 3
    assert fixed_front_end(zoo.scattering_net(groups=None, **meta_free)) == 2
    assert fixed_front_end(zoo.pooled_cnn(widths=(4,), **meta_free)) == 0
    bounded = L.DP_BoundedInput(input_shape=(8, 8, 1), upper_bound=5.0)
    dropout_first = [bounded, keras.layers.Dropout(0.5), L.DP_ScatteringTransform()]
    assert fixed_front_end(dropout_first) == 0  # weightless, not fixed

    class BatchScattering(L.DP_ScatteringTransform):  # a subclass may couple the batch
        pass

    assert fixed_front_end([bounded, BatchScattering()]) == 0
    no_scattering = [L.DP_BoundedInput(input_shape=(8, 8, 3), upper_bound=5.0)]
    assert fixed_front_end(no_scattering + [L.DP_GroupNormalization(3)]) == 0


def test_no_cache_for_adversarial_training_or_when_asked(digits):
    recipe = runs.ModelRecipe(dataset="digits", scattering=True, adversarial_radius=0.1)
    assert runs.prepare(runs.RunConfig(model=recipe, epochs=1), digits).front_end == 0
    plain = runs.ModelRecipe(dataset="digits", scattering=True)
    assert runs.prepare(runs.RunConfig(model=plain, epochs=1), digits).front_end == 3
    config = runs.RunConfig(model=plain, epochs=1, cache_features=False)
    assert runs.prepare(config, digits).front_end == 0
    assert runs.RunConfig.from_config(config.to_config()) == config
