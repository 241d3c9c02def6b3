"""Every Keras 2.15 layer class in clipped DP-SGD: trained with ghost norms, trained by the
vectorised per-example fallback (a loop over rows where pfor cannot vectorise), or
refused with one line (issue 26, rule S13). The table of ``docs/keras_layers.md``.

For each layer that trains, a small ``DPSGD_Sequential`` (the layer, then ``Flatten`` and
a ``Dense`` head) with Poisson metadata: the per-example squared norms of the model's
engine (ghost and Jacobian methods) equal a naive loop of one ``GradientTape`` per row
(float64 comparison), and the attacker's remove-one step releases at most the declared
sensitivity -- with the clip norm below every row's gradient norm, each row's
contribution is exactly ``R``: the ratio is 1 (not vacuous). Stochastic layers are
compared with their randomness off (a batch and a single row draw differently) and run
one step with it on. Refused layers raise at construction (or, for what only a forward
pass shows, at the first trace, before any step) with the message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.clipped.per_example import per_example_gradients, row_loop_layers
from lipdp.foundation import compat
from lipdp.foundation.metadata import DatasetMetadata
from tests.marks import thorough
from tests.remove_one import TOLERANCE, remove_one_ratios

L = tf.keras.layers
BATCH, CLASSES, IDS = 4, 3, 6
#: Input shape of each kind of data (one row).
SHAPES = {
    "vector": (4,),
    "sequence": (5, 3),
    "image": (6, 6, 2),
    "volume": (4, 4, 4, 2),  # Conv3D (depth, height, width, channels); time x image
    "frames": (3, 4, 2),  # ConvLSTM1D: time x (steps, channels)
    "ids": (5,),
    "strings": (1,),
    "text": (),
}

GHOST, FALLBACK, ROW_LOOP, NO_WEIGHTS, REFUSED = (
    "ghost norms",
    "vectorised fallback",
    "fallback, loop over rows",
    "no weights",
    "refused",
)
#: LSTM and GRU in their default configuration: Keras' fused kernel, which pfor cannot
#: vectorise (a loop over rows), runs on any device on Keras 2, only on a GPU (cuDNN) on
#: Keras 3, whose plain loop elsewhere is vectorised.
FUSED_RNN = ROW_LOOP if not compat.keras_3() or tf.config.list_logical_devices("GPU") else FALLBACK
#: Layers Keras 3 no longer has (``pytest.mark.skipif`` on Keras 3, with the reason).
KERAS_2_ONLY = {
    "LocallyConnected1D": "Keras 3 has no LocallyConnected1D layer (removed from Keras)",
    "LocallyConnected2D": "Keras 3 has no LocallyConnected2D layer (removed from Keras)",
    "RandomFourierFeatures": (
        "Keras 3 has no RandomFourierFeatures layer (keras.layers.experimental is gone)"
    ),
}


@dataclass(frozen=True)
class Case:
    """``build(shape)``: the layers under test (the first takes the input shape);
    ``quiet(shape)``: the same with their randomness off (stochastic layers)."""

    group: str
    inputs: str
    build: Callable
    outcome: str
    refusal: str = ""
    quiet: Callable | None = None


def _functional(shape, body, name="block"):
    inputs = tf.keras.Input(shape)
    return tf.keras.Model(inputs, body(inputs), name=name)


def _merge(merge):
    """A residual-like block: ``merge([x, Dense(x)])`` (shapes kept)."""
    return lambda s: [
        _functional(s, lambda i: merge([i, L.Dense(s[-1], activation="tanh")(i)]), name="merge")
    ]


def _listed(layers):
    return layers if isinstance(layers, list) else [layers]


def _no_weights(group, inputs, layer_fn, quiet=None):
    """A layer without weights, first in the model (or after an ``InputLayer``: a list)."""
    quiet_build = None if quiet is None else (lambda s: _listed(quiet(s)))
    return Case(group, inputs, lambda s: _listed(layer_fn(s)), NO_WEIGHTS, quiet=quiet_build)


def _after_input(layer, shape, dtype=None):
    """``[InputLayer, layer]``: Keras 3's preprocessing and spatial dropout layers take no
    ``input_shape``."""
    return [compat.input_layer(shape, dtype), layer]


def _prebuilt(layer, shape):
    """``layer`` built now for inputs of ``shape``: Keras 3's ``Normalization`` given its
    mean and variance makes them tensors in ``build``, which a model's symbolic build (a
    scratch graph) would leave out of scope (a plain Keras 3 subclassed model fails
    alike on its first call)."""
    layer.build((None, *shape))
    return layer


def _sync_batch_norm(shape):
    """Keras 2's ``experimental.SyncBatchNormalization``, Keras 3's
    ``BatchNormalization(synchronized=True)``."""
    if compat.keras_3():
        return [L.BatchNormalization(synchronized=True, input_shape=shape)]
    return [L.experimental.SyncBatchNormalization(input_shape=shape)]


class _TiedProjection(L.Layer):
    """Projects back with the kernel of an earlier Dense it does not track (weight tying
    through a closure): ghost norms would drop this use of the kernel."""

    def __init__(self, read_kernel, **kwargs):
        super().__init__(**kwargs)
        self._read_kernel = read_kernel  # a function: Keras does not track it

    def call(self, inputs):
        return tf.matmul(inputs, self._read_kernel(), transpose_b=True)


def _tied(s):
    dense = L.Dense(3, input_shape=s)
    return [dense, _TiedProjection(lambda: dense.kernel, name="tied")]


class Block(L.Layer):
    """A custom layer with tracked sub-layers (a residual block). (No leading underscore:
    Keras 3 refuses a default name starting with ``_`` as a root name scope.)"""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = L.Dense(4, activation="tanh")
        self.norm = L.LayerNormalization()

    def call(self, inputs):
        return self.norm(inputs + self.inner(inputs))


def _preprocessing_then_embedding(lookup):
    return lambda s: [*_listed(lookup(s)), L.Embedding(IDS + 2, 2)]


def _stateful(s):
    if compat.keras_3():  # the batch size is declared by the input (no batch_input_shape)
        return [L.InputLayer(batch_shape=(BATCH, *s)), L.SimpleRNN(3, stateful=True)]
    return [L.SimpleRNN(3, stateful=True, batch_input_shape=(BATCH, *s))]


def _nested_stateful(s):
    lstm = L.LSTM(3, stateful=True, name="lstm_1")
    backbone = tf.keras.Sequential([L.Dense(3), lstm], name="backbone")
    backbone.build((BATCH, *s))
    return [backbone]


# fmt: off
CASES = {
    # ---------------------------------------------------------------- core
    "Dense": Case("core", "vector", lambda s: [L.Dense(3, input_shape=s)], GHOST),
    "Dense (sequences)": Case("core", "sequence", lambda s: [L.Dense(2, input_shape=s)], GHOST),
    "Dense (kernel/bias_regularizer)": Case(
        "core", "vector",
        lambda s: [L.Dense(3, kernel_regularizer="l2", bias_regularizer="l1", input_shape=s)],
        GHOST,
    ),
    "EinsumDense": Case(
        "core", "sequence",
        lambda s: [L.EinsumDense("btd,de->bte", (5, 2), bias_axes="e", input_shape=s)],
        FALLBACK,
    ),
    "Embedding": Case("core", "ids", lambda s: [L.Embedding(IDS, 2, input_shape=s)], GHOST),
    "Embedding (mask_zero)": Case(
        "core", "ids",
        lambda s: [L.Embedding(IDS, 2, mask_zero=True, input_shape=s), L.GlobalAvgPool1D()],
        FALLBACK,
    ),
    "Activation": _no_weights("core", "vector", lambda s: L.Activation("tanh", input_shape=s)),
    "Identity": _no_weights("core", "vector", lambda s: L.Identity(input_shape=s)),
    "InputLayer": Case("core", "vector", lambda s: [L.InputLayer(input_shape=s)], NO_WEIGHTS),
    "Lambda": _no_weights("core", "vector", lambda s: L.Lambda(tf.sin, input_shape=s)),
    "Masking": Case(
        "core", "sequence",
        lambda s: [L.Masking(input_shape=s), L.GlobalAvgPool1D()],
        NO_WEIGHTS,
    ),
    "untracked weight sharing (Lambda-like tying)": Case(
        "core", "vector", _tied, REFUSED,
        "Layer 'tied' reads variable '.*kernel.*' of layer 'dense.*' without tracking it",
    ),
    # -------------------------------------------------------- convolution
    "Conv1D": Case("convolution", "sequence", lambda s: [L.Conv1D(2, 2, input_shape=s)], FALLBACK),
    "Conv2D": Case("convolution", "image", lambda s: [L.Conv2D(2, 3, input_shape=s)], GHOST),
    "Conv3D": Case("convolution", "volume", lambda s: [L.Conv3D(2, 2, input_shape=s)], FALLBACK),
    "Conv1D (groups=3)": Case(
        "convolution", "sequence", lambda s: [L.Conv1D(3, 2, groups=3, input_shape=s)], ROW_LOOP
    ),
    "Conv2D (groups=2)": Case(
        "convolution", "image", lambda s: [L.Conv2D(4, 3, groups=2, input_shape=s)], ROW_LOOP
    ),
    "Conv3D (groups=2)": Case(
        "convolution", "volume", lambda s: [L.Conv3D(2, 2, groups=2, input_shape=s)], ROW_LOOP
    ),
    "Conv1DTranspose": Case(
        "convolution", "sequence", lambda s: [L.Conv1DTranspose(2, 2, input_shape=s)], FALLBACK
    ),
    "Conv2DTranspose": Case(
        "convolution", "image",
        lambda s: [L.Conv2DTranspose(2, 2, strides=2, input_shape=s)], FALLBACK,
    ),
    "Conv3DTranspose": Case(
        "convolution", "volume", lambda s: [L.Conv3DTranspose(2, 2, input_shape=s)], FALLBACK
    ),
    "DepthwiseConv1D": Case(
        "convolution", "sequence", lambda s: [L.DepthwiseConv1D(2, input_shape=s)], FALLBACK
    ),
    "DepthwiseConv2D": Case(
        "convolution", "image", lambda s: [L.DepthwiseConv2D(3, input_shape=s)], FALLBACK
    ),
    "SeparableConv1D": Case(
        "convolution", "sequence", lambda s: [L.SeparableConv1D(2, 2, input_shape=s)], FALLBACK
    ),
    "SeparableConv2D": Case(
        "convolution", "image", lambda s: [L.SeparableConv2D(2, 3, input_shape=s)], FALLBACK
    ),
    "LocallyConnected1D": Case(
        "convolution", "sequence", lambda s: [L.LocallyConnected1D(2, 2, input_shape=s)], FALLBACK
    ),
    "LocallyConnected2D": Case(
        "convolution", "image", lambda s: [L.LocallyConnected2D(2, 3, input_shape=s)], FALLBACK
    ),
    # ------------------------------------------------------------ pooling
    "MaxPooling1D": _no_weights("pooling", "sequence", lambda s: L.MaxPooling1D(input_shape=s)),
    "MaxPooling2D": _no_weights("pooling", "image", lambda s: L.MaxPooling2D(input_shape=s)),
    "MaxPooling3D": _no_weights("pooling", "volume", lambda s: L.MaxPooling3D(input_shape=s)),
    # Keras 3's AveragePooling has no default pool size (Keras 2's is 2).
    "AveragePooling1D": _no_weights(
        "pooling", "sequence", lambda s: L.AveragePooling1D(2, input_shape=s)
    ),
    "AveragePooling2D": _no_weights(
        "pooling", "image", lambda s: L.AveragePooling2D(2, input_shape=s)
    ),
    "AveragePooling3D": _no_weights(
        "pooling", "volume", lambda s: L.AveragePooling3D(2, input_shape=s)
    ),
    "GlobalMaxPooling1D": _no_weights(
        "pooling", "sequence", lambda s: L.GlobalMaxPooling1D(input_shape=s)
    ),
    "GlobalMaxPooling2D": _no_weights(
        "pooling", "image", lambda s: L.GlobalMaxPooling2D(input_shape=s)
    ),
    "GlobalMaxPooling3D": _no_weights(
        "pooling", "volume", lambda s: L.GlobalMaxPooling3D(input_shape=s)
    ),
    "GlobalAveragePooling1D": _no_weights(
        "pooling", "sequence", lambda s: L.GlobalAveragePooling1D(input_shape=s)
    ),
    "GlobalAveragePooling2D": _no_weights(
        "pooling", "image", lambda s: L.GlobalAveragePooling2D(input_shape=s)
    ),
    "GlobalAveragePooling3D": _no_weights(
        "pooling", "volume", lambda s: L.GlobalAveragePooling3D(input_shape=s)
    ),
    # ------------------------------------------------------ normalisation
    "LayerNormalization": Case(
        "normalisation", "vector", lambda s: [L.LayerNormalization(input_shape=s)], FALLBACK
    ),
    "GroupNormalization": Case(
        "normalisation", "image", lambda s: [L.GroupNormalization(2, input_shape=s)], FALLBACK
    ),
    "UnitNormalization": _no_weights(
        "normalisation", "vector", lambda s: L.UnitNormalization(input_shape=s)
    ),
    "Normalization (preprocessing)": _no_weights(
        "normalisation", "vector",
        lambda s: _prebuilt(L.Normalization(mean=0.5, variance=2.0, input_shape=s), s),
    ),
    "BatchNormalization": Case(
        "normalisation", "vector", lambda s: [L.BatchNormalization(input_shape=s)], REFUSED,
        "normalises with batch statistics",
    ),
    "SyncBatchNormalization": Case(
        "normalisation", "vector",
        _sync_batch_norm, REFUSED,
        "normalises with batch statistics",
    ),
    "SpectralNormalization": Case(
        "normalisation", "vector",
        lambda s: [L.SpectralNormalization(L.Dense(3), input_shape=s)], REFUSED,
        "'spectral_normalization' \\(SpectralNormalization\\) rewrites its kernel",
    ),
    # ---------------------------------------------------------- recurrent
    "SimpleRNN": Case(
        "recurrent", "sequence", lambda s: [L.SimpleRNN(2, input_shape=s)], FALLBACK
    ),
    "LSTM": Case("recurrent", "sequence", lambda s: [L.LSTM(2, input_shape=s)], FUSED_RNN),
    "GRU": Case(
        "recurrent", "sequence",
        lambda s: [L.GRU(2, return_sequences=True, input_shape=s)], FUSED_RNN,
    ),
    "GRU (reset_after=False)": Case(
        "recurrent", "sequence",
        lambda s: [L.GRU(2, reset_after=False, input_shape=s)], FALLBACK,
    ),
    "RNN (SimpleRNNCell, LSTMCell, GRUCell stacked)": Case(
        "recurrent", "sequence",
        lambda s: [
            L.RNN(
                L.StackedRNNCells([L.SimpleRNNCell(2), L.LSTMCell(2), L.GRUCell(2)]),
                input_shape=s,
            )
        ],
        FALLBACK,
    ),
    "Bidirectional (LSTM)": Case(
        "recurrent", "sequence",
        lambda s: [L.Bidirectional(L.LSTM(2), input_shape=s)], FUSED_RNN,
    ),
    "Bidirectional (SimpleRNN)": Case(
        "recurrent", "sequence",
        lambda s: [L.Bidirectional(L.SimpleRNN(2, return_sequences=True), input_shape=s)],
        FALLBACK,
    ),
    "ConvLSTM1D": Case(
        "recurrent", "frames", lambda s: [L.ConvLSTM1D(2, 2, input_shape=s)], FALLBACK
    ),
    "ConvLSTM2D": Case(
        "recurrent", "volume", lambda s: [L.ConvLSTM2D(2, 2, input_shape=s)], FALLBACK
    ),
    "SimpleRNN (stateful)": Case(
        "recurrent", "sequence", _stateful, REFUSED,
        "'simple_rnn' \\(SimpleRNN\\) is stateful: its state carries one batch's rows",
    ),
    "LSTM (stateful, nested)": Case(
        "recurrent", "sequence", _nested_stateful, REFUSED,
        "'backbone/lstm_1' \\(LSTM\\) is stateful",
    ),
    # ---------------------------------------------------------- attention
    "MultiHeadAttention": Case(
        "attention", "sequence",
        lambda s: [_functional(s, lambda i: L.MultiHeadAttention(2, 2)(i, i))], FALLBACK,
    ),
    "Attention": Case(
        "attention", "sequence",
        lambda s: [_functional(s, lambda i: L.Attention(use_scale=True)([i, i]))], FALLBACK,
    ),
    "AdditiveAttention": Case(
        "attention", "sequence",
        lambda s: [_functional(s, lambda i: L.AdditiveAttention()([i, i]))], FALLBACK,
    ),
    # ------------------------------------------------------------ merging
    "Add": Case("merging", "vector", _merge(L.Add()), FALLBACK),
    "Subtract": Case("merging", "vector", _merge(L.Subtract()), FALLBACK),
    "Multiply": Case("merging", "vector", _merge(L.Multiply()), FALLBACK),
    "Average": Case("merging", "vector", _merge(L.Average()), FALLBACK),
    "Maximum": Case("merging", "vector", _merge(L.Maximum()), FALLBACK),
    "Minimum": Case("merging", "vector", _merge(L.Minimum()), FALLBACK),
    "Concatenate": Case("merging", "vector", _merge(L.Concatenate()), FALLBACK),
    "Dot": Case("merging", "vector", _merge(L.Dot(axes=1)), FALLBACK),
    # ---------------------------------------------------- wrappers, nesting
    "TimeDistributed (Dense)": Case(
        "wrappers", "sequence", lambda s: [L.TimeDistributed(L.Dense(2), input_shape=s)], FALLBACK
    ),
    "TimeDistributed (Conv2D)": Case(
        "wrappers", "volume",
        lambda s: [L.TimeDistributed(L.Conv2D(2, 2), input_shape=s)], FALLBACK,
    ),
    "Sequential (nested twice)": Case(
        "wrappers", "vector",
        lambda s: [
            tf.keras.Sequential(
                [L.Dense(3, activation="relu"), tf.keras.Sequential([L.Dense(2)])],
                name="backbone",
            )
        ],
        GHOST,
    ),
    "functional model (nested chain)": Case(
        "wrappers", "image",
        lambda s: [_functional(s, lambda i: L.Conv2D(2, 3)(L.Rescaling(0.5)(i)))], GHOST,
    ),
    "Sequential (nested, a layer reading its sibling's kernel)": Case(
        "wrappers", "vector", lambda s: [tf.keras.Sequential(_tied(s), name="backbone")], FALLBACK
    ),
    "custom layer with sub-layers": Case(
        "wrappers", "vector", lambda s: [Block(input_shape=s)], FALLBACK
    ),
    # ------------------------------------------------------ regularisation
    "Dropout": _no_weights(
        "regularisation", "vector",
        lambda s: L.Dropout(0.5, input_shape=s), quiet=lambda s: L.Dropout(0.0, input_shape=s),
    ),
    "SpatialDropout1D": _no_weights(
        "regularisation", "sequence",
        lambda s: _after_input(L.SpatialDropout1D(0.5), s),
        quiet=lambda s: _after_input(L.SpatialDropout1D(0.0), s),
    ),
    "SpatialDropout2D": _no_weights(
        "regularisation", "image",
        lambda s: _after_input(L.SpatialDropout2D(0.5), s),
        quiet=lambda s: _after_input(L.SpatialDropout2D(0.0), s),
    ),
    "SpatialDropout3D": _no_weights(
        "regularisation", "volume",
        lambda s: _after_input(L.SpatialDropout3D(0.5), s),
        quiet=lambda s: _after_input(L.SpatialDropout3D(0.0), s),
    ),
    "GaussianDropout": _no_weights(
        "regularisation", "vector",
        lambda s: L.GaussianDropout(0.3, input_shape=s),
        quiet=lambda s: L.GaussianDropout(0.0, input_shape=s),
    ),
    "GaussianNoise": _no_weights(
        "regularisation", "vector",
        lambda s: L.GaussianNoise(0.3, input_shape=s),
        quiet=lambda s: L.GaussianNoise(0.0, input_shape=s),
    ),
    "AlphaDropout": _no_weights(
        "regularisation", "vector",
        lambda s: L.AlphaDropout(0.3, input_shape=s),
        quiet=lambda s: L.AlphaDropout(0.0, input_shape=s),
    ),
    "ActivityRegularization": Case(
        "regularisation", "vector", lambda s: [L.ActivityRegularization(l2=0.1, input_shape=s)],
        REFUSED, "has an activity_regularizer",
    ),
    "activity_regularizer (nested)": Case(
        "regularisation", "vector",
        lambda s: [
            tf.keras.Sequential(
                [L.Dense(3, activity_regularizer="l2", input_shape=s)], name="backbone"
            )
        ],
        REFUSED, "'backbone/dense.*' \\(Dense\\) has an activity regulariser",
    ),
    # ---------------------------------------------------------- activations
    "ReLU": _no_weights("activations", "vector", lambda s: L.ReLU(input_shape=s)),
    "LeakyReLU": _no_weights("activations", "vector", lambda s: L.LeakyReLU(input_shape=s)),
    "ELU": _no_weights("activations", "vector", lambda s: L.ELU(input_shape=s)),
    "Softmax": _no_weights("activations", "vector", lambda s: L.Softmax(input_shape=s)),
    "ThresholdedReLU": _no_weights(
        "activations", "vector", lambda s: L.ThresholdedReLU(0.1, input_shape=s)
    ),
    "PReLU": Case("activations", "vector", lambda s: [L.PReLU(input_shape=s)], FALLBACK),
    # ------------------------------------------------------------ reshaping
    "Flatten": _no_weights("reshaping", "image", lambda s: L.Flatten(input_shape=s)),
    "Reshape": _no_weights("reshaping", "image", lambda s: L.Reshape((-1, 2), input_shape=s)),
    "Permute": _no_weights("reshaping", "sequence", lambda s: L.Permute((2, 1), input_shape=s)),
    "RepeatVector": _no_weights("reshaping", "vector", lambda s: L.RepeatVector(2, input_shape=s)),
    "Cropping1D": _no_weights("reshaping", "sequence", lambda s: L.Cropping1D(1, input_shape=s)),
    "Cropping2D": _no_weights("reshaping", "image", lambda s: L.Cropping2D(1, input_shape=s)),
    "Cropping3D": _no_weights("reshaping", "volume", lambda s: L.Cropping3D(1, input_shape=s)),
    "UpSampling1D": _no_weights("reshaping", "sequence", lambda s: L.UpSampling1D(input_shape=s)),
    "UpSampling2D": _no_weights("reshaping", "image", lambda s: L.UpSampling2D(input_shape=s)),
    "UpSampling3D": _no_weights("reshaping", "volume", lambda s: L.UpSampling3D(input_shape=s)),
    "ZeroPadding1D": _no_weights("reshaping", "sequence", lambda s: L.ZeroPadding1D(input_shape=s)),
    "ZeroPadding2D": _no_weights("reshaping", "image", lambda s: L.ZeroPadding2D(input_shape=s)),
    "ZeroPadding3D": _no_weights("reshaping", "volume", lambda s: L.ZeroPadding3D(input_shape=s)),
    # -------------------------------------------------------- preprocessing
    "Rescaling": _no_weights("preprocessing", "image", lambda s: L.Rescaling(0.5, input_shape=s)),
    "Resizing": _no_weights("preprocessing", "image", lambda s: L.Resizing(4, 4, input_shape=s)),
    "CenterCrop": _no_weights(
        "preprocessing", "image", lambda s: L.CenterCrop(4, 4, input_shape=s)
    ),
    "RandomFlip": _no_weights(
        "preprocessing", "image", lambda s: L.RandomFlip(input_shape=s),
        quiet=lambda s: L.Identity(input_shape=s),  # the draw "not flipped"
    ),
    # Pooled: Keras 3's RandomCrop crops only in training (the model's symbolic build
    # would size the head for uncropped images).
    "RandomCrop": _no_weights(
        "preprocessing", "image",
        lambda s: [L.RandomCrop(4, 4, input_shape=s), L.GlobalAvgPool2D()],
        quiet=lambda s: [L.CenterCrop(4, 4, input_shape=s), L.GlobalAvgPool2D()],
    ),
    "RandomRotation": _no_weights(
        "preprocessing", "image", lambda s: L.RandomRotation(0.2, input_shape=s),
        quiet=lambda s: L.RandomRotation(0.0, input_shape=s),
    ),
    "RandomZoom": _no_weights(
        "preprocessing", "image", lambda s: L.RandomZoom(0.2, input_shape=s),
        quiet=lambda s: L.RandomZoom(0.0, input_shape=s),
    ),
    "RandomTranslation": _no_weights(
        "preprocessing", "image", lambda s: L.RandomTranslation(0.2, 0.2, input_shape=s),
        quiet=lambda s: L.RandomTranslation(0.0, 0.0, input_shape=s),
    ),
    "RandomContrast": _no_weights(
        "preprocessing", "image", lambda s: L.RandomContrast(0.3, input_shape=s),
        quiet=lambda s: L.Identity(input_shape=s),  # the draw "factor 1"
    ),
    "RandomBrightness": _no_weights(
        "preprocessing", "image",
        lambda s: L.RandomBrightness(0.3, value_range=(-3, 3), input_shape=s),
        quiet=lambda s: L.RandomBrightness(0.0, value_range=(-3, 3), input_shape=s),
    ),
    "RandomHeight / RandomWidth": Case(
        "preprocessing", "image",
        lambda s: [L.RandomHeight(0.3, input_shape=s), L.RandomWidth(0.3), L.GlobalAvgPool2D()],
        NO_WEIGHTS,
        quiet=lambda s: [
            L.RandomHeight(0.0, input_shape=s), L.RandomWidth(0.0), L.GlobalAvgPool2D()
        ],
    ),
    "Discretization": Case(
        "preprocessing", "vector",
        _preprocessing_then_embedding(
            lambda s: _after_input(L.Discretization(bin_boundaries=[-1.0, 0.0, 1.0]), s)
        ),
        GHOST,
    ),
    "Hashing": Case(
        "preprocessing", "ids",
        # no input_shape: a model built at construction feeds float placeholders
        _preprocessing_then_embedding(lambda s: L.Hashing(IDS)), GHOST,
    ),
    "IntegerLookup": Case(
        "preprocessing", "ids",
        _preprocessing_then_embedding(
            lambda s: _after_input(L.IntegerLookup(vocabulary=list(range(1, IDS))), s, "int32")
        ),
        GHOST,
    ),
    "StringLookup": Case(
        "preprocessing", "strings",
        _preprocessing_then_embedding(
            lambda s: _after_input(L.StringLookup(vocabulary=["a", "b", "c"]), s, "string")
        ),
        GHOST,
    ),
    "TextVectorization": Case(
        "preprocessing", "text",
        _preprocessing_then_embedding(
            lambda s: L.TextVectorization(vocabulary=["a", "b", "c"], output_sequence_length=3)
        ),
        GHOST,
    ),
    "CategoryEncoding": _no_weights(
        "preprocessing", "ids",
        lambda s: L.CategoryEncoding(IDS, output_mode="multi_hot", input_shape=s),
    ),
    # ---------------------------------------------------------- experimental
    "RandomFourierFeatures": Case(
        "experimental", "vector",
        lambda s: [L.experimental.RandomFourierFeatures(4, trainable=True, input_shape=s)],
        FALLBACK,
    ),
}
# fmt: on


def _data(kind, rng, rows=BATCH):
    if kind == "ids":
        return rng.integers(0, IDS, size=(rows, *SHAPES[kind])).astype("int32")
    if kind == "strings":
        return rng.choice(["a", "b", "c", "d"], size=(rows, 1))
    if kind == "text":
        return np.array([" ".join(rng.choice(["a", "b", "c", "d"], size=3)) for _ in range(rows)])
    return rng.normal(size=(rows, *SHAPES[kind])).astype("float32")


def _model(layers, gradient_method="ghost"):
    """The layers, ``Flatten`` and a ``Dense`` head; flat clipping below every row's norm."""
    return DPSGD_Sequential(
        [*layers, L.Flatten(), L.Dense(CLASSES)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", 1e-3),
        dataset_metadata=DatasetMetadata(
            input_shape=(1,),
            nb_classes=CLASSES,
            nb_samples_train=40,
            batch_size=BATCH,
            sampling="poisson",
        ),
        gradient_method=gradient_method,
    )


def _compiled(model):
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    return model


def _naive_sq_norms(model, x, y):
    """One tape per row: ``[rows, weighted layers]`` squared norms (float64)."""
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    layers = model.weighted_layers()
    variables = [v for layer in layers for v in layer.trainable_variables]
    result = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], model(x[i : i + 1], training=True))
        grads = tape.gradient(loss, variables, unconnected_gradients="zero")
        squares = [
            np.sum(np.square(tf.convert_to_tensor(g).numpy().astype("float64"))) for g in grads
        ]
        row, start = [], 0
        for layer in layers:
            row.append(sum(squares[start : start + len(layer.trainable_variables)]))
            start += len(layer.trainable_variables)
        result.append(row)
    return np.array(result)


def _engine_facts(model, x, y, method):
    def losses(y_pred):
        return model.per_example_losses(y, y_pred)

    return per_example_gradients(model, tf.constant(x), losses, method)


def _engine_sq_norms(model, x, y, method):
    facts = _engine_facts(model, x, y, method)
    return np.stack([sq.numpy() for sq in facts.sq_norms], axis=1)


def _trained_by(facts, tested) -> str:
    """How the ghost engine trained the tested layers (the head is a ghost Dense): the
    rules of its records (the layers inside a nested chain model have their own)."""
    records = [r for r in facts.records if r.group in tested]
    if not records:
        return NO_WEIGHTS
    if row_loop_layers([r.layer for r in records]):
        return ROW_LOOP
    return FALLBACK if any(r.rule == "vectorized" for r in records) else GHOST


#: In the default run, with every refusal (a fraction of a second each): one case per
#: outcome and per kind of layer the engine treats apart. The thorough tier adds layers
#: that take the same paths (LSTM, 14 s, the row loop of grouped convolutions;
#: MultiHeadAttention, 7 s, and LayerNormalization the fallback of EinsumDense; nested
#: models run by default in test_per_example.py); the others are marked slow (1-50
#: s each: two traced training steps; recurrent loops trace slowly).
DEFAULT_CASES = {
    "EinsumDense", "Conv2D (groups=2)", "Dropout",
    "Sequential (nested, a layer reading its sibling's kernel)",
}  # fmt: skip
THOROUGH_CASES = {
    "LSTM", "MultiHeadAttention", "TimeDistributed (Dense)", "Conv1D", "RandomFlip",
    "LayerNormalization", "Sequential (nested twice)", "StringLookup",
}  # fmt: skip


def _params():
    params = []
    for name, case in CASES.items():
        marks = []
        if case.outcome != REFUSED and name not in DEFAULT_CASES:
            marks.append(thorough if name in THOROUGH_CASES else pytest.mark.slow)
        if name in KERAS_2_ONLY:
            marks.append(pytest.mark.skipif(compat.keras_3(), reason=KERAS_2_ONLY[name]))
        params.append(pytest.param(name, marks=marks) if marks else name)
    return params


@pytest.mark.parametrize("name", _params())
def test_layer_trains_with_exact_norms_or_is_refused_with_one_line(name, rng):
    case = CASES[name]
    shape = SHAPES[case.inputs]
    if case.outcome == REFUSED:
        _check_refused(case, shape, rng)
        return
    layers = (case.quiet or case.build)(shape)
    model = _compiled(_model(layers))
    x, y = (
        _data(case.inputs, rng),
        np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, BATCH)],
    )
    model(x[:1])  # builds every layer
    naive = _naive_sq_norms(model, x, y)
    # Layers without weights pass the rows to the head: its ghost norms, one real step.
    methods = ("ghost",) if case.outcome == NO_WEIGHTS else ("ghost", "jacobian")
    for method in methods:
        facts = _engine_facts(model, x, y, method)
        if method == "ghost":
            assert _trained_by(facts, layers) == case.outcome
        ours = np.stack([sq.numpy() for sq in facts.sq_norms], axis=1)
        np.testing.assert_allclose(ours, naive, rtol=1e-4, atol=1e-12, err_msg=method)
    if case.outcome != NO_WEIGHTS:
        ratios = remove_one_ratios(model, x, y, rows=[0])  # two real steps
        assert 0.99 < ratios.max() <= 1 + TOLERANCE  # every row clipped at R, none above
    if case.outcome == NO_WEIGHTS or case.quiet is not None:
        stepped = _compiled(_model(case.build(shape))) if case.quiet is not None else model
        stepped.train_on_batch(x, y)  # the stochastic layer itself, randomness on
        assert int(stepped.noisy_steps) == 1


def _check_refused(case, shape, rng):
    """One line, at construction or (what only a forward pass shows) at the first trace,
    before any step."""
    try:
        model = _compiled(_model(case.build(shape)))
    except ValueError as error:
        message = str(error)
        assert len(message.splitlines()) == 1, message
        assert re.search(case.refusal, message), message
        return
    x = _data(case.inputs, rng)
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, BATCH)]
    with pytest.raises(ValueError, match=case.refusal):
        model.train_on_batch(x, y)
    assert int(model.noisy_steps) == 0


def test_untracked_weight_sharing_trains_exactly_with_the_jacobian_method(rng):
    """The refusal above is the ghost method's: the Jacobian method differentiates every
    use of the kernel (the naive loop agrees) and stays within the sensitivity."""
    model = _compiled(_model(_tied(SHAPES["vector"]), gradient_method="jacobian"))
    x, y = _data("vector", rng), np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, BATCH)]
    naive = _naive_sq_norms(model, x, y)
    np.testing.assert_allclose(_engine_sq_norms(model, x, y, "jacobian"), naive, rtol=1e-4)
    assert 0.99 < remove_one_ratios(model, x, y, rows=[0]).max() <= 1 + TOLERANCE
