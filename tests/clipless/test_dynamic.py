"""Private updates of dynamic clip values (lipdp.clipless.dynamic)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.accounting import Laplace, SubsampledGaussian, autodp_epsilon, get_eps_delta
from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.dynamic import (
    AdaptiveQuantileClipping,
    CotangentNorms,
    DynamicClippingSpec,
    LaplaceAdaptiveLossGradientClipping,
    cotangent_upper_bound,
    find_dynamic_clip_layers,
    geometric_update,
    histogram_counts,
    histogram_edges,
    laplace_clipped_mean,
    laplace_histogram_quantile,
    noisy_fraction,
    per_example_cotangent_norms,
    poisson_mask,
)
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata

N = 256
BATCH = 32
CLASSES = 5
TAU = 4.0


def make_model(middle=None, clip_value=1.0, mode="dynamic", clip_last=True, dynamic=None):
    """A small classifier; ``dynamic``: the dynamic clipping declared in DPParameters."""
    meta = DatasetMetadata(
        input_shape=(12,), nb_classes=CLASSES, nb_samples_train=N, batch_size=BATCH
    )
    stack = [L.DP_BoundedInput(input_shape=(12,), upper_bound=1.0), L.DP_QuickSpectralDense(16)]
    if middle is not None:
        stack.append(middle)
    stack += [L.DP_GroupSort(2), L.DP_QuickSpectralDense(CLASSES)]
    if clip_last:
        stack.append(L.DP_ClipGradient(clip_value, mode=mode))
    model = DP_Sequential(
        stack,
        dp_parameters=DPParameters("global", 1.0, 1e-5, dynamic_clipping=dynamic),
        dataset_metadata=meta,
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=TAU),
        optimizer=tf.keras.optimizers.Adam(0.05),
    )
    return model


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 12)).astype("float32")
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    teacher = rng.normal(size=(12, CLASSES))
    y = np.eye(CLASSES, dtype="float32")[np.argmax(x @ teacher, axis=1)]
    return x, y


def datasets(x, y):
    """Training pipeline (fixed-size batches) and the callbacks' full pass."""
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=0)
    train = train.batch(BATCH, drop_remainder=True)
    full = tf.data.Dataset.from_tensor_slices((x, y)).batch(100)  # partial last batch
    return train, full


# ------------------------------------------------------------------------------ training
@pytest.mark.parametrize("kind", ["laplace-quantile", "laplace-mean", "quantiles"])
def test_callbacks_change_clip_value_within_limits(kind):
    x, y = make_data()
    train, full = datasets(x, y)
    if kind == "quantiles":
        callback = AdaptiveQuantileClipping(
            full, noise_multiplier=1.0, quantile=0.5, learning_rate=0.5, seed=1
        )
    else:
        statistic = kind.split("-")[1]
        callback = LaplaceAdaptiveLossGradientClipping(
            full, epsilon=1.0, statistic=statistic, multiplier=1.0, seed=1
        )
    model = make_model(clip_value=1.0, dynamic=callback)
    history = model.fit(train, epochs=3, verbose=0, callbacks=[callback])
    values = history.history["clip_value"]
    assert len(values) == 3
    upper = math.sqrt(2.0)  # get_L of the tau cross-entropy, the clip layer is last
    assert all(1e-3 <= v <= upper for v in values)
    assert values[0] != pytest.approx(1.0)
    layer = model.dp_layers[-1]
    assert float(layer.clip_value.numpy()) == pytest.approx(values[-1])
    assert len(callback.history) == 3
    assert model.dynamic_clipping == callback.spec
    # Exactly the releases the plan counted before fit (rule S11).
    assert model.privacy_plan().releases[1].count(3) == callback.releases == 3


@pytest.mark.parametrize(
    "callback_cls", [LaplaceAdaptiveLossGradientClipping, AdaptiveQuantileClipping]
)
def test_two_dynamic_layers_are_updated_and_logged(callback_cls):
    x, y = make_data()
    train, full = datasets(x, y)
    callback = callback_cls(full, seed=2)
    middle = L.DP_ClipGradient(0.2, mode="dynamic")
    model = make_model(middle=middle, clip_value=0.5, dynamic=callback)
    history = model.fit(train, epochs=2, verbose=0, callbacks=[callback])
    (_, mid), (_, last) = find_dynamic_clip_layers(model)
    logged = history.history
    assert logged[f"clip_value/{mid.name}"][-1] == pytest.approx(float(mid.clip_value.numpy()))
    assert logged[f"clip_value/{last.name}"][-1] == pytest.approx(float(last.clip_value.numpy()))
    assert logged[f"clip_value/{mid.name}"] == logged["clip_value"]  # the first one
    assert len(callback.history) == 4 == model.privacy_plan().releases[1].count(2)
    assert callback.releases == 4
    assert {name for _, name, _, _ in callback.history} == {mid.name, last.name}
    assert all(1e-3 <= new <= math.sqrt(2) for *_, new in callback.history)


def test_patience_schedules_updates():
    x, y = make_data()
    train, full = datasets(x, y)
    callback = LaplaceAdaptiveLossGradientClipping(full, patience=2, epsilon=2.0, seed=0)
    model = make_model(dynamic=callback)
    history = model.fit(train, epochs=5, verbose=0, callbacks=[callback])
    assert [h[0] for h in callback.history] == [1, 3]  # end of epochs 2 and 4
    values = history.history["clip_value"]
    assert values[0] == pytest.approx(1.0) and values[1] == pytest.approx(values[2])
    assert model.privacy_plan().releases[1].count(5) == 2


def test_rounds_follow_the_model_epochs_across_fit_calls():
    """Patience 2, three fit calls of one epoch: releases after epochs 2 (not 0, 1, 2)."""
    x, y = make_data()
    train, full = datasets(x, y)
    callback = LaplaceAdaptiveLossGradientClipping(full, patience=2, epsilon=2.0, seed=0)
    model = make_model(dynamic=callback)
    for _ in range(3):
        model.fit(train, epochs=1, verbose=0, callbacks=[callback])
    assert callback.releases == 1 == model.privacy_plan().releases[1].count(3)


def test_laplace_quantile_tracks_the_true_quantile():
    """With a large epsilon the released value is the bin edge just above the quantile."""
    x, y = make_data()
    _, full = datasets(x, y)
    callback = LaplaceAdaptiveLossGradientClipping(
        full, epsilon=1e6, quantile=0.7, num_bins=200, seed=0
    )
    model = make_model(dynamic=callback)
    callback.set_model(model)
    callback.on_train_begin()
    callback.on_epoch_end(0, {})
    norms = per_example_cotangent_norms(model, x, y)[0]
    true_q = np.quantile(norms, 0.7)
    edges = histogram_edges(1e-3, math.sqrt(2), 200)
    ratio = edges[-1] / edges[-2]
    value = float(model.dp_layers[-1].clip_value.numpy())
    assert true_q * 0.98 <= value <= true_q * ratio * 1.02


# ----------------------------------------------------------------- per-example norms
def test_norms_equal_the_loss_gradient_wrt_the_logits_before_clipping():
    """Clip layer after the logits, tiny clip value: norms are those of softmax(tau z) - y."""
    model = make_model(clip_value=1e-3)
    x, y = make_data()
    norms = per_example_cotangent_norms(model, x, y)[0]
    logits = model(x).numpy()
    expected = np.linalg.norm(tf.nn.softmax(TAU * logits).numpy() - y, axis=1)
    np.testing.assert_allclose(norms, expected, rtol=1e-4, atol=1e-6)
    assert np.mean(norms > 1e-2) > 0.5  # much larger than the clip value: not clipped
    # and by autodiff, example by example
    for i in range(0, N, 37):
        z = tf.constant(logits[i : i + 1])
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = model.loss.call(y[i : i + 1], z)[0]
        assert norms[i] == pytest.approx(float(tf.norm(tape.gradient(loss, z))), rel=1e-4)


def test_norms_inside_the_network_see_the_downstream_clipping():
    """Two dynamic clip layers: the upstream norm is that of J^T clip(g, C_last)."""
    middle = L.DP_ClipGradient(0.01, mode="dynamic")
    c_last = 0.3
    model = make_model(middle=middle, clip_value=c_last)
    x, y = make_data()
    found = find_dynamic_clip_layers(model)
    assert [i for i, _ in found] == [2, 5]
    mid_norms, last_norms = per_example_cotangent_norms(model, x, y)

    layers = model.layers_forward_order()
    h = layers[1](layers[0](tf.constant(x)))  # input of the middle clip layer
    for i in range(0, N, 23):
        hi = h[i : i + 1]
        with tf.GradientTape() as tape:
            tape.watch(hi)
            z = layers[4](layers[3](hi))  # GroupSort, Dense: the tail, without clip layers
        g = tf.nn.softmax(TAU * z) - y[i : i + 1]  # gradient of the loss wrt the logits
        assert last_norms[i] == pytest.approx(float(tf.norm(g)), rel=1e-4)
        g_clipped = g * min(1.0, c_last / float(tf.norm(g)))
        expected = tf.norm(tape.gradient(z, hi, output_gradients=g_clipped))
        assert mid_norms[i] == pytest.approx(float(expected), rel=1e-4, abs=1e-7)
    assert np.mean(mid_norms > 0.02) > 0.5  # not clipped at the middle layer's 0.01
    # Bounds: U at the last layer is get_L, at the middle one min(get_L, C_last) * 1 * 1.
    assert cotangent_upper_bound(model, 5) == pytest.approx(math.sqrt(2))
    assert cotangent_upper_bound(model, 2) == pytest.approx(c_last)
    assert np.all(mid_norms <= c_last * (1 + 1e-5))


def test_cotangent_norms_on_variable_batch_sizes():
    model = make_model()
    x, y = make_data()
    fn = CotangentNorms(model, [i for i, _ in find_dynamic_clip_layers(model)])
    whole = fn(x, y)[0].numpy()
    parts = np.concatenate([fn(x[a:b], y[a:b])[0].numpy() for a, b in [(0, 7), (7, 100), (100, N)]])
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="indices"):
        CotangentNorms(model, [5])


# -------------------------------------------------------------------- noise statistics
def test_laplace_mean_noise_std():
    rng = np.random.default_rng(0)
    upper, n, eps, true_sum = math.sqrt(2), 1000, 0.5, 321.0
    releases = np.array(
        [laplace_clipped_mean(true_sum, upper, n, eps, rng)[0] for _ in range(20000)]
    )
    scale = upper / (n * eps)
    assert laplace_clipped_mean(true_sum, upper, n, eps, rng)[1] == pytest.approx(scale)
    assert np.std(releases) == pytest.approx(math.sqrt(2) * scale, rel=0.04)
    assert np.mean(releases) == pytest.approx(true_sum / n, abs=4 * scale / math.sqrt(20000))


def test_laplace_histogram_noise_std():
    rng = np.random.default_rng(1)
    edges = histogram_edges(1e-3, 1.0, 16)
    counts = histogram_counts(rng.uniform(0, 1.2, size=500), edges)
    assert counts.sum() == 500 and len(counts) == 16
    eps = 2.0
    noise = np.stack(
        [laplace_histogram_quantile(counts, edges, 0.5, eps, rng)[1] - counts for _ in range(2000)]
    )
    assert np.std(noise) == pytest.approx(math.sqrt(2) / eps, rel=0.03)


def test_histogram_counts_bins():
    edges = histogram_edges(0.1, 1.0, 3)  # [0, .1, .316, 1]
    np.testing.assert_allclose(edges, [0, 0.1, math.sqrt(0.1), 1.0])
    counts = histogram_counts([0.0, 0.1, 0.2, 0.5, 1.0, 7.0], edges)
    np.testing.assert_array_equal(counts, [2, 1, 3])


def test_quantile_count_noise_std():
    rng = np.random.default_rng(2)
    sigma, expected_size, count = 3.0, 50.0, 37
    fractions = np.array([noisy_fraction(count, expected_size, sigma, rng) for _ in range(20000)])
    noise = fractions * expected_size - count
    assert np.std(noise) == pytest.approx(sigma, rel=0.03)
    assert np.mean(noise) == pytest.approx(0.0, abs=4 * sigma / math.sqrt(20000))


def test_poisson_mask_rate():
    mask = poisson_mask(100000, 0.125, np.random.default_rng(3))
    assert mask.mean() == pytest.approx(0.125, abs=0.005)


def test_callback_subsample_has_rate_q():
    x, y = make_data()
    _, full = datasets(x, y)
    callback = AdaptiveQuantileClipping(full, noise_multiplier=1.0, seed=4)
    model = make_model(dynamic=callback)
    callback.set_model(model)
    callback.on_train_begin()
    sizes = [callback.count_below(0, 10.0) for _ in range(40)]
    assert all(c == s for c, s in sizes)  # every norm <= 10 > U
    q = model.dataset_metadata.sampling_rate
    assert np.mean([s for _, s in sizes]) == pytest.approx(q * N, rel=0.1)


# ------------------------------------------------------------------------ update rule
@pytest.mark.parametrize("start", [0.01, 5.0])
def test_geometric_update_converges_to_the_quantile(start):
    rng = np.random.default_rng(5)
    norms = rng.lognormal(mean=-1.0, sigma=0.7, size=2000)
    target = 0.9
    clip = start
    for _ in range(600):
        fraction = noisy_fraction(np.sum(norms <= clip), norms.size, 1e-6, rng)
        clip = geometric_update(clip, fraction, target, learning_rate=0.2)
    assert np.mean(norms <= clip) == pytest.approx(target, abs=0.01)
    assert clip == pytest.approx(np.quantile(norms, target), rel=0.03)


def test_geometric_update_direction():
    assert geometric_update(1.0, 1.0, 0.5, 0.2) == pytest.approx(math.exp(-0.1))
    assert geometric_update(1.0, 0.0, 0.5, 0.2) == pytest.approx(math.exp(0.1))


# ------------------------------------------------------------------------------- errors
def _fit_with(model, callback):
    x, y = make_data()
    train, _ = datasets(x, y)
    model.fit(train, epochs=1, verbose=0, callbacks=[callback])


def test_error_without_dynamic_clip_layer():
    x, y = make_data()
    callback = LaplaceAdaptiveLossGradientClipping((x, y))
    with pytest.raises(ValueError, match="no DP_ClipGradient"):
        make_model(clip_last=False, dynamic=callback)
    model = make_model(clip_last=False)
    with pytest.raises(ValueError, match="declares"):
        _fit_with(model, callback)


def test_error_with_fixed_clip_layer():
    x, y = make_data()
    callback = AdaptiveQuantileClipping((x, y))
    model = make_model(
        middle=L.DP_ClipGradient(0.5, mode="dynamic"), mode="fixed", dynamic=callback
    )
    with pytest.raises(ValueError, match="mode='fixed'"):
        _fit_with(model, callback)


def test_error_undeclared_or_different_callback():
    """Rule S11: a callback the plan does not know is refused, never silently cheaper."""
    x, y = make_data()
    callback = LaplaceAdaptiveLossGradientClipping((x, y), epsilon=0.5)
    with pytest.raises(ValueError, match=r"DPParameters\(\.\.\., dynamic_clipping="):
        _fit_with(make_model(), callback)
    other = LaplaceAdaptiveLossGradientClipping((x, y), epsilon=0.1)
    with pytest.raises(ValueError, match="declares"):
        _fit_with(make_model(dynamic=other), callback)


def test_error_two_callbacks_in_one_fit():
    x, y = make_data()
    train, full = datasets(x, y)
    first, second = (
        LaplaceAdaptiveLossGradientClipping(full),
        LaplaceAdaptiveLossGradientClipping(full),
    )
    model = make_model(dynamic=first)
    with pytest.raises(ValueError, match="Two dynamic clipping callbacks"):
        model.fit(train, epochs=1, verbose=0, callbacks=[first, second])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": -1.0}, "epsilon"),
        ({"epsilon": float("inf")}, "epsilon"),
        ({"patience": 0}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"patience": True}, "patience"),
        ({"quantile": 0.0}, "quantile"),
        ({"quantile": 1.0}, "quantile"),
        ({"multiplier": 0.0}, "multiplier"),
        ({"num_bins": 1}, "num_bins"),
        ({"statistic": "median"}, "statistic"),
        ({"min_clip_value": 0.0}, "min_clip_value"),
    ],
)
def test_laplace_invalid_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LaplaceAdaptiveLossGradientClipping(make_data(), **kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": "a"}, "noise_multiplier"),
        ({"patience": 0}, "patience"),
        ({"quantile": 1.2}, "quantile"),
        ({"quantile": -0.1}, "quantile"),
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"learning_rate": -0.2}, "learning_rate"),
        ({"steps_per_update": 0}, "steps_per_update"),
    ],
)
def test_quantile_invalid_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdaptiveQuantileClipping(make_data(), **kwargs)


def test_ds_train_is_required():
    with pytest.raises(ValueError, match="ds_train"):
        AdaptiveQuantileClipping(None)


# --------------------------------------------------------------------------- accounting
def test_specs_of_the_callbacks():
    laplace = LaplaceAdaptiveLossGradientClipping(make_data(), patience=3, epsilon=0.5)
    assert laplace.spec == DynamicClippingSpec("laplace", 3, epsilon=0.5)
    release = laplace.spec.release(1, BATCH / N)
    assert release.mechanism == Laplace(0.5)
    assert [release.count(e) for e in (2, 3, 10)] == [0, 1, 3]
    quantiles = AdaptiveQuantileClipping(make_data(), patience=2, noise_multiplier=4.0)
    release = quantiles.spec.release(1, BATCH / N)
    assert release.mechanism == SubsampledGaussian(4.0, BATCH / N)
    assert release.count(7) == 3
    with pytest.raises(ValueError, match="epochs"):
        release.count(-1)
    # Declaring the callback, its spec or the spec's config is the same declaration.
    for declared in (quantiles, quantiles.spec, quantiles.spec.to_config()):
        assert DPParameters("global", 1.0, 1e-5, dynamic_clipping=declared).dynamic_clipping == (
            quantiles.spec
        )
    with pytest.raises(TypeError, match="dynamic_clipping"):
        DPParameters("global", 1.0, 1e-5, dynamic_clipping="laplace")
    with pytest.raises(ValueError, match="epsilon"):
        DynamicClippingSpec("laplace")


def test_plan_counts_every_dynamic_layer():
    callback = AdaptiveQuantileClipping(make_data(), patience=1, steps_per_update=2)
    model = make_model(middle=L.DP_ClipGradient(0.5, mode="dynamic"), dynamic=callback)
    assert model.privacy_plan().releases[1].count(3) == 3 * 2 * 2


@pytest.mark.parametrize("kind", ["laplace", "quantiles"])
def test_plan_composes_the_declared_clipping_before_fit(kind):
    """The drift of issue 10: the epsilon planned before fit did not include the clipping
    releases until the callback was attached. Now the undeclared model is refused and the
    declared one counts them from the start."""
    if kind == "laplace":
        callback = LaplaceAdaptiveLossGradientClipping(make_data(), epsilon=0.1)
        extra = Laplace(0.1)
    else:
        callback = AdaptiveQuantileClipping(make_data(), noise_multiplier=2.0)
        extra = SubsampledGaussian(2.0, BATCH / N)
    with pytest.raises(ValueError, match="mode='dynamic'"):
        get_eps_delta(make_model(), 4)
    fixed = make_model(mode="fixed")
    declared = make_model(dynamic=callback)
    eps_without, _ = get_eps_delta(fixed, 4)
    eps_with, _ = get_eps_delta(declared, 4)
    assert eps_with > eps_without
    steps = 4 * (N // BATCH)
    expected = autodp_epsilon([(SubsampledGaussian(1.0, BATCH / N), steps), (extra, 4)], 1e-5)
    assert eps_with == pytest.approx(expected, rel=1e-6)
    callback.set_model(declared)  # attaching changes nothing
    assert get_eps_delta(declared, 4)[0] == eps_with
