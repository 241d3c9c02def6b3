"""Small DP models covering every layer, every loss and a few compositions.

Each case is a function returning ``(model, x, y)``: a compiled model and a batch
whose inputs overshoot the input bound (so clipping is active) and whose labels
fit the loss.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.foundation.metadata import DatasetMetadata

BATCH = 4
NB_CLASSES = 5


def build(
    dp_layers,
    input_shape,
    loss=None,
    upper_bound=3.0,
    batch=BATCH,
    labels="onehot",
    seed=0,
    nb_samples_train=None,
):
    """``nb_samples_train``: the declared training set size (``100 * batch`` when
    omitted); ``fit`` on arrays needs it to be the number of examples fitted."""
    # imported here: the JAX tests read the cases' layers without the TensorFlow model
    from lipdp.clipless.model import DP_Sequential, DPParameters

    meta = DatasetMetadata(
        input_shape=input_shape,
        nb_classes=NB_CLASSES,
        nb_samples_train=nb_samples_train or 100 * batch,
        batch_size=batch,
    )
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=input_shape, upper_bound=upper_bound), *dp_layers],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=meta,
    )
    model.compile(
        loss=loss or losses.DP_TauCategoricalCrossentropy(tau=16.0),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    rng = np.random.default_rng(seed)
    x = (
        2.0 * upper_bound / np.sqrt(np.prod(input_shape)) * rng.normal(size=(batch, *input_shape))
    ).astype("float32")
    if labels == "onehot":
        y = np.eye(NB_CLASSES, dtype="float32")[rng.integers(0, NB_CLASSES, size=batch)]
    else:
        y = rng.uniform(size=(batch, NB_CLASSES)).astype("float32")
    return model, x, y


def dense_head():
    return [L.DP_Flatten(), L.DP_QuickSpectralDense(NB_CLASSES)]


def conv_stem(conv_cls=L.DP_QuickSpectralConv2D, **kwargs):
    return [conv_cls(4, 3, **kwargs), L.DP_GroupSort(2)]


IMG = (6, 6, 2)
VEC = (12,)

LAYER_CASES = {
    "SpectralDense": lambda: build(
        [L.DP_SpectralDense(16), L.DP_GroupSort(2), L.DP_SpectralDense(NB_CLASSES)], VEC
    ),
    "QuickSpectralDense(orthogonal)": lambda: build(
        [L.DP_QuickSpectralDense(16), L.DP_GroupSort(4), L.DP_QuickSpectralDense(NB_CLASSES)], VEC
    ),
    "QuickSpectralDense(spectral)": lambda: build(
        [
            L.DP_QuickSpectralDense(16, constraint="spectral"),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(NB_CLASSES, constraint="spectral"),
        ],
        VEC,
    ),
    "QuickFrobeniusDense": lambda: build(
        [L.DP_QuickFrobeniusDense(16), L.DP_GroupSort(2), L.DP_QuickFrobeniusDense(NB_CLASSES)], VEC
    ),
    "SpectralConv2D(same)": lambda: build(conv_stem(L.DP_SpectralConv2D) + dense_head(), IMG),
    "QuickSpectralConv2D(valid,stride2)": lambda: build(
        conv_stem(strides=2, padding="valid") + dense_head(), (7, 7, 2)
    ),
    "QuickSpectralConv2D(same,k5,stride2)": lambda: build(
        [L.DP_QuickSpectralConv2D(6, 5, strides=2), L.DP_GroupSort(3)] + dense_head(), (7, 7, 2)
    ),
    "QuickSpectralConv2D(spectral,k2)": lambda: build(
        [L.DP_QuickSpectralConv2D(4, 2, constraint="spectral"), L.DP_GroupSort(2)] + dense_head(),
        IMG,
    ),
    "ReLU(leaky)": lambda: build(
        [
            L.DP_QuickSpectralDense(16),
            L.DP_ReLU(negative_slope=0.5),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        VEC,
    ),
    # Scattering: no weights; the layers after it see its certified constant as their input
    # bound and their cotangents flow back through it.
    "ScatteringTransform(reflect,J1)+conv": lambda: build(
        [L.DP_ScatteringTransform(J=1, L=4, padding="reflect")] + conv_stem() + dense_head(), IMG
    ),
    "ScatteringTransform(zeros,J2)+GN": lambda: build(
        [
            L.DP_ScatteringTransform(J=2, L=3, padding="zeros"),
            L.DP_GroupNormalization(groups=4, alpha=0.05),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        (8, 8, 1),
    ),
    "ScaledL2NormPooling2D(same)": lambda: build(
        conv_stem() + [L.DP_ScaledL2NormPooling2D(2, padding="same")] + dense_head(), (5, 5, 2)
    ),
    "ScaledGlobalL2NormPooling2D": lambda: build(
        conv_stem() + [L.DP_ScaledGlobalL2NormPooling2D(), L.DP_QuickSpectralDense(NB_CLASSES)], IMG
    ),
    "MaxPool2D": lambda: build(conv_stem() + [L.DP_MaxPool2D(2)] + dense_head(), IMG),
    "Permute+Reshape": lambda: build(
        conv_stem()
        + [L.DP_Permute((2, 1, 3)), L.DP_Reshape((-1,)), L.DP_QuickSpectralDense(NB_CLASSES)],
        IMG,
    ),
    "LayerCentering": lambda: build(
        conv_stem()
        + [L.DP_LayerCentering(), L.DP_LayerCentering(pixelwise=True, channelwise=False)]
        + dense_head(),
        IMG,
    ),
    "AddBias(after conv and dense)": lambda: build(
        [
            L.DP_QuickSpectralConv2D(4, 3),
            L.DP_AddBias(norm_max=1.0),
            L.DP_GroupSort(2),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(NB_CLASSES),
            L.DP_AddBias(norm_max=2.0),
        ],
        IMG,
    ),
    "ClipGradient(tail)": lambda: build(
        [
            L.DP_QuickSpectralDense(16),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(NB_CLASSES),
            L.DP_ClipGradient(0.2),
        ],
        VEC,
    ),
    "Residual(add)": lambda: build(
        [
            L.DP_QuickSpectralDense(12),
            *L.make_residuals(
                "add", [L.DP_QuickSpectralDense(12), L.DP_GroupSort(2), L.DP_QuickSpectralDense(12)]
            ),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        VEC,
    ),
    "Residual(1-lip-add)": lambda: build(
        [
            L.DP_QuickSpectralDense(12),
            *L.make_residuals(
                "1-lip-add",
                [L.DP_QuickSpectralDense(12), L.DP_AddBias(norm_max=1.0), L.DP_GroupSort(2)],
            ),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        VEC,
    ),
    "Lambda(stated constant)": lambda: build(
        [
            L.DP_QuickSpectralDense(16),
            L.DP_Lambda(lambda t: 0.5 * tf.tanh(t), lipschitz_constant=0.5, output_gain=0.5),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        VEC,
    ),
}


def _dense_net():
    return [L.DP_QuickSpectralDense(16), L.DP_GroupSort(2), L.DP_QuickSpectralDense(NB_CLASSES)]


LOSS_CASES = {
    "TauCategoricalCrossentropy": lambda: build(
        _dense_net(), VEC, losses.DP_TauCategoricalCrossentropy(tau=32.0), upper_bound=10.0
    ),
    "TauBCE": lambda: build(_dense_net(), VEC, losses.DP_TauBCE(tau=4.0), labels="uniform"),
    "MulticlassHinge": lambda: build(_dense_net(), VEC, losses.DP_MulticlassHinge(0.5)),
    "MulticlassKR": lambda: build(_dense_net(), VEC, losses.DP_MulticlassKR()),
    "MulticlassHKR": lambda: build(_dense_net(), VEC, losses.DP_MulticlassHKR(5.0, 0.5)),
    "KCosineSimilarity(K=0.3)": lambda: build(
        _dense_net(), VEC, losses.DP_KCosineSimilarity(K=0.3)
    ),
    "KCosineSimilarity(K=3)": lambda: build(_dense_net(), VEC, losses.DP_KCosineSimilarity(K=3.0)),
    "MeanAbsoluteError": lambda: build(
        _dense_net(), VEC, losses.DP_MeanAbsoluteError(), labels="uniform"
    ),
}

COMPOSITION_CASES = {
    "CNN(conv-groupsort-l2pool-dense)": lambda: build(
        [
            L.DP_QuickSpectralConv2D(8, 3),
            L.DP_GroupSort(2),
            L.DP_ScaledL2NormPooling2D(2),
            L.DP_QuickSpectralConv2D(8, 3),
            L.DP_GroupSort(2),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        (8, 8, 1),
    ),
    "DenseNet(4 layers, biases)": lambda: build(
        [
            L.DP_SpectralDense(24),
            L.DP_AddBias(0.5),
            L.DP_GroupSort(2),
            L.DP_SpectralDense(24),
            L.DP_GroupSort(2),
            L.DP_QuickFrobeniusDense(16),
            L.DP_ReLU(),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        VEC,
    ),
    "ResidualConvBlock": lambda: build(
        [
            L.DP_QuickSpectralConv2D(4, 3),
            *L.make_residuals("1-lip-add", [L.DP_QuickSpectralConv2D(4, 3), L.DP_GroupSort(2)]),
            L.DP_ScaledGlobalL2NormPooling2D(),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        IMG,
    ),
    "CNN+ClipGradient(tail)": lambda: build(
        [
            L.DP_QuickSpectralConv2D(4, 3),
            L.DP_GroupSort(2),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(NB_CLASSES),
            L.DP_ClipGradient(0.05),
        ],
        IMG,
        losses.DP_TauCategoricalCrossentropy(tau=32.0),
        upper_bound=10.0,
    ),
}


def _ball(constraint, radius, adaptive=True):
    return dict(constraint=constraint, weight_norm_bound=radius, adaptive_norm=adaptive)


def _dense_ball_case(cls, constraint, adaptive=True):
    """Two layers of ``cls`` in balls of radii above and below 1."""
    return lambda: build(
        [
            cls(16, **_ball(constraint, 2.5, adaptive)),
            L.DP_GroupSort(2),
            cls(NB_CLASSES, **_ball(constraint, 0.6, adaptive)),
        ],
        VEC,
    )


def _conv_ball_case(cls, constraint, adaptive=True, **conv):
    return lambda: build(
        [
            cls(4, 3, **conv, **_ball(constraint, 1.7, adaptive)),
            L.DP_GroupSort(2),
            cls(4, 3, **_ball(constraint, 0.8, adaptive)),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(NB_CLASSES, **_ball("spectral", 1.3, adaptive)),
        ],
        IMG,
    )


#: Lip-DP-SGD (issue 12): every constrained layer, both norms of the ball, radius != 1,
#: bounds from the current weights; plus fixed-norm balls of radius != 1.
NORM_BALL_CASES = {
    "Ball:SpectralDense(spectral,adaptive)": _dense_ball_case(L.DP_SpectralDense, "spectral"),
    "Ball:QuickFrobeniusDense(frobenius,adaptive)": _dense_ball_case(
        L.DP_QuickFrobeniusDense, "frobenius"
    ),
    "Ball:QuickSpectralDense(orthogonal,adaptive)": _dense_ball_case(
        L.DP_QuickSpectralDense, "orthogonal"
    ),
    "Ball:SpectralConv2D(spectral,adaptive)": _conv_ball_case(L.DP_SpectralConv2D, "spectral"),
    "Ball:QuickSpectralConv2D(frobenius,adaptive,stride2,valid)": _conv_ball_case(
        L.DP_QuickSpectralConv2D, "frobenius", strides=2, padding="valid"
    ),
    "Ball:GroupNormalization(dense,adaptive)": lambda: build(
        [
            L.DP_SpectralDense(16, **_ball("spectral", 2.0)),
            L.DP_GroupNormalization(groups=4, alpha=0.3),
            L.DP_GroupSort(2),
            L.DP_QuickFrobeniusDense(NB_CLASSES, **_ball("frobenius", 0.7)),
        ],
        VEC,
    ),
    "Ball:GroupNormalization(conv,fixed)": lambda: build(
        [
            L.DP_QuickSpectralConv2D(4, 3),
            L.DP_GroupNormalization(groups=2, alpha=2.0),
            L.DP_GroupSort(2),
            L.DP_Flatten(),
            L.DP_QuickSpectralDense(NB_CLASSES),
        ],
        IMG,
    ),
    "Ball:SpectralDense(spectral,fixed)": _dense_ball_case(L.DP_SpectralDense, "spectral", False),
    "Ball:SpectralConv2D(orthogonal,fixed)": _conv_ball_case(
        L.DP_SpectralConv2D, "orthogonal", False
    ),
}


#: Every constrained layer with both norms of the ball (adaptive bounds): measured on
#: random inputs in the default suite, searched adversarially by ``make test-slow``.
NORM_BALL_MATRIX = {
    f"Matrix:{cls.__name__}({constraint})": (
        _conv_ball_case(cls, constraint)
        if "Conv" in cls.__name__
        else _dense_ball_case(cls, constraint)
    )
    for cls in (
        L.DP_SpectralDense,
        L.DP_QuickSpectralDense,
        L.DP_QuickFrobeniusDense,
        L.DP_SpectralConv2D,
        L.DP_QuickSpectralConv2D,
    )
    for constraint in ("spectral", "frobenius")
}


def zoo_case(builder, input_shape, upper_bound=3.0, **options):
    """A zoo architecture (``builder``: a function name of lipdp.recipes.zoo) at a small
    size. The zoo's list starts with the same DP_BoundedInput that ``build`` adds, so
    ``build`` gets the layers after it."""
    from lipdp.recipes import zoo

    bounded, *body = getattr(zoo, builder)(
        input_shape=input_shape, upper_bound=upper_bound, nb_classes=NB_CLASSES, **options
    )
    assert isinstance(bounded, L.DP_BoundedInput) and bounded.upper_bound == upper_bound
    return build(body, input_shape, upper_bound=upper_bound)


#: One case per builder of lipdp.recipes.zoo (and both merge policies of the residual network).
ZOO_CASES = {
    "Zoo:pooled_cnn": lambda: zoo_case("pooled_cnn", (8, 8, 1), widths=(4, 8)),
    "Zoo:strided_cnn(clip)": lambda: zoo_case("strided_cnn", (8, 8, 1), widths=(4, 16), clip=0.3),
    "Zoo:tabular_mlp": lambda: zoo_case("tabular_mlp", VEC, width=8, depth=2, bias=1.0),
    "Zoo:resnet(1-lip-add)": lambda: zoo_case("resnet", (4, 4, 1), blocks=2, width=2),
    "Zoo:resnet(add)": lambda: zoo_case("resnet", (6, 6, 1), merge_policy="add", blocks=1, width=4),
    "Zoo:lip_mlp(groupnorm,bias)": lambda: zoo_case(
        "lip_mlp", VEC, width=8, weight_norm_bound=2.0, group_norm=2, alpha=0.5, bias=0.5
    ),
    "Zoo:lip_convnet(frobenius)": lambda: zoo_case(
        "lip_convnet",
        (8, 8, 1),
        widths=(4, 4),
        dense=8,
        constraint="frobenius",
        weight_norm_bound=1.5,
        group_norm=2,
        alpha=0.4,
    ),
    "Zoo:mlp_mixer": lambda: zoo_case(
        "mlp_mixer", (4, 4, 2), patch_size=2, channels=4, token_hidden=8, channel_hidden=8
    ),
}

ALL_CASES = {
    **LAYER_CASES,
    **LOSS_CASES,
    **COMPOSITION_CASES,
    **NORM_BALL_CASES,
    **ZOO_CASES,
}
