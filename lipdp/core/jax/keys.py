r"""Where the JAX step's noise comes from (rule S8).

The step draws its Gaussian noise from a threefry key held in a model variable (two
``uint32`` words, :data:`KEY_WORDS`), so that the key changes at every step under ``jit``:
step ``t`` splits its key ``k_t`` into ``(k_{t+1}, d_t)`` and draws the noise from ``d_t``
only (:func:`next_key_and_draw`).

* **Secure noise (default)**: the key is set from the operating system's entropy
  (``os.urandom``) before every ``fit``/``train_on_batch``, independently of
  ``keras.utils.set_random_seed`` and of JAX's or numpy's seeds: someone who knows the seeds
  a user trains with cannot regenerate the noise. A key written to a ``.keras`` file is
  zeroed (:mod:`lipdp.core.jax.trainer`), and a reloaded model draws a fresh key anyway.
* **Reproducible noise (debugging only)**: after
  ``lipdp.core.noise.use_reproducible_noise(seed)`` -- the switch of the TensorFlow
  models -- the key is derived from the SHA-256 digest of ``seed``
  (:func:`lipdp.core.noise.seed_words`) when the model first trains under that seed, and
  then evolves step by step; the privacy ledger flags the steps ``REPRODUCIBLE`` and the
  privacy report says so.

Why a split and not ``fold_in(key, step)``: the key written back after a step reveals
nothing about the draws of earlier steps (recovering ``k_t`` from ``k_{t+1}`` means
inverting threefry), and the step count is public.
"""

from __future__ import annotations

import os

import numpy as np

from lipdp.core import noise

#: A raw threefry2x32 key: two uint32 words.
KEY_WORDS = 2
#: The PRNG implementation, named explicitly: the key does not depend on JAX's
#: ``jax_default_prng_impl`` setting.
IMPL = "threefry2x32"


def entropy_key() -> np.ndarray:
    """A key from the operating system's entropy (``os.urandom``)."""
    return np.frombuffer(os.urandom(4 * KEY_WORDS), dtype=np.uint32).copy()


def seeded_key(seed: int) -> np.ndarray:
    """The key of reproducible noise for ``seed``: the low and high words of the first
    64-bit word of the seed's SHA-256 digest (:func:`lipdp.core.noise.seed_words`)."""
    word = noise.seed_words(seed)[0] & 0xFFFFFFFFFFFFFFFF
    return np.array([word & 0xFFFFFFFF, word >> 32], dtype=np.uint32)


def next_key_and_draw(key_words):
    """``(k_{t+1} as words, d_t)``: the key the next step starts from and the typed key
    this step draws its noise from (in-graph)."""
    import jax

    key = jax.random.wrap_key_data(key_words, impl=IMPL)
    following, draw = jax.random.split(key)
    return jax.random.key_data(following), draw


def gaussian_like(draw, arrays, stddev) -> list:
    """Independent ``N(0, stddev^2)`` noise shaped like each array of ``arrays`` (float32):
    one draw of their total size, cut into their shapes (one random-number program to
    compile, whatever the number of variables). ``stddev``: one number for every array
    (``"global"`` noise), or one per array (``"per-layer"``: array ``v`` gets
    ``stddev[v]`` times its piece of the standard normal draw)."""
    import jax
    import jax.numpy as jnp

    sizes = [int(np.prod(a.shape)) for a in arrays]
    per_array = isinstance(stddev, (list, tuple))
    if per_array and len(stddev) != len(arrays):
        raise ValueError(f"{len(stddev)} standard deviations for {len(arrays)} arrays.")
    flat = jax.random.normal(draw, (sum(sizes),), dtype="float32")
    if not per_array:
        flat = stddev * flat
    pieces = jnp.split(flat, np.cumsum(sizes)[:-1].tolist()) if len(sizes) > 1 else [flat]
    if per_array:
        pieces = [s * p for s, p in zip(stddev, pieces)]
    return [jnp.reshape(p, a.shape) for p, a in zip(pieces, arrays)]


__all__ = ["IMPL", "KEY_WORDS", "entropy_key", "gaussian_like", "next_key_and_draw", "seeded_key"]
