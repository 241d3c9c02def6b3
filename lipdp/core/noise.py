r"""The noise rule: how much Gaussian noise each variable's averaged gradient receives.

With ``Delta_v`` the sensitivity of the averaged gradient of variable ``v``
(:meth:`lipdp.clipless.bounds.Bounds.sensitivities`), ``sigma`` the noise multiplier and ``c_v`` the
``nm_coef`` of the layer that owns ``v``:

* ``"global"``: one Gaussian mechanism on the whole gradient, whose L2 sensitivity is
  ``sqrt(sum_v Delta_v^2)``: every coordinate gets standard deviation
  ``sigma * sqrt(sum_v Delta_v^2)``; the accountant sees one mechanism of multiplier
  ``sigma``.
* ``"per-layer"``: one Gaussian mechanism per variable, standard deviation
  ``sigma * c_v * Delta_v``; the accountant sees multipliers ``sigma * c_v``, which
  compose into one Gaussian of ``sigma_eff = (sum_v (sigma c_v)^-2)^(-1/2)``.

:func:`noise_stddevs` and :func:`noise_multipliers` are the only places these numbers are
computed: the model's training step, the diagnostics and the privacy report read them.

**Where the noise comes from (rule S8).** :func:`add_noise` draws from one
``tf.random.Generator`` seeded from operating-system entropy
(``Generator.from_non_deterministic_state``), independent of ``tf.random.set_seed`` and
``keras.utils.set_random_seed``: someone who knows the seeds a user trains with cannot
regenerate the noise and subtract it. Its state is never saved with a model (a saved
counter-based state would let a reader regenerate past noise). For debugging only,
:func:`use_reproducible_noise` seeds it explicitly; the privacy report then says the noise
is reproducible. The seed is hashed (SHA-256) into the generator's Philox key and counter
(:func:`seeded_generator`), so that different seeds give unrelated streams:
``Generator.from_seed(s)`` puts ``s`` in the counter, and the normal samples of seed
``s + 1`` are those of seed ``s`` without the first four. Switch modes before ``compile``
(a traced training step keeps the generator it was traced with). Caveat: like most DP
libraries the Gaussian samples are floating-point numbers, whose low-order bits can leak
information in theory (Mironov, CCS 2012); no snapping or discrete Gaussian is applied.

TensorFlow is imported when a standard deviation or a draw is computed, not with this
module: the JAX backend (:mod:`lipdp.core.jax.keys`) reads the same switch
(:func:`use_reproducible_noise`, :func:`seed_words`) without it.

**Under tf.distribute** (:mod:`lipdp.core.distribute`) the noise of a step is drawn once, by
the replica of id 0, before the replicas' gradients are summed: the released sum carries
exactly ``N(0, s^2 I)``. Each strategy has its own generator, created in its scope (a
generator is tied to the strategy it was created under).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import numpy as np

from lipdp.foundation import validation

if TYPE_CHECKING:  # annotations only: TensorFlow is imported on use
    import tensorflow as tf

NOISIFY_STRATEGIES = ("global", "per-layer")

#: Relative slack added to every sensitivity (both families). The bounds are exact for
#: real arithmetic; gradients computed in float32 can exceed them by round-off (relative
#: ~1e-7 to 1e-6 was observed where a bound is tight). The slack covers it.
ROUNDOFF_SLACK = 1e-5


def noise_multipliers(strategy, sigma, nm_coefs) -> list[float]:
    """Multipliers of the Gaussian mechanisms of one step, for the accountant:
    ``[sigma]`` (``"global"``) or ``[sigma * c_v for each variable]`` (``"per-layer"``)."""
    validation.choice("noisify_strategy", strategy, NOISIFY_STRATEGIES)
    if strategy == "global":
        return [float(sigma)]
    return [float(sigma) * float(c) for c in nm_coefs]


def noise_stddevs(strategy, sigma, sensitivities, nm_coefs, *, on_host=False) -> list:
    """Standard deviation of the noise on each variable (aligned with ``sensitivities``).

    ``on_host=False`` (the TensorFlow models): float32 tensors, from Python floats or
    tensors (in-graph: ``sensitivities`` may depend on variables such as clip values); on
    Keras 3's JAX backend (the JAX step whose sensitivities depend on its state: norm-
    adaptive kernels, dynamic clip values), float32 arrays of the trace by ``keras.ops``,
    the same operations.
    ``on_host=True`` (the JAX step, whose standard deviation is a constant of the compiled
    step): Python floats (float64), without TensorFlow. The rule is the same; for one
    entry ``sqrt(Delta^2) = Delta`` exactly in IEEE arithmetic (a correctly rounded square
    root of a correctly rounded square), so ``"global"`` gives ``sigma Delta``.
    """
    validation.choice("noisify_strategy", strategy, NOISIFY_STRATEGIES)
    if not sensitivities:
        return []
    if on_host:
        cast, sqrt, add_n = float, math.sqrt, sum
    elif _keras_backend() == "jax":
        from keras import ops

        cast, sqrt, add_n = (lambda d: ops.cast(d, "float32")), ops.sqrt, sum
    else:
        import tensorflow as tf

        cast, sqrt, add_n = (lambda d: tf.cast(d, tf.float32)), tf.sqrt, tf.add_n
    deltas = [cast(d) for d in sensitivities]
    if strategy == "global":
        total = sqrt(add_n([d * d for d in deltas]))
        return [float(sigma) * total] * len(deltas)
    return [float(sigma) * float(c) * d for d, c in zip(deltas, nm_coefs)]


def _keras_backend() -> str:
    """``keras.backend.backend()`` (``"tensorflow"`` on Keras 2)."""
    import keras

    return keras.backend.backend()


_SOURCE = {"generators": {}, "seed": None}


def use_reproducible_noise(seed) -> None:
    """``seed`` (an int): every later noise draw is reproducible from it -- for debugging
    only, flagged by the privacy report. ``None``: back to operating-system entropy."""
    if seed is not None:
        seed = validation.count("seed", seed)
    _SOURCE.update(generators={}, seed=seed)


def seeded_generator(seed: int) -> tf.random.Generator:
    """A Philox generator whose key and counter are the SHA-256 digest of ``seed``.

    Philox's stream is ``philox_key(counter), philox_key(counter + 1), ...``: two
    generators share values only if their keys are equal and their counters close.
    Hashing the seed makes both unrelated for different seeds (a collision of the
    192 bits taken from the digest is as unlikely as a SHA-256 collision), whereas
    ``Generator.from_seed`` uses the seed as the counter with key 0.
    """
    import tensorflow as tf

    key, counter_low, counter_high = seed_words(seed)
    return tf.random.Generator.from_key_counter(
        key=key, counter=[counter_low, counter_high], alg="philox"
    )


def seed_words(seed: int) -> list[int]:
    """Three signed 64-bit words of the SHA-256 digest of ``seed``: the Philox key and
    counter of :func:`seeded_generator`, and the material of the JAX backend's key
    (:mod:`lipdp.core.jax.keys`)."""
    # The domain string is fixed (it was this module's path before lipdp.core existed):
    # changing it would change every reproducible stream.
    digest = hashlib.sha256(f"lipdp.noise:{seed}".encode()).digest()
    return np.frombuffer(digest[:24], dtype="<i8").tolist()


def reproducible_noise_seed():
    """The seed set by :func:`use_reproducible_noise`, or ``None`` (secure noise)."""
    return _SOURCE["seed"]


def noise_generator() -> tf.random.Generator:
    """The generator :func:`add_noise` draws from under the current distribution strategy
    (created on first use, in that strategy's scope)."""
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    # Keyed by identity; the strategy is kept with its generator so its id is not reused.
    strategy_and_generator = _SOURCE["generators"].get(id(strategy))
    if strategy_and_generator is None:
        with tf.init_scope():  # a variable: created eagerly even when called while tracing
            seed = _SOURCE["seed"]
            generator = (
                tf.random.Generator.from_non_deterministic_state()
                if seed is None
                else seeded_generator(seed)
            )
        strategy_and_generator = _SOURCE["generators"][id(strategy)] = (strategy, generator)
    return strategy_and_generator[1]


def add_noise(gradients, stddevs):
    """``g + N(0, s^2 I)`` for every gradient ``g`` and its standard deviation ``s``; under
    a strategy, on the replica that draws the step's noise only (the others return their
    gradients unchanged, so the sum over replicas carries one draw)."""
    import tensorflow as tf

    from lipdp.core import distribute

    generator = noise_generator()  # on every replica: created alike on every worker
    if not distribute.draws_noise():
        return list(gradients)
    return [
        g + generator.normal(tf.shape(g), stddev=tf.cast(s, g.dtype), dtype=g.dtype)
        for g, s in zip(gradients, stddevs)
    ]


__all__ = [
    "NOISIFY_STRATEGIES",
    "add_noise",
    "noise_generator",
    "noise_multipliers",
    "noise_stddevs",
    "reproducible_noise_seed",
    "seed_words",
    "seeded_generator",
    "use_reproducible_noise",
]
