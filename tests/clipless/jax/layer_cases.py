"""The layers of E2's part (convolutions, pooling, normalisation, shapes, bias, residual
blocks, scattering, DP_Lambda) as small chains, importable on every backend (no TensorFlow):
``LAYER_CHAINS[name] = (factory, per-example input shape)``, the factory returning fresh
layers. The JAX tests build them under JAX, :mod:`tests.clipless.jax.layers_tensorflow_side`
under TensorFlow, with the same weights."""

import keras

from lipdp.clipless import layers as L


def _lambda():
    return L.DP_Lambda(lambda t: 0.5 * keras.ops.tanh(t), lipschitz_constant=0.5, output_gain=0.5)


LAYER_CHAINS = {
    "SpectralConv2D(same)": (lambda: [L.DP_SpectralConv2D(4, 3)], (6, 6, 2)),
    "QuickSpectralConv2D(valid,stride2)": (
        lambda: [L.DP_QuickSpectralConv2D(4, 3, strides=2, padding="valid")],
        (7, 7, 2),
    ),
    "QuickSpectralConv2D(same,k5,stride2)": (
        lambda: [L.DP_QuickSpectralConv2D(6, 5, strides=2)],
        (7, 7, 2),
    ),
    "ScaledL2NormPooling2D(same)": (
        lambda: [L.DP_ScaledL2NormPooling2D(2, padding="same")],
        (5, 5, 3),
    ),
    "ScaledL2NormPooling2D(valid)": (lambda: [L.DP_ScaledL2NormPooling2D(2)], (6, 6, 3)),
    "ScaledGlobalL2NormPooling2D": (lambda: [L.DP_ScaledGlobalL2NormPooling2D()], (6, 6, 3)),
    "MaxPool2D": (lambda: [L.DP_MaxPool2D(2)], (6, 6, 3)),
    "LayerCentering(channelwise)": (lambda: [L.DP_LayerCentering()], (6, 6, 4)),
    "LayerCentering(pixelwise)": (
        lambda: [L.DP_LayerCentering(pixelwise=True, channelwise=False)],
        (6, 6, 4),
    ),
    "GroupNormalization": (lambda: [L.DP_GroupNormalization(groups=2, alpha=0.05)], (5, 5, 4)),
    "AddBias": (lambda: [L.DP_AddBias(norm_max=0.5)], (4, 4, 3)),
    "Permute+Reshape+Flatten": (
        lambda: [L.DP_Permute((2, 1, 3)), L.DP_Reshape((-1, 3)), L.DP_Flatten()],
        (4, 5, 3),
    ),
    "ScatteringTransform(reflect,J1)": (
        lambda: [L.DP_ScatteringTransform(J=1, L=4, padding="reflect")],
        (6, 6, 2),
    ),
    "ScatteringTransform(zeros,J2)": (
        lambda: [L.DP_ScatteringTransform(J=2, L=3, padding="zeros")],
        (8, 8, 1),
    ),
    "ResidualConv(1-lip-add)": (
        lambda: L.make_residuals(
            "1-lip-add",
            [L.DP_QuickSpectralConv2D(4, 3), L.DP_AddBias(0.5), L.DP_LayerCentering()],
        ),
        (6, 6, 4),
    ),
    "Lambda": (lambda: [_lambda()], (12,)),
}


def build(name, x):
    """``keras.Sequential`` of the chain ``name``, built on ``x``."""
    factory, shape = LAYER_CHAINS[name]
    model = keras.Sequential([keras.Input(shape), *factory()])
    model(x)
    return model
