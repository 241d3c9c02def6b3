"""DP_Model / DP_Sequential: noise calibration, projections, errors, serialisation."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import (
    ROUNDOFF_SLACK,
    DP_Model,
    DP_Sequential,
    DPParameters,
    compute_gradient_bounds,
    global_sensitivity,
)
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.cases import build
from tests.marks import thorough

SLACK = 1 + ROUNDOFF_SLACK


def _meta(batch=8, n=800, shape=(12,)):
    return DatasetMetadata(input_shape=shape, nb_classes=5, nb_samples_train=n, batch_size=batch)


def _model(dp_layers, strategy="global", sigma=1.0, batch=8, shape=(12,), bound=2.0, n=800, **kw):
    """A compiled DP_Sequential; ``n``: the declared training set size, which ``fit`` on
    arrays requires to be the number of examples fitted."""
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=shape, upper_bound=bound), *dp_layers],
        dp_parameters=DPParameters(strategy, sigma, 1e-5, **kw),
        dataset_metadata=_meta(batch, n=n, shape=shape),
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=1.0), optimizer=tf.keras.optimizers.SGD(1.0)
    )
    return model


# ------------------------------------------------------------------ bounds
def test_gradient_bounds_match_hand_derivation():
    # X = 2, L = sqrt(2), b = 8: every dense kernel gets X * L / b; the bias after a
    # dense layer of 5 units gets L / b; the conv+bias case multiplies by sqrt(h*w).
    model = _model(
        [
            L.DP_QuickSpectralDense(6),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(5),
            L.DP_AddBias(norm_max=3.0),
        ]
    )
    bounds = sorted(compute_gradient_bounds(model).values())
    x_l_b = 2.0 * math.sqrt(2) / 8 * SLACK
    assert bounds == pytest.approx(sorted([x_l_b, x_l_b, math.sqrt(2) / 8 * SLACK]))
    assert global_sensitivity(model) == pytest.approx(math.sqrt(2 * x_l_b**2 + 2 / 64 * SLACK**2))

    conv = _model(
        [
            L.DP_QuickSpectralConv2D(2, 3),
            L.DP_AddBias(norm_max=0.5),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(5),
        ],
        shape=(4, 4, 1),
    )
    by_name = compute_gradient_bounds(conv)
    bias = next(v for k, v in by_name.items() if "bias" in k)
    assert bias == pytest.approx(4.0 * math.sqrt(2) / 8 * SLACK)  # sqrt(16 positions) L / b
    _, output_bound = conv.input_bounds()
    assert output_bound == pytest.approx(2.0 + 4.0 * 0.5)


def test_clip_gradient_bound_is_in_graph_and_follows_the_variable():
    model = _model([L.DP_QuickSpectralDense(5), L.DP_ClipGradient(0.1, mode="dynamic")])
    first = float(next(iter(compute_gradient_bounds(model).values())))
    assert first == pytest.approx(2.0 * 0.1 / 8 * SLACK)
    model.dp_layers[-1].clip_value.assign(1.0)
    second = float(next(iter(compute_gradient_bounds(model).values())))
    assert second == pytest.approx(2.0 * 1.0 / 8 * SLACK)  # min(L = sqrt 2, 1) = 1


# ------------------------------------------------------------------- noise
def _bias_step_change(strategy, sigma, nm_coef=1.0):
    """Train one step with SGD(lr=1) and return the change of a wide, unconstrained bias."""
    model = _model(
        [L.DP_QuickSpectralDense(1024), L.DP_AddBias(norm_max=1e9, nm_coef=nm_coef)],
        strategy=strategy,
        sigma=sigma,
        n=8,
    )
    bias = model.dp_layers[-1].bias
    before = bias.numpy().copy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 12)).astype("float32")
    y = np.eye(1024, dtype="float32")[rng.integers(0, 1024, 8)]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    return model, before - bias.numpy()


@pytest.mark.smoke
@pytest.mark.parametrize("strategy", ["global", "per-layer"])
def test_noise_std_matches_sigma_times_sensitivity(strategy):
    sigma = 1000.0  # the gradient itself (norm <= sensitivity) is negligible next to the noise
    model, change = _bias_step_change(strategy, sigma, nm_coef=2.0)
    bounds = {e.key: d for e, d in model.sensitivities()}
    bias_delta = next(d for k, d in bounds.items() if "bias" in k)
    if strategy == "global":
        expected = sigma * math.sqrt(sum(d**2 for d in bounds.values()))
    else:
        expected = sigma * 2.0 * bias_delta  # nm_coef = 2
    # 1024 coordinates: the standard error of the empirical std is ~2.2 %.
    assert np.std(change) == pytest.approx(expected, rel=0.1)
    assert abs(np.mean(change)) < 4 * expected / math.sqrt(1024)


def test_noisify_direct_per_variable_stds():
    model = _model(
        [
            L.DP_QuickSpectralDense(256, nm_coef=3.0),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(128),
        ],
        strategy="per-layer",
        sigma=2.0,
    )
    variables = model.trainable_variables
    zeros = [tf.zeros_like(v) for v in variables]
    noisy = model.noisify(zeros, variables)
    bounds = {variable_key(e.variable): (d, e.nm_coef) for e, d in model.sensitivities()}
    for v, n in zip(variables, noisy):
        delta, coef = bounds[variable_key(v)]
        assert np.std(n.numpy()) == pytest.approx(2.0 * coef * delta, rel=0.05)


def test_non_private_reference_adds_no_noise():
    model = _model([L.DP_QuickSpectralDense(5)], sigma=0.0, non_private=True)
    zeros = [tf.zeros_like(v) for v in model.trainable_variables]
    assert all(np.all(n.numpy() == 0) for n in model.noisify(zeros, model.trainable_variables))


# -------------------------------------------------------------- projection
def test_training_keeps_weights_feasible():
    model, x, y = build(
        [
            L.DP_QuickSpectralConv2D(4, 3),
            L.DP_GroupSort(2),
            L.DP_Flatten(),
            L.DP_QuickFrobeniusDense(5),
            L.DP_AddBias(norm_max=0.25),
        ],
        (6, 6, 2),
        nb_samples_train=16,  # the 4 examples repeated 4 times below
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=1.0), optimizer=tf.keras.optimizers.SGD(5.0)
    )
    model.fit(np.repeat(x, 4, axis=0), np.repeat(y, 4, axis=0), batch_size=4, epochs=3, verbose=0)
    conv, dense, bias = model.dp_layers[1], model.dp_layers[4], model.dp_layers[5]
    assert np.linalg.norm(conv.kernel_matrix().numpy().astype("float64"), 2) <= 1 + 1e-5
    assert np.linalg.norm(dense.kernel.numpy().astype("float64")) <= 1 + 1e-6
    assert np.linalg.norm(bias.bias.numpy()) <= 0.25 + 1e-6


@pytest.mark.parametrize("constraint", ["orthogonal", "spectral", "frobenius"])
@pytest.mark.parametrize("cls", [L.DP_SpectralDense, L.DP_QuickFrobeniusDense, L.DP_SpectralConv2D])
def test_kernels_start_inside_their_set_when_the_model_is_built(cls, constraint):
    """The model's constructor builds the layers (Keras 3: by a symbolic call, inside a
    ``StatelessScope`` where an ``assign`` made in ``build`` is dropped): every kernel is in
    its set of radius 0.6 before any step -- the raw orthogonal draw, of norm 1, is not --,
    a frozen one too (it is never projected again)."""
    conv = cls is L.DP_SpectralConv2D
    shape = (6, 6, 2) if conv else (12,)

    def layer():
        options = dict(constraint=constraint, weight_norm_bound=0.6)
        return cls(4, 3, **options) if conv else cls(8, **options)

    frozen = layer()
    frozen.trainable = False
    model = _model([layer(), frozen], shape=shape)
    norm = "fro" if constraint == "frobenius" else 2
    for built in model.dp_layers[1:]:
        matrix = built.kernel_matrix().numpy().astype("float64")
        assert np.linalg.norm(matrix, norm) <= 0.6 * (1 + 1e-6)
        assert np.linalg.norm(matrix, norm) >= 0.5  # projected, not shrunk to nothing


@thorough  # 17 s; tests/core/test_xla.py compiles a DP-SGD step by default
def test_xla_compiled_steps_match_the_default_ones():
    """model.compile(jit_compile=True): the same training (no noise, same data), weights
    equal up to float32 re-association, and every step runs the projection."""
    weights = []
    for jit in (False, True):
        tf.keras.utils.set_random_seed(0)
        model = _model(
            [L.DP_QuickSpectralDense(16), L.DP_GroupSort(2), L.DP_QuickSpectralDense(5)],
            sigma=0.0,
            n=64,
            non_private=True,
        )
        model.compile(
            loss=losses.DP_TauCategoricalCrossentropy(tau=4.0),
            optimizer=tf.keras.optimizers.SGD(0.5),
            jit_compile=jit,
        )
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 12)).astype("float32")
        y = np.eye(5, dtype="float32")[rng.integers(0, 5, 64)]
        model.build((None, 12))
        initial = model.dp_layers[1].kernel.numpy().astype("float64")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        kernel = model.dp_layers[1].kernel.numpy().astype("float64")
        assert np.abs(kernel - initial).max() > 1e-2  # trained
        assert np.linalg.norm(kernel, 2) <= 1 + 1e-5
        weights.append(kernel)
    np.testing.assert_allclose(weights[0], weights[1], atol=1e-4)


def test_fit_projects_weights_set_by_hand():
    model = _model([L.DP_QuickSpectralDense(5, constraint="spectral")], n=8)
    dense = model.dp_layers[1]
    dense.kernel.assign(dense.kernel * 10.0)
    x = np.zeros((8, 12), "float32")
    y = np.eye(5, dtype="float32")[np.zeros(8, int)]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.linalg.norm(dense.kernel.numpy().astype("float64"), 2) <= 1 + 1e-5


# ------------------------------------------------------------------ errors
def test_non_dp_layer_is_refused_with_replacement():
    with pytest.raises(TypeError, match=r"'my_dense'.*DP_QuickSpectralDense"):
        DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=(3,), upper_bound=1.0),
                tf.keras.layers.Dense(2, name="my_dense"),
            ],
            dp_parameters=DPParameters("global", 1.0, 1e-5),
        )
    with pytest.raises(TypeError, match="DP_LayerCentering"):
        DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=(3,), upper_bound=1.0),
                tf.keras.layers.BatchNormalization(),
            ],
            dp_parameters=DPParameters("global", 1.0, 1e-5),
        )


def test_first_layer_must_bound_the_input():
    with pytest.raises(ValueError, match="DP_BoundedInput"):
        DP_Sequential([L.DP_QuickSpectralDense(2)], dp_parameters=DPParameters("global", 1, 1e-5))
    with pytest.raises(ValueError, match="DP_BoundedInput"):
        DP_Sequential(
            [L.DP_InputLayer(input_shape=(3,)), L.DP_QuickSpectralDense(2)],
            dp_parameters=DPParameters("global", 1, 1e-5),
        )
    ok = DP_Sequential(
        [
            L.DP_InputLayer(input_shape=(3,)),
            L.DP_BoundedInput(upper_bound=1.0),
            L.DP_QuickSpectralDense(2),
        ],
        dp_parameters=DPParameters("global", 1, 1e-5),
    )
    assert ok.built


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(noisify_strategy="local", noise_multiplier=1.0, delta=1e-5), "noisify_strategy"),
        (dict(noisify_strategy="global", noise_multiplier=0.0, delta=1e-5), "noise_multiplier"),
        (dict(noisify_strategy="global", noise_multiplier=-1.0, delta=1e-5), "noise_multiplier"),
        (dict(noisify_strategy="global", noise_multiplier=1.0, delta=1.0), "delta"),
        (dict(noisify_strategy="global", noise_multiplier=1.0, delta=0.0), "delta"),
        (
            dict(noisify_strategy="global", noise_multiplier=1.0, delta=1e-5, non_private=True),
            "noise_multiplier=0",
        ),
    ],
)
def test_invalid_dp_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DPParameters(**kwargs)


def test_loss_without_lipschitz_constant_or_with_wrong_reduction():
    model = _model([L.DP_QuickSpectralDense(5)])
    with pytest.raises(TypeError, match="get_L"):
        model.compile(loss=tf.keras.losses.CategoricalCrossentropy(), optimizer="sgd")
    with pytest.raises(TypeError, match="get_L"):
        model.compile(loss="categorical_crossentropy", optimizer="sgd")
    with pytest.raises(ValueError, match="reduction"):
        model.compile(loss=_SumLoss(), optimizer="sgd")


class _SumLoss(losses.DP_MeanAbsoluteError):
    """A DP loss whose reduction was changed after construction."""

    def __init__(self):
        super().__init__()
        self.reduction = tf.keras.losses.Reduction.SUM


def test_partial_batches_are_refused():
    model = _model([L.DP_QuickSpectralDense(5)], n=20)  # N = 20 examples, b = 8
    x = np.zeros((20, 12), "float32")
    y = np.eye(5, dtype="float32")[np.zeros(20, int)]
    with pytest.raises(ValueError, match="multiple of batch_size=8"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="differs from the batch size"):
        model.fit(x[:16], y[:16], batch_size=4, epochs=1, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)  # last batch has 4 examples
    with pytest.raises(tf.errors.InvalidArgumentError, match="drop_remainder"):
        model.fit(ds, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="sample_weight"):
        model.fit(x[:16], y[:16], batch_size=8, sample_weight=np.ones(16), verbose=0)
    ok = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    model.fit(ok, epochs=1, verbose=0)


def test_training_needs_dataset_metadata():
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(3,), upper_bound=1.0), L.DP_QuickSpectralDense(2)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
    )
    model.compile(loss=losses.DP_MeanAbsoluteError(), optimizer="sgd")
    with pytest.raises(ValueError, match="dataset_metadata"):
        model.fit(np.zeros((4, 3), "float32"), np.zeros((4, 2), "float32"), batch_size=4)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: L.DP_QuickSpectralDense(3, use_bias=True), "DP_AddBias"),
        (lambda: L.DP_SpectralConv2D(3, 3, use_bias=True), "DP_AddBias"),
        (lambda: L.DP_QuickSpectralConv2D(3, 3, dilation_rate=2), "dilation"),
        (lambda: L.DP_QuickSpectralConv2D(3, 3, padding="reflect"), "padding"),
        (lambda: L.DP_QuickSpectralDense(3, constraint="none"), "constraint"),
        (lambda: L.DP_ScaledL2NormPooling2D(2, strides=1), "strides == pool_size"),
        (lambda: L.DP_MaxPool2D(3, strides=2), "strides == pool_size"),
        (lambda: L.DP_Lambda(lambda t: t), "lipschitz_constant"),
        (lambda: L.DP_ReLU(threshold=0.5), "threshold"),
        (lambda: L.DP_ReLU(negative_slope=2.0), "negative_slope"),
        (lambda: L.DP_BoundedInput(input_shape=(3,), upper_bound=0.0), "upper_bound"),
        (lambda: L.DP_AddBias(norm_max=-1.0), "norm_max"),
        (lambda: L.DP_ClipGradient(0.0), "clip_value"),
        (lambda: L.DP_ClipGradient(1.0, mode="adaptive"), "mode"),
        (lambda: L.DP_QuickSpectralDense(3, nm_coef=0.0), "nm_coef"),
        (lambda: L.DP_MergeResidual("concat"), "merge_policy"),
        (lambda: L.DP_WrappedResidual(tf.keras.layers.Dense(3)), "DP layers"),
    ],
)
def test_invalid_layer_parameters(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


# ----------------------------------------------------------- serialisation
def _residual_model():
    model = DP_Model(
        [
            L.DP_BoundedInput(input_shape=(6, 6, 2), upper_bound=2.0),
            L.DP_QuickSpectralConv2D(4, 3),
            *L.make_residuals("1-lip-add", [L.DP_SpectralConv2D(4, 3), L.DP_GroupSort(2)]),
            L.DP_AddBias(norm_max=1.0),
            L.DP_ScaledL2NormPooling2D(2),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(5),
            L.DP_ClipGradient(0.5),
        ],
        dp_parameters=DPParameters("per-layer", 1.5, 1e-5),
        dataset_metadata=_meta(4, n=4, shape=(6, 6, 2)),
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(tau=8.0), optimizer="adam")
    return model


def test_save_and_load_round_trip(tmp_path):
    model = _residual_model()
    x = np.random.default_rng(0).normal(size=(4, 6, 6, 2)).astype("float32")
    y = np.eye(5, dtype="float32")[[0, 1, 2, 3]]
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert isinstance(loaded, DP_Model)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6
    )
    assert loaded.dp_parameters == model.dp_parameters
    assert loaded.dataset_metadata == model.dataset_metadata

    def floats(m):
        return {k: float(v) for k, v in compute_gradient_bounds(m).items()}

    assert floats(loaded) == pytest.approx(floats(model))
    assert len(floats(model)) == 4
    loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)  # trainable again, loss restored


def test_sequential_config_round_trip():
    model = _model([L.DP_QuickSpectralDense(6), L.DP_GroupSort(2), L.DP_QuickSpectralDense(5)])
    clone = DP_Sequential.from_config(model.get_config())
    assert [type(a) for a in clone.dp_layers] == [type(b) for b in model.dp_layers]
    assert clone.layers_backward_order()[0].units == 5


def test_declared_dynamic_clipping_survives_save_and_load(tmp_path):
    """The declaration is part of the model's config: a reloaded model plans the same
    releases (rule S11) instead of silently dropping them."""
    from lipdp.accounting import get_eps_delta
    from lipdp.clipless.dynamic import DynamicClippingSpec

    spec = DynamicClippingSpec("quantiles", patience=2, noise_multiplier=3.0)
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(6,), upper_bound=1.0),
            L.DP_QuickSpectralDense(5),
            L.DP_ClipGradient(0.5, mode="dynamic"),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5, dynamic_clipping=spec),
        dataset_metadata=_meta(8, shape=(6,)),
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(2.0), optimizer="sgd")
    path = tmp_path / "dynamic.keras"
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert loaded.dp_parameters == model.dp_parameters
    assert loaded.dynamic_clipping == spec
    assert get_eps_delta(loaded, 6) == get_eps_delta(model, 6)
    assert get_eps_delta(model, 6)[0] > get_eps_delta(_model([L.DP_QuickSpectralDense(5)]), 6)[0]


def test_shared_layers_and_extra_losses_are_refused():
    dense = L.DP_QuickSpectralDense(12)
    with pytest.raises(ValueError, match="appears twice"):
        DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=(12,), upper_bound=1.0),
                dense,
                L.DP_GroupSort(2),
                dense,
            ],
            dp_parameters=DPParameters("global", 1, 1e-5),
        )
    inner = L.DP_QuickSpectralDense(12)
    with pytest.raises(ValueError, match="appears twice"):
        DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=(12,), upper_bound=1.0),
                inner,
                *L.make_residuals("add", [inner]),
            ],
            dp_parameters=DPParameters("global", 1, 1e-5),
        )
    with pytest.raises(ValueError, match="activity_regularizer"):
        DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=(12,), upper_bound=1.0),
                L.DP_QuickSpectralDense(5, activity_regularizer="l2"),
            ],
            dp_parameters=DPParameters("global", 1, 1e-5),
        )
    # A penalty of the data (a penalty of the weights is supported).
    # Named: Keras 3 refuses the name derived from the class ('__activation...') in a graph.
    model = _model([_ActivationPenalty(5, name="activation_penalty")], n=8)
    with pytest.raises(ValueError, match="adds a loss computed in its call"):
        model.fit(
            np.zeros((8, 12), "float32"), np.zeros((8, 5), "float32"), batch_size=8, verbose=0
        )


class _ActivationPenalty(L.DP_QuickSpectralDense):
    """``add_loss`` of the activations: data-dependent, outside the bounded losses."""

    def call(self, inputs):
        outputs = super().call(inputs)
        self.add_loss(tf.reduce_mean(tf.square(outputs)))
        return outputs


def test_debug_mode_logs_sensitivities(caplog):
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(12,), upper_bound=1.0), L.DP_QuickSpectralDense(5)],
        dp_parameters=DPParameters("global", 2.0, 1e-5),
        dataset_metadata=_meta(8, n=8),
        debug=True,
    )
    model.compile(loss=losses.DP_MeanAbsoluteError(), optimizer="sgd")
    with caplog.at_level("INFO", logger="lipdp"):
        model.fit(
            np.zeros((8, 12), "float32"), np.zeros((8, 5), "float32"), batch_size=8, verbose=0
        )
    assert "sensitivity 0.125001" in caplog.text and "noise std 0.250003" in caplog.text


@pytest.mark.parametrize(
    "case",
    [
        "CNN(conv-groupsort-l2pool-dense)",
        "ResidualConvBlock",
        "AddBias(after conv and dense)",
        "ClipGradient(tail)",
        "LayerCentering",
        "MaxPool2D",
        "Permute+Reshape",
        "ScaledGlobalL2NormPooling2D",
        "ReLU(leaky)",
        "SpectralDense",
        "QuickFrobeniusDense",
    ],
)
def test_every_layer_survives_save_and_load(case, tmp_path):
    from tests.cases import ALL_CASES

    model, x, _ = ALL_CASES[case]()
    model.save(tmp_path / "m.keras")
    loaded = tf.keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )
    assert [type(a) for a in loaded.dp_layers] == [type(b) for b in model.dp_layers]


def test_noise_multipliers_for_the_accountant():
    glob = _model([L.DP_QuickSpectralDense(6, nm_coef=2.0), L.DP_QuickSpectralDense(5)], sigma=1.5)
    assert glob.noise_multipliers() == [1.5]
    per_layer = _model(
        [L.DP_QuickSpectralDense(6, nm_coef=2.0), L.DP_QuickSpectralDense(5)],
        strategy="per-layer",
        sigma=1.5,
    )
    assert sorted(per_layer.noise_multipliers()) == [1.5, 3.0]
