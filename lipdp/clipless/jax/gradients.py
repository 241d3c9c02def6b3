"""The JAX side of the clipless family's custom gradients (imported under the JAX backend
only, by :func:`lipdp.clipless.layers.clipping._clip_cotangent`)."""

from __future__ import annotations

import functools

import jax


def with_clipped_cotangent(inputs, clip_value, normalizer, rule):
    """The identity on ``inputs`` whose backward pass is ``rule(cotangent, clip_value,
    normalizer)`` (:func:`lipdp.clipless.layers.clipping.clipped_cotangent`, the formula
    TensorFlow's ``tf.custom_gradient`` applies too): a ``jax.custom_vjp``. ``clip_value`` is
    an ordinary argument (a jit step passes its value from the state, so a new value needs no
    retrace) with cotangent 0; ``normalizer`` (a Python number or ``None``) and ``rule`` are
    static."""
    clip_value = jax.numpy.asarray(clip_value, inputs.dtype)
    return _identity(inputs, clip_value, normalizer, rule)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _identity(x, clip_value, normalizer, rule):
    return x


def _forward(x, clip_value, normalizer, rule):
    return x, clip_value


def _backward(normalizer, rule, clip_value, g):
    return rule(g, clip_value, normalizer), jax.numpy.zeros_like(clip_value)


_identity.defvjp(_forward, _backward)
