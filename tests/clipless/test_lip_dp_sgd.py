"""Lip-DP-SGD (issue 12): norm balls of radius C, bounds from the current weights, the
paper's group normalisation -- against exact SVDs, explicit Jacobians, numpy references
and per-example gradients. The adversarial S1 search over these layers is in
``tests/clipless/test_soundness.py`` (``NORM_BALL_CASES`` of ``tests/cases.py``)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses, projections
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation.variables import variable_key
from tests.cases import IMG, VEC, build


def _sigma_max(matrix) -> float:
    return float(np.linalg.svd(np.asarray(matrix, dtype="float64"), compute_uv=False)[0])


def _kernel_matrix(layer):
    return np.asarray(layer.kernel).reshape(-1, layer.kernel.shape[-1])


# ----------------------------------------------------------------- projections
@pytest.mark.parametrize("radius", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("constraint", ["spectral", "frobenius", "orthogonal"])
def test_projection_lands_in_the_ball_of_radius_c(constraint, radius, rng):
    layer = L.DP_QuickSpectralDense(
        6, constraint=constraint, weight_norm_bound=radius, bjorck_iterations=15
    )
    layer.build((None, 9))
    layer.kernel.assign(5.0 * rng.normal(size=(9, 6)).astype("float32"))
    layer.project()
    matrix = _kernel_matrix(layer)
    norm = np.linalg.norm(matrix) if constraint == "frobenius" else _sigma_max(matrix)
    assert norm <= radius
    if constraint == "orthogonal":  # C times an orthogonal matrix: every sigma near C
        sigmas = np.linalg.svd(matrix, compute_uv=False)
        np.testing.assert_allclose(sigmas, radius, rtol=2e-3)
    else:  # the kernel was far outside: the projection puts it on the boundary
        assert norm == pytest.approx(radius, rel=2e-3)


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (20, 20)])
def test_certified_operator_norm_is_an_upper_bound_and_tight(shape, rng):
    for scale in (1e-3, 1.0, 50.0):
        matrix = (scale * rng.normal(size=shape)).astype("float32")
        exact = _sigma_max(matrix)
        spectral = float(projections.certified_operator_norm(tf.constant(matrix), "spectral"))
        frobenius = float(projections.certified_operator_norm(tf.constant(matrix), "frobenius"))
        assert exact <= spectral <= exact * (1 + 2e-6)
        assert np.linalg.norm(matrix.astype("float64")) <= frobenius
        assert spectral <= frobenius


def _conv_operator_norm(layer, input_shape) -> float:
    """Exact operator norm of the convolution: SVD of its explicit Jacobian."""
    x = tf.zeros((1, *input_shape))
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
    jacobian = tape.jacobian(y, x)
    return _sigma_max(np.reshape(jacobian, (int(np.prod(y.shape)), int(np.prod(input_shape)))))


@pytest.mark.parametrize("constraint", ["spectral", "frobenius"])
@pytest.mark.parametrize("strides,padding", [(1, "same"), (1, "valid"), (2, "same")])
def test_conv_operator_norm_is_below_the_adaptive_bound(constraint, strides, padding, rng):
    """The paper's sqrt(h'w') factor, written into the effective kernel: the exact
    operator norm of the convolution never exceeds the norm of the stored kernel."""
    layer = L.DP_QuickSpectralConv2D(
        3,
        3,
        strides=strides,
        padding=padding,
        constraint=constraint,
        weight_norm_bound=2.0,
        adaptive_norm=True,
    )
    layer.build((None, 7, 7, 2))
    for scale in (0.1, 10.0):  # inside the ball, then projected onto its boundary
        layer.kernel.assign(scale * rng.normal(size=layer.kernel.shape).astype("float32"))
        layer.project()
        exact = _conv_operator_norm(layer, (7, 7, 2))
        bound = float(layer.operator_norm_bound())
        assert exact <= bound <= 2.0
    # A box filter (the same weight on all 9 taps, ||M||_2 = 1.5 inside the ball) nearly
    # attains the bound on a smooth input: the bound is reached, not only respected.
    if strides == 1 and padding == "same" and constraint == "spectral":
        kernel = np.zeros(layer.kernel.shape, "float32")
        kernel[:, :, 0, 0] = 1.5 / 3.0
        layer.kernel.assign(kernel)
        exact = _conv_operator_norm(layer, (7, 7, 2))
        bound = float(layer.operator_norm_bound())
        assert bound == pytest.approx(1.5, rel=1e-5)
        assert 0.8 * bound < exact <= bound


# ------------------------------------------------------------ adaptive bounds
def _three_layer_model(adaptive=True, constraint="spectral", radii=(2.0, 1.5, 0.8), n=None):
    """d1, d2: DP_SpectralDense(16) with ``constraint``; d3: a Frobenius ball (5 logits).
    ``n``: the declared training set size (the examples ``fit`` receives)."""

    def ball(cls, units, norm, radius, name):
        return cls(units, constraint=norm, weight_norm_bound=radius, adaptive_norm=adaptive,
                   name=name)  # fmt: skip

    return build(
        [
            ball(L.DP_SpectralDense, 16, constraint, radii[0], "d1"),
            L.DP_GroupSort(2),
            ball(L.DP_SpectralDense, 16, constraint, radii[1], "d2"),
            L.DP_GroupSort(2),
            ball(L.DP_QuickFrobeniusDense, 5, "frobenius", radii[2], "d3"),
        ],
        VEC,
        nb_samples_train=n,
    )


def test_sensitivities_are_the_hand_product_of_the_current_norms(rng):
    """B_k = L * X_0 * prod_{i != k} c_i with c_i = min(C_i, ||W_i||) from numpy."""
    model, _, _ = _three_layer_model()
    dense = [layer for layer in model.dp_layers if isinstance(layer, L.DP_SpectralDense)]
    last = model.dp_layers[-1]
    # Kernels strictly inside their balls, of different norms.
    for layer, scale in zip([*dense, last], (0.5, 0.7, 0.2)):
        w = rng.normal(size=layer.kernel.shape).astype("float32")
        layer.kernel.assign(scale * w / np.linalg.norm(w, 2 if layer in dense else None))
    norms = [_sigma_max(_kernel_matrix(d)) for d in dense] + [np.linalg.norm(_kernel_matrix(last))]
    caps = (2.0, 1.5, 0.8)
    c = [min(cap, n) for cap, n in zip(caps, norms)]
    lip, x0 = math.sqrt(2.0), 3.0
    expected = {
        "d1/kernel": lip * x0 * c[1] * c[2],
        "d2/kernel": lip * x0 * c[0] * c[2],
        "d3/kernel": lip * x0 * c[0] * c[1],
    }
    declared = {e.key: float(e.bound) for e in model.bounds().variables}
    assert declared == pytest.approx(expected, rel=5e-6)
    # The Lipschitz constant and the output bound follow the same norms.
    bounds = model.bounds()
    assert float(bounds.lipschitz) == pytest.approx(np.prod(c), rel=5e-6)
    assert float(bounds.output_bound) == pytest.approx(x0 * np.prod(c), rel=5e-6)


def test_sensitivities_shrink_with_the_norms_and_equal_fixed_bounds_at_the_radius():
    """Orthogonal kernels times C sit on the boundary: adaptive == fixed. Halving one
    kernel halves every other layer's bound in adaptive mode only."""
    adaptive, _, _ = _three_layer_model(True, "orthogonal")
    fixed, _, _ = _three_layer_model(False, "orthogonal")
    fixed.set_weights(adaptive.get_weights())
    bound_a = {e.key: float(e.bound) for e in adaptive.bounds().variables}
    bound_f = {e.key: float(e.bound) for e in fixed.bounds().variables}
    # The fixed bounds use C; the adaptive ones min(C, sigma_max) with sigma_max within
    # the Björck round-off of C (the last layer is a Frobenius ball: its kernel is inside).
    for key in ("d1/kernel", "d2/kernel"):  # (float32 products: 1e-6)
        assert bound_a[key] == pytest.approx(bound_f[key], rel=1e-6)
    d1 = adaptive.dp_layers[1]
    d1.kernel.assign(0.5 * d1.kernel)
    halved = {e.key: float(e.bound) for e in adaptive.bounds().variables}
    assert halved["d1/kernel"] == pytest.approx(bound_a["d1/kernel"], rel=1e-6)
    assert halved["d2/kernel"] == pytest.approx(0.5 * bound_a["d2/kernel"], rel=1e-5)
    assert halved["d3/kernel"] == pytest.approx(0.5 * bound_a["d3/kernel"], rel=1e-5)
    # Fixed-norm bounds do not move.
    fixed.dp_layers[1].kernel.assign(0.5 * fixed.dp_layers[1].kernel)
    assert {e.key: float(e.bound) for e in fixed.bounds().variables} == bound_f


def test_at_the_radius_adaptive_bounds_equal_fixed_bounds_exactly():
    """Spectral ball, kernels pushed outside then projected: sigma_max = C / (1 + margin)
    < C, so min(C, .) is the certified norm, within the projection margin of C."""
    adaptive, _, _ = _three_layer_model(True, "spectral")
    for layer in adaptive.dp_layers[1:]:
        if hasattr(layer, "kernel"):
            layer.kernel.assign(100.0 * layer.kernel)
    adaptive.project()
    fixed, _, _ = _three_layer_model(False, "spectral")
    bound_a = {e.key: float(e.bound) for e in adaptive.bounds().variables}
    bound_f = {e.key: float(e.bound) for e in fixed.bounds().variables}
    for key, value in bound_f.items():
        assert bound_a[key] == pytest.approx(value, rel=3e-3)  # margin 1e-3 per layer
        assert bound_a[key] <= value


def test_noise_follows_the_weights_inside_a_traced_step():
    """The bound pass runs in-graph: a traced function reads the kernel at each call."""
    model, _, _ = _three_layer_model()

    @tf.function
    def stddevs():
        return [model.noise_stddevs()[variable_key(v)] for v in model.trainable_variables]

    before = [float(s) for s in stddevs()]
    d1 = model.dp_layers[1]
    d1.kernel.assign(0.25 * d1.kernel)
    after = [float(s) for s in stddevs()]
    # Global strategy: one std for all, sqrt(sum B_k^2) / b; every term but d1's shrinks.
    assert after[0] < before[0]
    assert stddevs.experimental_get_tracing_count() == 1


def test_a_training_step_uses_and_keeps_the_ball(rng):
    model, x, y = _three_layer_model(n=4)  # fit on the batch of 4 built with it
    model.fit(x, y, batch_size=x.shape[0], epochs=2, verbose=0)
    for layer, cap in zip([model.dp_layers[i] for i in (1, 3, 5)], (2.0, 1.5, 0.8)):
        matrix = _kernel_matrix(layer)
        norm = np.linalg.norm(matrix) if layer.constraint == "frobenius" else _sigma_max(matrix)
        assert norm <= cap


def test_the_audit_reads_the_radius_and_the_current_norms():
    """lipdp.clipless.audit compares exact operator norms with what the bounds use: C (fixed) or
    the current certified norm (adaptive); a kernel set outside the ball is caught."""
    from lipdp.clipless.audit import audit_model

    adaptive, _, _ = _three_layer_model()
    records = audit_model(adaptive)
    assert len(records) == 3 and all(r.ok for r in records)
    fixed, _, _ = _three_layer_model(False)
    d1 = fixed.dp_layers[1]
    d1.kernel.assign(3.0 * d1.kernel / float(_sigma_max(_kernel_matrix(d1))))  # norm 3 > C = 2
    assert not audit_model(fixed)[0].ok


def test_privacy_report_says_the_bounds_follow_the_weights():
    from lipdp.core.report import privacy_report

    adaptive, x, y = _three_layer_model()
    fixed, _, _ = _three_layer_model(False)
    assert "norm-adaptive bounds" in str(privacy_report(adaptive, epochs=1))
    assert "norm-adaptive bounds" not in str(privacy_report(fixed, epochs=1))


def test_config_round_trip_and_bad_arguments():
    layer = L.DP_QuickSpectralConv2D(4, 3, weight_norm_bound=2.5, adaptive_norm=True)
    config = layer.get_config()
    assert config["weight_norm_bound"] == 2.5 and config["adaptive_norm"] is True
    clone = L.DP_QuickSpectralConv2D.from_config(config)
    assert clone.weight_norm_bound == 2.5 and clone.adaptive_norm is True
    with pytest.raises(ValueError, match="weight_norm_bound"):
        L.DP_SpectralDense(4, weight_norm_bound=0.0)
    with pytest.raises(ValueError, match="adaptive_norm"):
        L.DP_SpectralDense(4, adaptive_norm="yes")


def test_saved_model_keeps_the_ball(tmp_path):
    model, x, _ = _three_layer_model()
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert [float(e.bound) for e in loaded.bounds().variables] == pytest.approx(
        [float(e.bound) for e in model.bounds().variables], rel=1e-6
    )
    assert loaded.dp_layers[1].adaptive_norm and loaded.dp_layers[1].weight_norm_bound == 2.0


# ------------------------------------------------------- group normalisation
def _group_norm_reference(x, groups, alpha):
    """numpy, float64: (x_q - mean) / max(alpha, std) per example and channel group."""
    x = np.asarray(x, dtype="float64")
    c = x.shape[-1]
    grouped = x.reshape(x.shape[0], -1, groups, c // groups)
    centred = grouped - grouped.mean(axis=(1, 3), keepdims=True)
    std = np.sqrt((centred**2).mean(axis=(1, 3), keepdims=True))
    return (centred / np.maximum(alpha, std)).reshape(x.shape)


@pytest.mark.parametrize("shape,groups", [((12,), 4), ((5, 5, 6), 3), ((4, 4, 4), 1)])
def test_group_normalization_matches_the_formula(shape, groups, rng):
    layer = L.DP_GroupNormalization(groups=groups, alpha=0.7)
    x = rng.normal(size=(6, *shape)).astype("float32") * rng.choice(
        [0.01, 1, 30], (6,) + (1,) * len(shape)
    )
    np.testing.assert_allclose(
        layer(x), _group_norm_reference(x, groups, 0.7), rtol=1e-4, atol=1e-6
    )


def test_group_normalization_lipschitz_and_output_bound_under_attack(rng):
    """Pairs (x, x') pushed by gradient ascent on ||f(x) - f(x')|| / ||x - x'||: the
    ratio never exceeds 1/alpha; outputs never exceed min(X / alpha, sqrt(N))."""
    alpha, shape = 0.5, (3, 3, 4)
    layer = L.DP_GroupNormalization(groups=2, alpha=alpha)
    layer.build((None, *shape))
    x = tf.Variable(rng.normal(size=(16, *shape)).astype("float32") * 0.2)
    x2 = tf.Variable(x + 0.01 * rng.normal(size=(16, *shape)).astype("float32"))
    worst = 0.0
    for _ in range(30):
        with tf.GradientTape() as tape:
            diff = tf.reshape(layer(x) - layer(x2), (16, -1))
            gap = tf.reshape(x - x2, (16, -1))
            ratio = tf.norm(diff, axis=1) / tf.norm(gap, axis=1)
            objective = tf.reduce_sum(ratio)
        worst = max(worst, float(tf.reduce_max(ratio)))
        for var, g in zip((x, x2), tape.gradient(objective, (x, x2))):
            var.assign_add(0.05 * g / (tf.norm(g) + 1e-12))
    assert 0.5 / alpha < worst <= (1 + 1e-4) / alpha  # reached near the kink, never above
    for scale in (1e-3, 0.1, 100.0):
        xs = scale * rng.normal(size=(8, *shape)).astype("float32")
        norms = np.linalg.norm(xs.reshape(8, -1), axis=1)
        out = np.linalg.norm(np.reshape(layer(xs), (8, -1)), axis=1)
        bounds = [float(layer.propagate_inputs(float(n))) for n in norms]
        assert np.all(out <= np.array(bounds) * (1 + 1e-5))
    assert float(layer.propagate_inputs(1e6)) == pytest.approx(math.sqrt(36))


def test_group_normalization_has_finite_gradients_on_constant_groups():
    layer = L.DP_GroupNormalization(groups=2, alpha=0.5)
    x = tf.zeros((2, 8))
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = tf.reduce_sum(layer(x) * tf.range(8, dtype=tf.float32))
    assert np.all(np.isfinite(tape.gradient(out, x)))


def test_group_normalization_refuses_groups_not_dividing_channels():
    with pytest.raises(ValueError, match="must divide"):
        L.DP_GroupNormalization(groups=5, alpha=1.0).build((None, 12))
    with pytest.raises(ValueError, match="alpha"):
        L.DP_GroupNormalization(groups=2, alpha=0.0)


# ---------------------------------------------------- the batch-maximum leak
def _summed_gradient(model, x, y):
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(model.loss.call(tf.constant(y), model(tf.constant(x))))
    return tf.concat(
        [tf.reshape(g, [-1]) for g in tape.gradient(total, model.trainable_variables)], 0
    )


def test_the_batch_maximum_input_norm_of_the_paper_leaks_and_the_public_bound_does_not(rng):
    """Lip-DP-SGD as published releases ``(1 / X_k) sum_i grad_i + noise`` with
    ``X_k = max_i ||x_i||`` over the batch and noise calibrated for sensitivity
    ``Delta = tau * prod c_i`` (one dense layer: the loss constant L). Adding ONE example
    of norm within the public bound moves that sum by far more than Delta. lipdp divides
    by nothing: its per-example bound uses the public X_0 and holds for the same pair."""
    x0 = 10.0
    model, _, _ = build(
        [L.DP_SpectralDense(5, constraint="spectral", adaptive_norm=True)],
        VEC,
        loss=losses.DP_TauCategoricalCrossentropy(tau=1.0),
        upper_bound=x0,
    )
    n = 64
    direction = rng.normal(size=VEC).astype("float32")
    small = np.tile(0.1 * direction / np.linalg.norm(direction), (n, 1))  # aligned, norm 0.1
    labels = np.tile(np.eye(5, dtype="float32")[:1], (n, 1))
    big = (x0 * direction / np.linalg.norm(direction))[None].astype("float32")
    x_with, y_with = np.concatenate([small, -big]), np.concatenate([labels, labels[:1]])

    claimed = model.loss.get_L()  # the paper's Delta for the last (only) layer
    # The paper's rule: divide by the batch maximum.
    paper = _summed_gradient(model, small, labels) / 0.1
    paper_with = _summed_gradient(model, x_with, y_with) / x0
    paper_change = float(tf.norm(paper - paper_with))
    assert paper_change > 10 * claimed  # measured ~ n * L * 0.7: a leak by a factor > 10

    # lipdp: the raw summed gradient; one example moves it by at most its per-example
    # bound B = L * X_0 (the public bound), the sensitivity the noise is calibrated for.
    lipdp_change = float(
        tf.norm(_summed_gradient(model, small, labels) - _summed_gradient(model, x_with, y_with))
    )
    (entry,) = model.bounds().variables
    assert lipdp_change <= float(entry.bound) * (1 + ROUNDOFF_SLACK)
    assert lipdp_change > 0.5 * float(entry.bound)  # the pair is a near worst case


def test_image_case_builds_with_group_normalization():
    model, x, _ = build(
        [
            L.DP_QuickSpectralConv2D(4, 3, weight_norm_bound=2.0, adaptive_norm=True),
            L.DP_GroupNormalization(groups=2, alpha=0.3),
            L.DP_GroupSort(2),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(5, adaptive_norm=True),
        ],
        IMG,
    )
    bounds = model.bounds()
    # The cap sqrt(N) of the group normalisation sets the input bound of what follows.
    assert float(bounds.input_bounds[3]) <= math.sqrt(6 * 6 * 4) * (1 + 1e-6)


# ------------------------------------------------------- parameter averaging
def test_parameter_averaging_is_the_ema_of_the_projected_iterates():
    from lipdp.core.callbacks import ParameterAveraging

    model, x, y = _three_layer_model(True, "orthogonal", n=8)  # fit on x and -x below
    seen = []
    recorder = tf.keras.callbacks.LambdaCallback(  # Keras 3 passes logs= by keyword
        on_train_batch_end=lambda *_, **__: seen.append(
            [v.numpy() for v in model.trainable_variables]
        )
    )
    averaging = ParameterAveraging(decay=0.6)
    xs, ys = np.concatenate([x, -x]), np.concatenate([y, y[::-1]])  # two batches of 4
    model.fit(xs, ys, batch_size=4, epochs=3, verbose=0, callbacks=[recorder, averaging])
    assert len(seen) == 6
    expected = [w.astype("float64") for w in seen[0]]
    for weights in seen[1:]:
        expected = [0.6 * e + 0.4 * w for e, w in zip(expected, weights)]
    for variable, value in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(variable.numpy(), value, rtol=1e-5, atol=1e-6)
    # The average of C-scaled orthogonal kernels stays in the spectral ball of radius C:
    # the fixed bounds of the layers remain upper bounds.
    for layer, cap in zip([model.dp_layers[i] for i in (1, 3)], (2.0, 1.5)):
        assert _sigma_max(_kernel_matrix(layer)) <= cap
    assert not np.allclose(model.trainable_variables[0].numpy(), seen[-1][0])
    with pytest.raises(ValueError, match="decay"):
        ParameterAveraging(decay=1.0)


def test_group_normalization_saves_and_loads(tmp_path, rng):
    model, x, _ = build(
        [
            L.DP_SpectralDense(16, constraint="spectral", adaptive_norm=True),
            L.DP_GroupNormalization(groups=4, alpha=0.3, name="gn"),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(5),
        ],
        VEC,
    )
    path = str(tmp_path / "gn.keras")
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)
    layer = loaded.get_layer("gn")
    assert (layer.groups, layer.alpha) == (4, 0.3)
    assert float(loaded.bounds().output_bound) == pytest.approx(
        float(model.bounds().output_bound), rel=1e-6
    )


def test_one_certified_norm_per_kernel_per_training_step():
    """The bound pass asks each layer for its Lipschitz factor three times (forward
    bound, Lipschitz constant, backward bound); the eigen-solve runs once per kernel."""
    model, x, y = _three_layer_model()  # two spectral kernels (eigen-solve), one Frobenius

    @tf.function
    def stddevs():  # one bound pass
        per_variable = model.noise_stddevs()
        return [per_variable[variable_key(v)] for v in model.trainable_variables]

    graph = stddevs.get_concrete_function().graph
    eigen = [op for op in graph.get_operations() if op.type.startswith("SelfAdjointEig")]
    assert len(eigen) == 2
    # Outside a pass nothing is memoised: the norm follows an assignment at once.
    d1 = model.dp_layers[1]
    before = float(d1.operator_norm_bound())
    d1.kernel.assign(0.5 * d1.kernel)
    assert float(d1.operator_norm_bound()) == pytest.approx(0.5 * before, rel=1e-5)
