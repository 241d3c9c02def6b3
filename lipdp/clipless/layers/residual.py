"""Residual connections: bounds travel as pairs ``(skip path, transformed path)``.

``make_residuals(policy, layers)`` gives
``[DP_SplitResidual(), DP_WrappedResidual(l1), ..., DP_MergeResidual(policy)]``:
the input is duplicated, the wrapped layers act on the second copy, and the two
copies are merged.
"""

from __future__ import annotations

import keras

from lipdp.clipless.layers.base import DPLayer, register
from lipdp.foundation import compat

MERGE_POLICIES = ("add", "1-lip-add")
#: ``merge(x1, x2) = scale * (x1 + x2)``.
MERGE_SCALES = {"add": 1.0, "1-lip-add": 0.5}


def _paths(value, what):
    """The two entries ``(skip path, transformed path)`` of a value inside a block."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"inside a residual block {what} must be a pair, got {value!r}.")
    return value


@register
class DP_SplitResidual(keras.layers.Layer, DPLayer):
    """``x -> (x, x)``. Bounds ``X -> (X, X)``; cotangents add: ``(G1, G2) -> G1 + G2``;
    Lipschitz constants ``l -> (l, l)`` (one per path)."""

    def call(self, inputs):
        return (inputs, inputs)

    def propagate_inputs(self, input_bound):
        return (input_bound, input_bound)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        g1, g2 = _paths(gradient_bound, "the gradient bound")
        return g1 + g2

    def propagate_lipschitz(self, input_bound, lipschitz):
        if isinstance(lipschitz, (tuple, list)):
            raise ValueError(f"{self.name!r} splits a path that is already split.")
        return (lipschitz, lipschitz)


@register
class DP_MergeResidual(keras.layers.Layer, DPLayer):
    """Merges the two paths.

    ``scale * (x1 + x2)`` with ``scale`` (:data:`MERGE_SCALES`) 1 for ``"add"`` and 1/2
    for ``"1-lip-add"``: bound ``scale * (X1 + X2)``; cotangent ``G -> (scale G, scale G)``;
    Lipschitz constant ``scale * (l1 + l2)`` from the constants ``(l1, l2)`` of the two
    paths w.r.t. the block input. With ``"1-lip-add"`` the whole block is 1-Lipschitz
    when the wrapped layers are.
    """

    def __init__(self, merge_policy="1-lip-add", **kwargs):
        super().__init__(**kwargs)
        if merge_policy not in MERGE_POLICIES:
            raise ValueError(f"merge_policy must be one of {MERGE_POLICIES}, got {merge_policy!r}.")
        self.merge_policy = merge_policy
        #: The merge factor, the one place it is defined.
        self.scale = MERGE_SCALES[merge_policy]

    def call(self, inputs):
        x1, x2 = _paths(inputs, "the inputs")
        return self.scale * (x1 + x2)

    def propagate_inputs(self, input_bound):
        x1, x2 = _paths(input_bound, "the input bound")
        return self.scale * (x1 + x2)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return (self.scale * gradient_bound, self.scale * gradient_bound)

    def propagate_lipschitz(self, input_bound, lipschitz):
        skip, path = _paths(lipschitz, "the Lipschitz constant")
        if isinstance(skip, (tuple, list)) or isinstance(path, (tuple, list)):
            raise ValueError(f"{self.name!r} merges a path that is still split.")
        return self.scale * (skip + path)

    def get_config(self):
        config = super().get_config()
        config.update(merge_policy=self.merge_policy)
        return config


@register
class DP_WrappedResidual(keras.layers.Layer, DPLayer):
    """Applies ``block`` (a DP layer) to the second path, leaves the first unchanged."""

    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        if isinstance(block, dict):
            block = keras.layers.deserialize(block)
        if not isinstance(block, DPLayer):
            raise TypeError(f"DP_WrappedResidual wraps DP layers only, got {type(block).__name__}.")
        self.block = block

    def build(self, input_shape):
        """Builds ``block`` on the second path's shape (Keras 3). Keras 3 infers this
        layer's output without running its ``call`` on symbolic values
        (:meth:`compute_output_spec`): on JAX that ``call`` would run the block's maths on
        tracers of a shape-only trace. On Keras 2 the first call builds the block."""
        if compat.keras_3() and not self.block.built:
            _, shape = _paths(input_shape, "the input shape")
            self.block.build(shape)
        super().build(input_shape)

    def compute_output_spec(self, inputs, training=None, loss_normalizer=None):
        x1, x2 = _paths(inputs, "the inputs")
        skip = keras.KerasTensor(x1.shape, dtype=x1.dtype)  # a new tensor: no graph cycle
        return (skip, self.block.compute_output_spec(x2))

    def call(self, inputs, training=None, loss_normalizer=None):
        x1, x2 = _paths(inputs, "the inputs")
        kwargs = {"loss_normalizer": loss_normalizer} if self.block.uses_loss_normalizer else {}
        return (x1, self.block(x2, training=training, **kwargs))

    @property
    def uses_loss_normalizer(self):
        return self.block.uses_loss_normalizer

    def propagate_lipschitz(self, input_bound, lipschitz):
        _, x2 = _paths(input_bound, "the input bound")
        skip, path = _paths(lipschitz, "the Lipschitz constant")
        return (skip, self.block.propagate_lipschitz(x2, path))

    def propagate_inputs(self, input_bound):
        x1, x2 = _paths(input_bound, "the input bound")
        return (x1, self.block.propagate_inputs(x2))

    def backpropagate_inputs(self, input_bound, gradient_bound):
        _, x2 = _paths(input_bound, "the input bound")
        g1, g2 = _paths(gradient_bound, "the gradient bound")
        return (g1, self.block.backpropagate_inputs(x2, g2))

    def backpropagate_params(self, input_bound, gradient_bound):
        _, x2 = _paths(input_bound, "the input bound")
        _, g2 = _paths(gradient_bound, "the gradient bound")
        return self.block.backpropagate_params(x2, g2)

    def has_parameters(self):
        return self.block.has_parameters()

    def project(self):
        self.block.project()

    @property
    def nm_coef(self):
        return self.block.nm_coef

    def get_config(self):
        config = super().get_config()
        config.update(block=keras.layers.serialize(self.block))
        return config


def make_residuals(merge_policy, wrapped_layers):
    """The layers of one residual block around ``wrapped_layers``."""
    layers = [DP_SplitResidual()]
    layers += [DP_WrappedResidual(layer) for layer in wrapped_layers]
    layers.append(DP_MergeResidual(merge_policy))
    return layers
