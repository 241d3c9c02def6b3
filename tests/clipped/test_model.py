"""lipdp.clipped.model (issue 13, first part): clipped DP-SGD with flat clipping, against
tensorflow-privacy, a naive per-example loop, adversarial inputs and measured noise."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.accounting import get_eps_delta
from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential, SharpnessAscent
from lipdp.core import noise
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.core.report import privacy_report
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.pipeline import poisson_batches
from tests.marks import thorough
from tests.reference_helpers import requires_tensorflow_privacy

BATCH, FEATURES, CLASSES = 8, 6, 3


def _layers():
    return [
        tf.keras.layers.Dense(16, activation="tanh", input_shape=(FEATURES,)),
        tf.keras.layers.Dense(CLASSES),
    ]


def _model(
    sigma=1.0,
    clip=0.5,
    n=64,
    sampling="shuffle",
    lr=0.5,
    strategy="global",
    method="ghost",
    ascent=None,
):
    """``clip``: a norm (flat clipping) or a Clipping."""
    clipping = clip if isinstance(clip, Clipping) else Clipping("flat", clip)
    meta = DatasetMetadata(
        input_shape=(FEATURES,),
        nb_classes=CLASSES,
        nb_samples_train=n,
        batch_size=BATCH,
        sampling=sampling,
    )
    params = DPParameters(strategy, sigma, 1e-5, non_private=sigma == 0)
    model = DPSGD_Sequential(
        _layers(),
        dp_parameters=params,
        clipping=clipping,
        dataset_metadata=meta,
        gradient_method=method,
        ascent=ascent,
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(lr),
        metrics=["accuracy"],
    )
    return model


def _batch(rng, n=BATCH, scale=3.0):
    x = (scale * rng.normal(size=(n, FEATURES))).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, n)]
    return x, y


def _naive_factor(clipping, norm):
    """The clipping factors of the papers, in plain Python."""
    r = clipping.clip_norm
    if clipping.mode == "flat":
        return min(1.0, r / norm) if norm > 0 else 1.0
    if clipping.mode == "automatic":
        return r / (norm + clipping.gamma)
    return r / clipping.threshold if norm <= clipping.threshold else 0.0


def _naive_clipped_sum(model, x, y, clip):
    """Reference: one GradientTape per example, clipped to ``clip`` (a norm: flat
    clipping, or a Clipping), summed (rows with a NaN skipped). Per-layer clipping: each
    Dense layer (kernel and bias, two variables) to its radius."""
    clipping = clip if isinstance(clip, Clipping) else Clipping("flat", clip)
    total = [np.zeros(v.shape, "float64") for v in model.trainable_variables]
    if clipping.mode == "per-layer":
        shares = np.array(clipping.layer_shares or (1.0, 1.0))
        radii = clipping.clip_norm * shares / np.linalg.norm(shares)
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    for xi, yi in zip(x, y):
        if not (np.all(np.isfinite(xi)) and np.all(np.isfinite(yi))):
            continue
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model(xi[None]))
        grads = [
            g.numpy().astype("float64") for g in tape.gradient(loss, model.trainable_variables)
        ]
        if clipping.mode == "per-layer":
            factors = []
            for layer, r in enumerate(radii):
                pair = grads[2 * layer : 2 * layer + 2]
                norm = np.sqrt(sum(np.sum(g**2) for g in pair))
                factors += [min(1.0, r / norm)] * 2
        else:
            factors = [_naive_factor(clipping, np.sqrt(sum(np.sum(g**2) for g in grads)))] * 4
        total = [t + f * g for t, f, g in zip(total, factors, grads)]
    return total


def _per_example_norms(model, x, y):
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    norms = []
    for xi, yi in zip(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model(xi[None]))
        grads = tape.gradient(loss, model.trainable_variables)
        norms.append(float(tf.sqrt(tf.add_n([tf.reduce_sum(g**2) for g in grads]))))
    return np.array(norms)


@requires_tensorflow_privacy
# Both methods by default: tensorflow-privacy imports on Keras 2 only, whose CI run is the
# default tier (.ci/run); on Keras 3 both are skipped.
@pytest.mark.parametrize("method", ["ghost", "jacobian"])
def test_noiseless_step_equals_tensorflow_privacy(method, rng):
    """Flat clipping, noise off: the update of DPKerasSGDOptimizer (one microbatch per
    example) on the same weights and batch."""
    from tensorflow_privacy import DPKerasSGDOptimizer

    model = _model(sigma=0.0, clip=2.0, method=method)
    x, y = _batch(rng)
    reference = tf.keras.Sequential(_layers())
    reference.build((None, FEATURES))
    reference.set_weights([v.numpy() for v in model.trainable_variables])
    reference.compile(
        optimizer=DPKerasSGDOptimizer(
            l2_norm_clip=2.0, noise_multiplier=0.0, num_microbatches=BATCH, learning_rate=0.5
        ),
        loss=tf.keras.losses.CategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE
        ),
    )
    norms = _per_example_norms(model, x, y)
    assert np.sum(norms > 2.0) >= 2 and np.sum(norms < 2.0) >= 1  # clipped and unclipped rows
    start = [v.numpy() for v in model.trainable_variables]
    reference.train_on_batch(x, y)
    model.train_on_batch(x, y)
    assert not np.allclose(start[0], model.trainable_variables[0].numpy())
    for ours, theirs in zip(model.trainable_variables, reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


MODES = [
    Clipping("flat", 0.3),
    Clipping("per-layer", 0.3, layer_shares=(1.0, 3.0)),
    Clipping("automatic", 0.3, gamma=0.05),
    Clipping("global", 0.3, threshold=4.0),
]


@pytest.mark.parametrize("clipping", MODES, ids=lambda c: c.mode)
def test_clipped_sum_equals_a_naive_loop_and_skips_non_finite_rows(clipping, rng):
    model = _model(clip=clipping)
    x, y = _batch(rng)
    x[2, 1] = np.nan  # rule S9: this row contributes nothing
    y[5] = np.inf
    summed, _, finite = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    assert list(np.asarray(finite)) == [True, True, False, True, True, False, True, True]
    for ours, reference in zip(summed, _naive_clipped_sum(model, x, y, clipping)):
        np.testing.assert_allclose(ours, reference, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    "clipping",
    [
        Clipping("flat", 0.2),
        # The other modes' remove-one checks run by default in test_train_step.py and
        # test_extreme_records.py; their searches here are thorough.
        pytest.param(Clipping("per-layer", 0.2, layer_shares=(2.0, 1.0)), marks=thorough),
        pytest.param(Clipping("automatic", 0.2), marks=thorough),
        Clipping("global", 0.2, threshold=3.0),
        "bam",
    ],
    ids=lambda c: getattr(c, "mode", c),
)
def test_one_row_moves_the_sum_by_at_most_the_clip_norm_under_attack(clipping, rng):
    """Gradient ascent on one row's input to maximise its gradient norm (towards the
    global threshold Z, where the contribution peaks, for global clipping): its clipped
    contribution (sum with it minus sum without it) never exceeds R, nor R_l on the
    variables of layer l under per-layer clipping. ``"bam"``: flat clipping after BAM's
    per-example ascent."""
    ascent = None
    if clipping == "bam":
        clipping, ascent = Clipping("flat", 0.2), SharpnessAscent("bam", 0.5)
    strategy = "per-layer" if clipping.mode == "per-layer" else "global"
    model = _model(clip=clipping, strategy=strategy, ascent=ascent)
    layer_bounds = [d * BATCH for _, d in model.sensitivities()]  # R_l (1 + slack)
    clipped_sum = tf.function(model.clipped_gradient_sum)  # traced once per batch size
    x, y = _batch(rng, scale=1.0)
    others = tf.constant(x[1:]), tf.constant(y[1:])
    row = tf.Variable(x[:1])
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    worst = 0.0
    for _ in range(15):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = loss_fn(y[:1], model(row))
            grads = inner.gradient(loss, model.trainable_variables)
            raw = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]))
            if clipping.mode == "global":  # climb to Z, not past it (beyond Z it counts 0)
                raw = -tf.abs(raw - clipping.threshold)
        with_row, _, _ = clipped_sum(
            tf.concat([row, others[0]], 0), tf.concat([y[:1], others[1]], 0)
        )
        without, _, _ = clipped_sum(*others)
        squares = [np.sum((a - b) ** 2) for a, b in zip(with_row, without)]
        change = np.sqrt(sum(squares))
        worst = max(worst, change)
        assert change <= 0.2 * (1 + ROUNDOFF_SLACK)
        if strategy == "per-layer":  # kernel and bias of each Dense layer
            for layer, bound in enumerate(layer_bounds):
                assert np.sqrt(sum(squares[2 * layer : 2 * layer + 2])) <= bound
        step = outer.gradient(raw, row)
        row.assign_add(_STEP[clipping.mode] * step / (tf.norm(step) + 1e-12))
    assert worst > 0.17  # the attack comes near the clip norm: the check is not vacuous


_STEP = {"flat": 5.0, "per-layer": 5.0, "automatic": 5.0, "global": 0.3}


@pytest.mark.smoke
def test_noise_standard_deviation_measured_end_to_end(rng):
    """One step with noise minus the same step without, divided by the learning rate:
    its standard deviation is sigma * R / b."""
    noise.use_reproducible_noise(7)
    try:
        sigma, clip = 3.0, 0.5
        noisy = _model(sigma=sigma, clip=clip, lr=1.0)
        quiet = _model(sigma=0.0, clip=clip, lr=1.0)
        quiet.set_weights(noisy.get_weights())
        x, y = _batch(rng)
        start = [v.numpy() for v in noisy.trainable_variables]
        noisy.train_on_batch(x, y)
        quiet.train_on_batch(x, y)
        pairs = zip(noisy.trainable_variables, quiet.trainable_variables)
        difference = np.concatenate([(a.numpy() - b.numpy()).ravel() for a, b in pairs])
        expected = sigma * clip * (1 + ROUNDOFF_SLACK) / BATCH
        assert difference.size == sum(w.size for w in start)
        assert np.std(difference) == pytest.approx(expected, rel=0.08)
        assert abs(np.mean(difference)) < 4 * expected / np.sqrt(difference.size)
    finally:
        noise.use_reproducible_noise(None)


def test_per_layer_noise_is_one_mechanism_per_layer(rng):
    """Per-layer clipping with noisify_strategy='per-layer': layer l's noise has standard
    deviation sigma R_l / b (measured), the accountant sees one multiplier sigma per layer
    (as many mechanisms as layers), and the report lists each layer's sensitivity."""
    noise.use_reproducible_noise(11)
    try:
        sigma, clipping = 2.0, Clipping("per-layer", 0.5, layer_shares=(3.0, 1.0))
        noisy = _model(sigma=sigma, clip=clipping, lr=1.0, strategy="per-layer")
        quiet = _model(sigma=0.0, clip=clipping, lr=1.0, strategy="per-layer")
        quiet.set_weights(noisy.get_weights())
        x, y = _batch(rng)
        noisy.train_on_batch(x, y)
        quiet.train_on_batch(x, y)
        radii = 0.5 * np.array([3.0, 1.0]) / np.sqrt(10.0)
        # The trainable variables (Keras 3 lists the model's privacy state first in
        # get_weights, Keras 2 last): kernel and bias of each layer.
        trained = [
            (a.numpy(), b.numpy())
            for a, b in zip(noisy.trainable_variables, quiet.trainable_variables)
        ]
        for layer, r in enumerate(radii):
            pairs = trained[2 * layer : 2 * layer + 2]
            difference = np.concatenate([(a - b).ravel() for a, b in pairs])
            expected = sigma * r * (1 + ROUNDOFF_SLACK) / BATCH
            assert np.std(difference) == pytest.approx(expected, rel=0.2 if layer else 0.1)
    finally:
        noise.use_reproducible_noise(None)
    assert noisy.noise_multipliers() == [sigma, sigma]
    report = str(privacy_report(noisy, epochs=1))
    assert "(per-layer clipping)" in report


def test_dp_sat_ascends_along_the_previous_released_gradient(tmp_path, rng):
    """DP-SAT: the first step has no ascent; the second step's clipped sum is the one at
    theta + rho u / ||u||, u the first step's released (noisy) gradient = (theta_0 -
    theta_1) / lr under SGD; the weights are restored exactly; the state is saved."""
    rho, lr = 0.4, 0.5
    model = _model(sigma=1.0, clip=0.5, lr=lr, ascent=SharpnessAscent("dp-sat", rho))
    plain = _model(sigma=0.0, clip=0.5)
    for v, w in zip(plain.trainable_variables, model.trainable_variables):
        v.assign(w)
    x, y = _batch(rng)
    first, _, _ = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    for ours, theirs in zip(first, _naive_clipped_sum(plain, x, y, 0.5)):
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-6)  # no ascent yet
    theta0 = [v.numpy() for v in model.trainable_variables]
    model.train_on_batch(x, y)
    theta1 = [v.numpy() for v in model.trainable_variables]
    released = [(a - b) / lr for a, b in zip(theta0, theta1)]
    for kept, expected in zip(model.previous_noisy_gradient, released):
        np.testing.assert_allclose(kept.numpy(), expected, rtol=1e-4, atol=1e-6)
    x2, y2 = _batch(rng)
    summed, _, _ = model.clipped_gradient_sum(tf.constant(x2), tf.constant(y2))
    for v, before in zip(model.trainable_variables, theta1):
        np.testing.assert_array_equal(v.numpy(), before)  # restored bit for bit
    norm = np.sqrt(sum(np.sum(u**2) for u in released))
    for v, w, u in zip(plain.trainable_variables, theta1, released):
        v.assign(w + rho * u / norm)
    for ours, theirs in zip(summed, _naive_clipped_sum(plain, x2, y2, 0.5)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
    path = str(tmp_path / "dp_sat.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert loaded.ascent == SharpnessAscent("dp-sat", rho)
    for a, b in zip(loaded.previous_noisy_gradient, model.previous_noisy_gradient):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_privacy_plan_and_report_are_the_clipless_ones():
    """Same sigma, q and steps: the same epsilon as a clipless model (one subsampled
    Gaussian per step); the report states the clip-norm sensitivity."""
    from lipdp.clipless import layers as L
    from lipdp.clipless.model import DP_Sequential

    model = _model(sigma=1.2, n=400)
    clipless = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=1.0), L.DP_SpectralDense(3)],
        dp_parameters=DPParameters("global", 1.2, 1e-5),
        dataset_metadata=model.dataset_metadata,
    )
    assert model.noise_multipliers() == clipless.noise_multipliers() == [1.2]
    for epochs in (1, 3, 20):
        assert get_eps_delta(model, epochs) == get_eps_delta(clipless, epochs)
    assert model.privacy_plan().steps(3) == 3 * model.dataset_metadata.nb_steps_per_epochs
    report = str(privacy_report(model, epochs=3))
    assert "all variables (flat clipping): 0.0625" in report  # R / b = 0.5 / 8


@pytest.mark.smoke
def test_trains_on_poisson_batches_and_saves_its_privacy_state(tmp_path, rng):
    model = _model(sampling="poisson", n=64)
    x, y = _batch(rng, n=64)
    meta = model.dataset_metadata
    model.fit(
        poisson_batches(x, y, meta.sampling_rate, meta.nb_steps_per_epochs), epochs=2, verbose=0
    )
    assert int(model.noisy_steps) == 2 * meta.nb_steps_per_epochs
    path = str(tmp_path / "dpsgd.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert isinstance(loaded, DPSGD_Sequential)
    assert loaded.clipping == Clipping("flat", 0.5)
    for clipping in (
        Clipping("global", 0.5, threshold=3.0),
        Clipping("per-layer", 1, layer_shares=(1, 2)),
    ):
        assert Clipping.coerce(clipping.to_config()) == clipping
    assert loaded.gradient_method == "ghost"
    assert int(loaded.noisy_steps) == int(model.noisy_steps)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_misuse_is_refused_with_the_fix():
    params = DPParameters("global", 1.0, 1e-5)
    with pytest.raises(ValueError, match="batch statistics"):
        DPSGD_Sequential(
            [tf.keras.layers.Dense(4, input_shape=(3,)), tf.keras.layers.BatchNormalization()],
            dp_parameters=params,
        )
    with pytest.raises(ValueError, match="noisify_strategy='global'"):
        DPSGD_Sequential(_layers(), dp_parameters=DPParameters("per-layer", 1.0, 1e-5))
    with pytest.raises(ValueError, match="clip_norm"):
        Clipping("flat", 0.0)
    with pytest.raises(ValueError, match="clipping mode"):
        Clipping("per-sample", 1.0)
    with pytest.raises(ValueError, match="threshold=Z is required"):
        Clipping("global", 1.0)
    with pytest.raises(ValueError, match="threshold=Z is required"):
        Clipping("flat", 1.0, threshold=2.0)
    with pytest.raises(ValueError, match="layer_shares applies"):
        Clipping("flat", 1.0, layer_shares=(1.0, 2.0))
    with pytest.raises(ValueError, match="one share per such layer"):
        _model(
            clip=Clipping("per-layer", 1.0, layer_shares=(1.0, 2.0, 3.0)), strategy="per-layer"
        ).sensitivities()
    with pytest.raises(ValueError, match="gradient_method"):
        DPSGD_Sequential(_layers(), dp_parameters=params, gradient_method="loop")
    with pytest.raises(ValueError, match="needs gradient_method='ghost'"):
        DPSGD_Sequential(
            _layers(),
            dp_parameters=params,
            gradient_method="jacobian",
            ascent=SharpnessAscent("bam", 0.1),
        )
    with pytest.raises(ValueError, match="ascent mode"):
        SharpnessAscent("sam", 0.1)
    with pytest.raises(ValueError, match="ascent radius"):
        SharpnessAscent("bam", -1.0)
    model = DPSGD_Sequential(_layers(), dp_parameters=params)
    with pytest.raises(ValueError, match="reduction"):
        model.compile(
            loss=tf.keras.losses.CategoricalCrossentropy(reduction=tf.keras.losses.Reduction.SUM),
            optimizer="sgd",
        )
    assert not hasattr(model, "bounds")  # no layer-wise bounds: the clip norm is the bound
