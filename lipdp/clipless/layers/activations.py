"""1-Lipschitz activations.

Both map 0 to 0 and are 1-Lipschitz, hence ``X -> X`` and ``G -> G``
(:class:`~lipdp.clipless.layers.base.NonExpansiveLayer`).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from lipdp.clipless.layers.base import NonExpansiveLayer, register
from lipdp.clipless.layers.fused import fused_kernels_allowed
from lipdp.foundation import compat

#: ``DP_GroupSort(2)`` runs as one XLA-compiled kernel (forward, and one backward) when an
#: example has at least this many values; below, XLA's launch cost exceeds the gain
#: (``benchmarks/groupsort_speed.py``, ``benchmarks/step_speed.py``).
XLA_MIN_VALUES_PER_EXAMPLE = 1024


def _swap_pairs(x):
    """Exchange the two channels of every pair ``(2i, 2i + 1)`` of the last axis."""
    channels = x.shape[-1]
    pairs = tf.reshape(x, [-1, channels // 2, 2])
    return tf.reshape(tf.reverse(pairs, axis=[-1]), tf.shape(x))


@tf.autograph.experimental.do_not_convert  # plain TF ops: autograph would wrap custom_gradient
@tf.custom_gradient
def sort_pairs(x):
    """Sort every pair of adjacent channels; the backward pass applies the same permutation.

    With ``s = swap(x)``, the first channel of a pair takes its partner when ``x > s`` and
    the second when ``x < s``: ``y = where(t, s, x)`` is an exact permutation of ``x``
    (no arithmetic on the values). The custom gradient ``where(t, swap(g), g)`` applies
    that permutation's transpose to the cotangent ``g``, so ``||dy/dx^T g|| = ||g||``
    **everywhere, ties included** (a tie leaves the pair in place). Autodiff through
    ``minimum``/``maximum`` (deel-lip's GroupSort) instead routes both cotangents of a tied
    pair to its first channel: ``||(g1 + g2, 0)||`` reaches ``sqrt(2) ||g||``, which breaks
    the gradient-norm preservation the sensitivity bounds rely on (rule S1). Ties are not
    rare: zero background pixels give exactly tied zero pre-activations.
    """
    channels = x.shape[-1]
    first = tf.constant(np.arange(channels) % 2 == 0)
    swapped = _swap_pairs(x)
    take_partner = tf.where(first, x > swapped, x < swapped)

    def grad(g):
        return tf.where(take_partner, _swap_pairs(g), g)

    return tf.where(take_partner, swapped, x), grad


def _swapped_forward(x):
    """``(y, t)`` of :func:`sort_pairs` (``t``: one boolean per value, "takes its partner")."""
    channels = x.shape[-1]
    first = tf.constant(np.arange(channels) % 2 == 0)
    swapped = _swap_pairs(x)
    take_partner = tf.where(first, x > swapped, x < swapped)
    return tf.where(take_partner, swapped, x), take_partner


def _swapped_backward(g, take_partner):
    return tf.where(take_partner, _swap_pairs(g), g)


def _paired_forward(x):
    """``(y, t)``, the same permutation on the ``(-1, 2)`` view: with ``(a, b)`` a pair,
    ``t = a > b`` (one boolean per pair) and ``y = (where(t, b, a), where(t, a, b))``.
    ``y`` is the output of :func:`sort_pairs` bit for bit (each output value is one input
    value, chosen by the same comparison; a tie stays in place)."""
    pairs = tf.reshape(x, [-1, 2])
    a, b = pairs[:, 0], pairs[:, 1]
    swap = a > b
    y = tf.stack([tf.where(swap, b, a), tf.where(swap, a, b)], axis=1)
    return tf.reshape(y, tf.shape(x)), swap


def _paired_backward(g, swap):
    pairs = tf.reshape(g, [-1, 2])
    ga, gb = pairs[:, 0], pairs[:, 1]
    return tf.reshape(
        tf.stack([tf.where(swap, gb, ga), tf.where(swap, ga, gb)], axis=1), tf.shape(g)
    )


# Forward and backward compiled as two XLA functions (one trace and one compilation per
# input shape: the channel count must be static); the custom gradient between them stays
# in the TensorFlow graph and hands the backward only the booleans.
_XLA_FORMS = {
    "swapped": (
        tf.function(_swapped_forward, jit_compile=True),
        tf.function(_swapped_backward, jit_compile=True),
    ),
    "paired": (
        tf.function(_paired_forward, jit_compile=True),
        tf.function(_paired_backward, jit_compile=True),
    ),
}

#: From this many channels on, the XLA pair sort runs on the ``(-1, 2)`` view
#: (:func:`_paired_forward`), below on the swapped copy (:func:`_swapped_forward`): XLA's
#: CPU code for the swap slows down with the channel count, the paired view's does not
#: (forward + backward, one thread, ``benchmarks/groupsort_speed.py``: at 32 channels the
#: swapped form takes 0.8x the paired one, at 64 channels 1.6x).
PAIRED_VIEW_MIN_CHANNELS = 64


@tf.autograph.experimental.do_not_convert
@tf.custom_gradient
def sort_pairs_xla(x):
    """:func:`sort_pairs` as two XLA kernels, one forward (outputs and the permutation's
    booleans) and one backward (the same permutation applied to the cotangent): same
    outputs and gradients bit for bit, ties included."""
    form = "paired" if x.shape[-1] >= PAIRED_VIEW_MIN_CHANNELS else "swapped"
    forward, backward = _XLA_FORMS[form]
    y, permutation = forward(x)

    def grad(g):
        return backward(g, permutation)

    return y, grad


def _ordered_pairs(ops, groups):
    """``(min, max)`` of every pair (last axis of size 2) by ONE comparison: ``swap = a >
    b``, then ``where(swap, b, a)`` and ``where(swap, a, b)``. Each output is one input,
    selected by the same boolean for both, so the Jacobian is a permutation matrix
    everywhere, ties included (at ``a == b`` the pair stays in place and the cotangents
    pass through unchanged): ``||J^T g|| = ||g||``, the 1-Lipschitz bound the bound pass
    uses, as for ``sort_pairs`` on TensorFlow. (The gradients of ``min``/``max`` at a tie
    follow the framework's convention -- TensorFlow's sends the whole cotangent to both
    inputs, ``||J^T g||`` up to ``sqrt(2) ||g||`` -- and ``sort`` is slow on XLA's CPU.)"""
    first, second = groups[..., 0], groups[..., 1]
    swap = first > second
    return ops.stack([ops.where(swap, second, first), ops.where(swap, first, second)], axis=-1)


@register
class DP_GroupSort(keras.layers.Layer, NonExpansiveLayer):
    """Sorts the channels (last axis) by groups of ``n`` (GroupSort, Anil et al. 2019).

    A permutation of the coordinates inside each group: the output norm equals the input
    norm, and the backward pass applies the transposed permutation to the cotangent, so
    the layer is gradient-norm preserving. For ``n = 2`` it runs :func:`sort_pairs`
    (exact permutation gradient at ties, about 2-4x faster than ``min``/``max``;
    XLA-compiled when ``jit_compile`` allows it), otherwise ``tf.sort``, whose gradient
    scatters the cotangent through the sort indices (a permutation, ties included).

    Backends: the grouped sort is ``ops.sort`` (:func:`lipdp.foundation.compat.array_ops`) on
    every backend; ``n = 2`` on TensorFlow runs :func:`sort_pairs` instead (a per-backend
    hook: ``tf.custom_gradient``, XLA). JAX differentiates ``sort`` by sorting the operand
    together with an iota and gathering the tangent with the resulting permutation: the
    Jacobian is that permutation matrix, ties included (a tie keeps the iota's order), so
    ``||J^T g|| = ||g||`` everywhere (``tests/clipless/jax`` checks it at tied zeros).

    The layer is lipdp's own: it no longer derives from deel-lip's ``GroupSort`` (a Keras 2
    layer), and reads and writes the same configuration keys (``n``, ``data_format``,
    ``k_coef_lip``), so models saved before load unchanged.

    Args:
        n: group size (``None``, or more than the channels: sort all channels). Must divide
            the number of channels.
        data_format: ``"channels_last"`` only.
        k_coef_lip: must be 1 (the layer is 1-Lipschitz by construction; accepted for the
            configurations of deel-lip's layer).
        jit_compile: ``None`` (default) compiles ``n = 2`` with XLA when an example has at
            least :data:`XLA_MIN_VALUES_PER_EXAMPLE` values; ``True``/``False`` force it.
            Each new batch size compiles once (a few per run; more with Poisson
            sampling, whose batch sizes vary).
    """

    def __init__(
        self, n=2, data_format="channels_last", k_coef_lip=1.0, jit_compile=None, **kwargs
    ):
        if k_coef_lip != 1.0:
            raise ValueError("DP_GroupSort is 1-Lipschitz by construction; k_coef_lip must be 1.")
        if data_format != "channels_last":
            raise ValueError(
                f"DP_GroupSort sorts the last axis: data_format must be 'channels_last', "
                f"got {data_format!r}."
            )
        if jit_compile not in (None, True, False):
            raise ValueError(f"jit_compile must be None, True or False, got {jit_compile!r}.")
        super().__init__(**kwargs)
        self.n = n
        self.data_format = data_format
        self.jit_compile = jit_compile

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        channels = input_shape[-1]
        if self.n is None or self.n > channels:
            self.n = channels
        if channels % self.n != 0:
            raise ValueError(
                f"DP_GroupSort: the group size n={self.n} must divide the {channels} channels."
            )
        # The groups as the last axis, for ops.sort.
        self.flat_shape = (-1, *input_shape[1:-1], channels // self.n, self.n)
        super().build(input_shape)

    def compute_output_shape(self, input_shape):
        return input_shape

    def _use_xla(self, input_shape):
        if self.jit_compile is not None:
            return self.jit_compile
        if not fused_kernels_allowed():  # e.g. under pfor (lipdp.clipless.layers.fused)
            return False
        return math.prod(input_shape[1:]) >= XLA_MIN_VALUES_PER_EXAMPLE

    def call(self, x):
        if self.n == 2 and compat.keras_backend() == "tensorflow":
            return sort_pairs_xla(x) if self._use_xla(x.shape) else sort_pairs(x)
        ops = compat.array_ops()
        groups = ops.reshape(x, self.flat_shape)
        if self.n == 2:  # JAX: a compare and two selects, 20x faster than XLA's CPU sort
            return ops.reshape(_ordered_pairs(ops, groups), ops.shape(x))
        return ops.reshape(ops.sort(groups, axis=-1), ops.shape(x))

    def get_config(self):
        return {
            **super().get_config(),
            "n": self.n,
            "data_format": self.data_format,
            "k_coef_lip": 1.0,
            "jit_compile": self.jit_compile,
        }


@register
class DP_ReLU(keras.layers.ReLU, NonExpansiveLayer):
    """ReLU, optionally leaky (``|negative_slope| <= 1``) or capped (``max_value``).

    With threshold 0 and ``|negative_slope| <= 1`` each coordinate satisfies
    ``|f(a) - f(b)| <= |a - b|`` and ``f(0) = 0``. A non-zero threshold breaks
    ``|f(a)| <= |a|`` and is refused.
    """

    def __init__(self, max_value=None, negative_slope=0.0, threshold=0.0, **kwargs):
        if threshold != 0.0:
            raise ValueError("DP_ReLU requires threshold=0 (otherwise ||f(x)|| <= ||x|| fails).")
        if abs(negative_slope) > 1.0:
            raise ValueError("DP_ReLU requires |negative_slope| <= 1 to stay 1-Lipschitz.")
        if max_value is not None and max_value < 0:
            raise ValueError("DP_ReLU requires max_value >= 0.")
        super().__init__(max_value=max_value, negative_slope=negative_slope, **kwargs)
