"""lipdp.recipes.zoo: every builder builds the architecture it documents, options do what they say.

The expected layer lists below are written out layer by layer, as the CLI, the notebooks
and the benchmarks wrote them before the zoo existed: the zoo must build exactly those.
(Soundness of the zoo models: the ``Zoo:*`` cases of ``tests/cases.py``.)
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters, compute_gradient_bounds
from lipdp.evaluation import lipschitz_constant
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.recipes import defaults, runs, zoo

PARAMS = DPParameters("global", 1.0, 1e-5)
BATCH = 8

#: A small input for every registry entry: (input shape, bound, classes, options).
SMALL = {
    "pooled_cnn": ((8, 8, 1), 5.0, 10, {}),
    "strided_cnn": ((8, 8, 1), 1.0, 10, {"clip": 0.3}),
    "tabular_mlp": ((9,), 3.0, 2, {"width": 8}),
    "resnet": ((8, 8, 1), 5.0, 10, {"blocks": 1, "width": 4}),
    "mlp_mixer": ((8, 8, 1), 5.0, 10, {"channels": 8}),
    "lip_mlp": ((9,), 3.0, 2, {"width": 8}),
    "lip_convnet": ((8, 8, 1), 5.0, 10, {"widths": (4, 8), "dense": 8}),
    "scattering_net": ((12, 12, 1), 5.0, 10, {"J": 2, "L": 4, "groups": None, "widths": (4,)}),
}


def _metadata(shape, bound, classes):
    return DatasetMetadata(
        input_shape=shape,
        nb_classes=classes,
        nb_samples_train=10 * BATCH,
        batch_size=BATCH,
        max_norm=bound,
    )


def _nameless(config):
    """A Keras config without the layer names, also those of wrapped layers."""
    if isinstance(config, dict):
        return {k: _nameless(v) for k, v in config.items() if k != "name"}
    return config


def _configs(dp_layers, names=False):
    """Class and full Keras config of each layer (names optional: Keras numbers them)."""
    return [
        (type(layer).__name__, layer.get_config() if names else _nameless(layer.get_config()))
        for layer in dp_layers
    ]


def _unwrapped(dp_layers):
    """The layers, those inside residual blocks unwrapped."""
    return [getattr(layer, "block", layer) for layer in dp_layers]


def _bounds(model):
    """Sensitivities by layer name (keys are ``"<layer>/<variable>"``)."""
    bounds = compute_gradient_bounds(model)
    by_layer = {key.split("/")[0]: float(value) for key, value in bounds.items()}
    assert len(by_layer) == len(bounds)  # one variable per layer in these networks
    return by_layer


def _compiled(dp_layers, metadata):
    model = DP_Sequential(dp_layers, dp_parameters=PARAMS, dataset_metadata=metadata)
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(tau=8.0), optimizer="sgd")
    return model


# ------------------------------------------------------------------------------ registry
def test_registry_holds_every_builder():
    assert zoo.ZOO == {
        "pooled_cnn": zoo.pooled_cnn,
        "strided_cnn": zoo.strided_cnn,
        "tabular_mlp": zoo.tabular_mlp,
        "resnet": zoo.resnet,
        "mlp_mixer": zoo.mlp_mixer,
        "lip_mlp": zoo.lip_mlp,
        "lip_convnet": zoo.lip_convnet,
        "scattering_net": zoo.scattering_net,
    }


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_every_registry_entry_builds_a_1_lipschitz_classifier(name):
    shape, bound, classes, options = SMALL[name]
    metadata = _metadata(shape, bound, classes)
    model = zoo.build_model(name, metadata, PARAMS, **options)
    assert isinstance(model, DP_Sequential)
    assert model.dataset_metadata is metadata and model.dp_parameters is PARAMS
    first = model.dp_layers[0]
    assert isinstance(first, L.DP_BoundedInput)
    assert first.upper_bound == bound
    assert first.get_config()["batch_input_shape"] == (None, *shape)
    x = np.random.default_rng(0).normal(size=(3, *shape)).astype("float32")
    assert model(x).shape == (3, classes)
    # What every builder's docstring claims: logits 1-Lipschitz in the input, so the
    # output norm is at most the input bound (a bias adds its radius: tabular_mlp).
    # (lip_*: norm-adaptive, orthogonal initial kernels projected into the spectral ball
    # of radius 1 with its 1e-3 margin: each kernel's norm is 1 / 1.001.)
    # scattering_net: the scattering transform's certified constant, the rest 1-Lipschitz.
    tolerance = 5e-3 if name.startswith("lip_") else 1e-6
    lip = model.dp_layers[1].lipschitz if name == "scattering_net" else 1.0
    assert lipschitz_constant(model) == pytest.approx(lip, rel=tolerance)
    assert lipschitz_constant(model) <= lip * (1.0 + 1e-6)
    output_bound = model.input_bounds()[1]
    extra = 2 * 1.0 if name == "tabular_mlp" else 0.0  # two bias balls of radius 1
    assert float(output_bound) == pytest.approx(lip * bound + extra, rel=tolerance)


def test_build_model_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="unknown architecture 'vgg'"):
        zoo.build_model("vgg", _metadata((8, 8, 1), 1.0, 10), PARAMS)


def test_layer_lists_can_be_extended():
    metadata = _metadata((9,), 3.0, 2)
    stack = zoo.tabular_mlp(metadata, width=8)
    stack.append(L.DP_ClipGradient(0.5))
    model = _compiled(stack, metadata)
    assert isinstance(model.dp_layers[-1], L.DP_ClipGradient)
    without = _compiled(zoo.tabular_mlp(metadata, width=8), metadata)
    clipped, plain = _bounds(model), _bounds(without)
    assert clipped["logits"] == pytest.approx(plain["logits"] * 0.5 / math.sqrt(2))


# -------------------------------------------------------------------------------- inputs
def test_explicit_inputs_override_the_metadata():
    metadata = _metadata((8, 8, 1), 5.0, 10)
    stack = zoo.pooled_cnn(metadata, upper_bound=2.0, nb_classes=3)
    assert stack[0].upper_bound == 2.0
    assert stack[-1].units == 3
    stack = zoo.pooled_cnn(input_shape=(6, 6, 2), upper_bound=1.0, nb_classes=4)
    assert stack[0].get_config()["batch_input_shape"] == (None, 6, 6, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"input_shape": (8, 8, 1), "nb_classes": 10}, "missing upper_bound"),
        ({"upper_bound": 1.0}, "missing input_shape, nb_classes"),
        ({"input_shape": (8, 8, 1), "upper_bound": 0.0, "nb_classes": 10}, "upper_bound"),
        ({"input_shape": (8, 8, 1), "upper_bound": math.inf, "nb_classes": 10}, "upper_bound"),
        ({"input_shape": (64,), "upper_bound": 1.0, "nb_classes": 10}, "needs images"),
    ],
)
def test_missing_or_invalid_inputs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zoo.pooled_cnn(**kwargs)


def test_a_metadata_without_bound_needs_an_explicit_one():
    metadata = _metadata((9,), None, 2)
    with pytest.raises(ValueError, match="upper_bound"):
        zoo.tabular_mlp(metadata)
    assert zoo.tabular_mlp(metadata, upper_bound=3.0)[0].upper_bound == 3.0


# ---------------------------------------------------------------- the CLI's CNN, exactly
def _cli_cnn_before_the_zoo(shape, bound, dataset):
    """The CLI's ``_build_model``'s layer list as it was written before the zoo."""
    width = 16 if dataset == "digits" else 32
    stack = [
        L.DP_BoundedInput(input_shape=shape, upper_bound=bound),
        L.DP_QuickSpectralConv2D(width, 3),
        L.DP_GroupSort(2),
        L.DP_ScaledL2NormPooling2D(2),
    ]
    if dataset != "digits":
        stack += [
            L.DP_QuickSpectralConv2D(2 * width, 3),
            L.DP_GroupSort(2),
            L.DP_ScaledL2NormPooling2D(2),
        ]
    return stack + [L.DP_Flatten(), L.DP_QuickSpectralDense(10)]


def test_run_widths_and_bounds_are_those_of_the_cli_before():
    assert defaults.CNN_WIDTHS == {"digits": (16,), "fashion_mnist": (32, 64)}
    # breast cancer (issue 12): 30 features in [-1, 1], hence sqrt(30).
    assert defaults.INPUT_BOUNDS == {
        "digits": 5.0,
        "fashion_mnist": 10.0,
        "breast_cancer": math.sqrt(30.0),
    }


@pytest.mark.parametrize("dataset, shape", [("digits", (8, 8, 1)), ("fashion_mnist", (28, 28, 1))])
def test_pooled_cnn_is_exactly_the_cli_cnn(dataset, shape):
    bound = defaults.INPUT_BOUNDS[dataset]
    metadata = _metadata(shape, bound, 10)
    built = zoo.pooled_cnn(metadata, widths=defaults.CNN_WIDTHS[dataset])
    assert _configs(built) == _configs(_cli_cnn_before_the_zoo(shape, bound, dataset))
    kinds = [type(layer).__name__ for layer in built]
    assert kinds.count("DP_QuickSpectralConv2D") == len(defaults.CNN_WIDTHS[dataset])
    assert [layer.filters for layer in built if hasattr(layer, "filters")] == list(
        defaults.CNN_WIDTHS[dataset]
    )


def test_pooled_cnn_defaults_are_the_digits_cnn():
    metadata = _metadata((8, 8, 1), 5.0, 10)
    assert _configs(zoo.pooled_cnn(metadata)) == _configs(
        _cli_cnn_before_the_zoo((8, 8, 1), 5.0, "digits")
    )


class _Stop(Exception):
    pass


def test_the_run_recipe_asks_the_zoo_for_its_model(monkeypatch):
    """The architecture of ``lipdp train``'s recipe comes from the registry (stopped before
    any training; that the CLI runs this recipe: tests/cli/test_commands.py)."""
    calls = []

    def spy(metadata, **options):
        calls.append((metadata, options))
        raise _Stop

    monkeypatch.setitem(zoo.ZOO, "pooled_cnn", spy)
    monkeypatch.setitem(zoo.ZOO, "scattering_net", spy)
    with pytest.raises(_Stop):
        runs.prepare(runs.RunConfig(runs.ModelRecipe(scattering=False), epochs=1))
    with pytest.raises(_Stop):
        runs.prepare(runs.RunConfig(epochs=1))  # digits' default: the scattering network
    (metadata, options), (_, scattering_options) = calls
    assert options == {"widths": defaults.CNN_WIDTHS["digits"]}
    assert set(scattering_options) >= {"groups", "weight_norm_bound"}
    assert metadata.max_norm == defaults.INPUT_BOUNDS["digits"]
    assert metadata.input_shape == (8, 8, 1) and metadata.nb_classes == 10


# ------------------------------------------------------------------ notebook-01 CNN
def _notebook01_cnn(metadata, clip):
    """``examples/01_getting_started.ipynb`` before the zoo (``benchmarks/fmnist_utility``
    wrote the same layers without names)."""
    return [
        L.DP_BoundedInput(input_shape=metadata.input_shape, upper_bound=metadata.max_norm),
        L.DP_QuickSpectralConv2D(16, 2, strides=2, name="conv_1"),
        L.DP_GroupSort(2),
        L.DP_QuickSpectralConv2D(64, 2, strides=2, name="conv_2"),
        L.DP_GroupSort(2),
        L.DP_Flatten(),
        L.DP_QuickSpectralDense(metadata.nb_classes, name="logits"),
        L.DP_ClipGradient(clip),
    ]


def test_strided_cnn_is_the_notebook_01_cnn():
    metadata = _metadata((28, 28, 1), 1.0, 10)
    built = zoo.strided_cnn(metadata, clip=0.3)
    expected = _configs(_notebook01_cnn(metadata, 0.3))
    assert _configs(built)[:-1] == expected[:-1]  # names included: conv_1, conv_2, logits
    assert _configs(built, names=True)[1][1]["name"] == "conv_1"
    assert _configs(built, names=True)[6][1]["name"] == "logits"
    assert _configs(built)[-1] == expected[-1]
    features = tf.zeros((1, 28, 28, 1))
    for layer in built[:-2]:
        features = layer(features)
    assert features.shape == (1, 7 * 7 * 64)  # 28 -> 14 -> 7 pixels, 64 channels


def test_strided_cnn_clip_option():
    metadata = _metadata((8, 8, 1), 1.0, 10)
    plain = zoo.strided_cnn(metadata)
    assert not any(isinstance(layer, L.DP_ClipGradient) for layer in plain)
    assert plain[-1].name == "logits"
    clipped = zoo.strided_cnn(metadata, clip=0.25)
    assert isinstance(clipped[-1], L.DP_ClipGradient)
    assert float(clipped[-1].clip_value.numpy()) == pytest.approx(0.25)
    # Every sensitivity shrinks by C / L (L = sqrt(2) for the tau cross-entropy).
    plain_bounds = _bounds(_compiled(plain, metadata))
    clipped_bounds = _bounds(_compiled(clipped, metadata))
    assert list(plain_bounds) == ["conv_1", "conv_2", "logits"]
    for key, value in plain_bounds.items():
        assert clipped_bounds[key] == pytest.approx(value * 0.25 / math.sqrt(2))
    widths = zoo.strided_cnn(metadata, widths=(8, 32, 128))
    assert [layer.filters for layer in widths if hasattr(layer, "filters")] == [8, 32, 128]


# --------------------------------------------------------------------- tabular MLP
def test_tabular_mlp_is_the_notebook_03_network():
    metadata = _metadata((9,), 3.0, 2)
    expected = [L.DP_BoundedInput(input_shape=(9,), upper_bound=3.0)]
    for i in (1, 2):
        expected += [
            L.DP_QuickSpectralDense(64, name=f"dense_{i}"),
            L.DP_AddBias(norm_max=1.0, name=f"bias_{i}"),
            L.DP_GroupSort(2, name=f"groupsort_{i}"),
        ]
    expected.append(L.DP_QuickSpectralDense(2, name="logits"))
    built = zoo.tabular_mlp(metadata)
    assert _configs(built, names=True)[1:] == _configs(expected, names=True)[1:]
    assert _configs(built)[0] == _configs(expected)[0]


def test_tabular_mlp_options():
    metadata = _metadata((9,), 3.0, 2)
    built = zoo.tabular_mlp(metadata, width=16, depth=3, bias=2.0)
    dense = [layer for layer in built if isinstance(layer, L.DP_QuickSpectralDense)]
    assert [layer.units for layer in dense] == [16, 16, 16, 2]
    assert [layer.norm_max for layer in built if isinstance(layer, L.DP_AddBias)] == [2.0] * 3
    # Each bias ball adds its radius to the input bound of the next dense layer.
    bounds = _bounds(_compiled(built, metadata))
    assert bounds["dense_2"] / bounds["dense_1"] == pytest.approx((3.0 + 2.0) / 3.0)
    assert bounds["logits"] / bounds["dense_1"] == pytest.approx((3.0 + 3 * 2.0) / 3.0)
    no_bias = zoo.tabular_mlp(metadata, bias=None)
    assert not any(isinstance(layer, L.DP_AddBias) for layer in no_bias)
    assert len(no_bias) == 1 + 2 * 2 + 1


# ------------------------------------------------------------------------ resnet
def _notebook02_resnet(policy, blocks, width):
    body = [
        L.DP_BoundedInput(input_shape=(8, 8, 1), upper_bound=5.0),
        L.DP_QuickSpectralConv2D(width, 3),
        L.DP_GroupSort(2),
    ]
    for _ in range(blocks):
        body += L.make_residuals(
            policy,
            [
                L.DP_QuickSpectralConv2D(width, 3),
                L.DP_GroupSort(2),
                L.DP_QuickSpectralConv2D(width, 3),
                L.DP_GroupSort(2),
            ],
        )
    return body + [L.DP_ScaledL2NormPooling2D(2), L.DP_Flatten(), L.DP_QuickSpectralDense(10)]


@pytest.mark.parametrize("policy", ["1-lip-add", "add"])
def test_resnet_is_the_notebook_02_network(policy):
    metadata = _metadata((8, 8, 1), 5.0, 10)
    built = zoo.resnet(metadata, merge_policy=policy)
    assert _configs(built) == _configs(_notebook02_resnet(policy, 3, 16))


@pytest.mark.parametrize("policy, blocks, lipschitz", [("1-lip-add", 2, 1.0), ("add", 2, 4.0)])
def test_resnet_options(policy, blocks, lipschitz):
    metadata = _metadata((8, 8, 1), 5.0, 10)
    built = zoo.resnet(metadata, merge_policy=policy, blocks=blocks, width=6)
    assert sum(isinstance(layer, L.DP_SplitResidual) for layer in built) == blocks
    merges = [layer for layer in built if isinstance(layer, L.DP_MergeResidual)]
    assert [layer.merge_policy for layer in merges] == [policy] * blocks
    model = _compiled(built, metadata)
    # "add" is 2-Lipschitz per block: the bounds double at every block.
    assert lipschitz_constant(model) == pytest.approx(lipschitz)
    assert model.input_bounds()[1] == pytest.approx(5.0 * lipschitz)
    assert {v.shape[-1] for v in model.trainable_variables[:-1]} == {6}


# --------------------------------------------------------------------- MLP-Mixer
def test_mlp_mixer_is_the_notebook_02_mixer():
    metadata = _metadata((8, 8, 1), 5.0, 10)
    P, T, C = 2, 16, 32
    block = [
        *L.make_residuals(
            "1-lip-add",
            [
                L.DP_LayerCentering(),
                L.DP_Permute((2, 1)),
                L.DP_QuickSpectralDense(2 * T),
                L.DP_GroupSort(2),
                L.DP_QuickSpectralDense(T),
                L.DP_Permute((2, 1)),
            ],
        ),
        *L.make_residuals(
            "1-lip-add",
            [
                L.DP_LayerCentering(),
                L.DP_QuickSpectralDense(2 * C),
                L.DP_GroupSort(2),
                L.DP_QuickSpectralDense(C),
            ],
        ),
    ]
    expected = [
        L.DP_BoundedInput(input_shape=(8, 8, 1), upper_bound=5.0),
        L.DP_Reshape((4, P, 4, P)),
        L.DP_Permute((1, 3, 2, 4)),
        L.DP_Reshape((T, P * P)),
        L.DP_QuickSpectralDense(C),
        *block,
        L.DP_Flatten(),
        L.DP_QuickSpectralDense(10),
    ]
    assert _configs(zoo.mlp_mixer(metadata)) == _configs(expected)


def test_mlp_mixer_tokens_are_the_image_patches():
    shape, patch = (4, 6, 3), 2
    built = zoo.mlp_mixer(input_shape=shape, upper_bound=100.0, nb_classes=3, patch_size=patch)
    x = np.arange(np.prod(shape), dtype="float32").reshape(1, *shape)
    tokens = x
    for layer in built[1:4]:
        tokens = layer(tokens)
    tokens = tokens.numpy()[0]
    assert tokens.shape == (6, patch * patch * 3)
    for t, (i, j) in enumerate((i, j) for i in range(2) for j in range(3)):
        patch_pixels = x[0, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2, :].reshape(-1)
        np.testing.assert_array_equal(tokens[t], patch_pixels)


def test_mlp_mixer_options():
    metadata = _metadata((8, 8, 2), 5.0, 10)
    built = zoo.mlp_mixer(metadata, patch_size=4, channels=12, depth=2, channel_hidden=20)
    dense = [
        layer.units for layer in _unwrapped(built) if isinstance(layer, L.DP_QuickSpectralDense)
    ]
    tokens = 4  # (8 / 4) * (8 / 4)
    one_block = [2 * tokens, tokens, 20, 12]  # token_hidden defaults to 2 T
    assert dense == [12, *one_block, *one_block, 10]
    assert sum(isinstance(layer, L.DP_MergeResidual) for layer in built) == 2 * 2
    assert built[3].target_shape == (tokens, 4 * 4 * 2)
    model = _compiled(built, metadata)
    assert model(tf.zeros((2, 8, 8, 2))).shape == (2, 10)
    assert _unwrapped(zoo.mlp_mixer(metadata, token_hidden=6))[8].units == 6
    with pytest.raises(ValueError, match="patch_size 3 must divide"):
        zoo.mlp_mixer(metadata, patch_size=3)


def test_lip_builders_pass_the_ball_to_every_kernel():
    metadata = _metadata((9,), 3.0, 2)
    stack = zoo.lip_mlp(
        metadata,
        width=8,
        weight_norm_bound=2.5,
        constraint="frobenius",
        group_norm=2,
        alpha=0.5,
        bias=0.3,
        adaptive_norm=False,
    )
    kernels = [layer for layer in stack if hasattr(layer, "weight_norm_bound")]
    assert [k.weight_norm_bound for k in kernels] == [2.5, 2.5]
    assert {k.constraint for k in kernels} == {"frobenius"}
    assert not any(k.adaptive_norm for k in kernels)
    assert [type(layer).__name__ for layer in stack[1:]] == [
        "DP_QuickSpectralDense",
        "DP_AddBias",
        "DP_GroupNormalization",
        "DP_ReLU",
        "DP_QuickSpectralDense",
    ]
    with pytest.raises(ValueError, match="activation"):
        zoo.lip_mlp(metadata, activation="tanh")
    model = _compiled(stack, metadata)
    # Fixed norms at C = 2.5 and a 1/alpha = 2 normalisation: Lipschitz 2.5 * 2 * 2.5.
    assert lipschitz_constant(model) == pytest.approx(12.5)
