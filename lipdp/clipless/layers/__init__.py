"""Lipschitz layers with known sensitivity bounds (see :mod:`lipdp.clipless.layers.base`)."""

from lipdp.clipless.layers.activations import DP_GroupSort, DP_ReLU
from lipdp.clipless.layers.base import DPLayer, NonExpansiveLayer
from lipdp.clipless.layers.bias import DP_AddBias
from lipdp.clipless.layers.clipping import DP_ClipGradient
from lipdp.clipless.layers.convolution import DP_QuickSpectralConv2D, DP_SpectralConv2D
from lipdp.clipless.layers.dense import (
    DP_QuickFrobeniusDense,
    DP_QuickSpectralDense,
    DP_SpectralDense,
)
from lipdp.clipless.layers.inputs import DP_BoundedInput, DP_InputLayer
from lipdp.clipless.layers.lambda_layer import DP_Lambda
from lipdp.clipless.layers.normalization import DP_GroupNormalization, DP_LayerCentering
from lipdp.clipless.layers.pooling import (
    DP_MaxPool2D,
    DP_ScaledGlobalL2NormPooling2D,
    DP_ScaledL2NormPooling2D,
)
from lipdp.clipless.layers.residual import (
    DP_MergeResidual,
    DP_SplitResidual,
    DP_WrappedResidual,
    make_residuals,
)
from lipdp.clipless.layers.scattering import DP_ScatteringTransform
from lipdp.clipless.layers.shapes import DP_Flatten, DP_Permute, DP_Reshape

__all__ = [
    "DPLayer",
    "NonExpansiveLayer",
    "DP_BoundedInput",
    "DP_InputLayer",
    "DP_SpectralDense",
    "DP_QuickSpectralDense",
    "DP_QuickFrobeniusDense",
    "DP_SpectralConv2D",
    "DP_QuickSpectralConv2D",
    "DP_GroupSort",
    "DP_ReLU",
    "DP_ScaledL2NormPooling2D",
    "DP_ScaledGlobalL2NormPooling2D",
    "DP_MaxPool2D",
    "DP_Flatten",
    "DP_Reshape",
    "DP_Permute",
    "DP_LayerCentering",
    "DP_GroupNormalization",
    "DP_ScatteringTransform",
    "DP_AddBias",
    "DP_ClipGradient",
    "DP_Lambda",
    "DP_SplitResidual",
    "DP_WrappedResidual",
    "DP_MergeResidual",
    "make_residuals",
]
