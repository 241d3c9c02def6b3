"""How training batches are drawn
(the ``sampling`` of :class:`~lipdp.foundation.metadata.DatasetMetadata`).

* ``"poisson"``: :func:`poisson_batches`, every example enters each batch independently
  with probability ``q``: exactly the mechanism the accountant analyses.
* ``"shuffle"``: the image and tabular pipelines draw batches from a uniform shuffle of
  the *whole* training set every epoch (a permutation of the example indices; the
  shuffle buffer holds all ``N`` indices); batches have exactly ``batch_size``
  examples when ``drop_remainder=True``. Test sets are read in order.

A fixed ``seed`` makes runs reproducible; privacy amplification by subsampling assumes
the sampling randomness is unknown to the adversary, so publish no seed you train with.
"""

from __future__ import annotations

import math
import secrets

import numpy as np
import tensorflow as tf

from lipdp.foundation.validation import count, probability


def poisson_batches(x, y, sampling_rate, steps_per_epoch, seed=None) -> tf.data.Dataset:
    """Batches drawn by Poisson sampling: each example enters each batch independently
    with probability ``sampling_rate``, fresh randomness every step and every epoch.

    This is the sampling the accountant analyses (amplification by subsampling with
    rate ``q``); use it with ``DatasetMetadata(sampling="poisson")``. Batch sizes are
    random (possibly 0); the model divides the summed loss by the expected size.

    The dataset carries its rate and steps (``lipdp_sampling_rate``,
    ``lipdp_steps_per_epoch``): ``fit`` refuses it if they differ from the model's
    metadata (keep the dataset returned here; ``map``/``prefetch`` return new datasets
    without them). ``seed=None`` draws the seed from the operating system, not from
    TensorFlow's global seed: amplification by subsampling assumes nobody can
    reproduce which examples were sampled (rule S8). For a model of several inputs ``x``
    is a dict or a tuple of arrays, one per input, with the same number of examples.
    """
    sampling_rate = probability("sampling_rate", sampling_rate)
    steps = count("steps_per_epoch", steps_per_epoch, minimum=1)
    batches = _poisson_stream(x, y, sampling_rate, seed).take(steps)
    return stating_rate(batches, sampling_rate, steps)


def _poisson_stream(x, y, sampling_rate, seed=None) -> tf.data.Dataset:
    """An endless sequence of Poisson batches of ``(x, y)`` (fresh randomness each; ``x``
    may hold one array per input of a model of several inputs: :func:`_inputs`)."""
    x = _inputs(x)
    y = tf.convert_to_tensor(y)
    first, *others = tf.nest.flatten(x)
    n = int(first.shape[0])
    for name, t in [*(("another input of x", t) for t in others), ("y", y)]:
        if int(t.shape[0]) != n:
            raise ValueError(f"x has {n} examples but {name} has {int(t.shape[0])}.")

    def draw(step_seed):
        indices = poisson_indices(n, sampling_rate, step_seed)
        return tf.nest.map_structure(lambda t: tf.gather(t, indices), x), tf.gather(y, indices)

    return _step_seeds(seed).map(draw)


def _inputs(x):
    """``x`` as a tensor; for a model of several inputs, a dict or a tuple of arrays (one
    per input: Keras matches them to the model's inputs) as a dict or tuple of tensors. A
    list is one array, as ``tf.convert_to_tensor`` reads it."""
    if isinstance(x, dict):
        return {key: tf.convert_to_tensor(value) for key, value in x.items()}
    if isinstance(x, tuple) and x and all(isinstance(v, np.ndarray) or tf.is_tensor(v) for v in x):
        return tuple(tf.convert_to_tensor(value) for value in x)
    return tf.convert_to_tensor(x)


def distributed_poisson_batches(strategy, x, y, sampling_rate, steps_per_epoch):
    """Poisson batches for training under ``strategy`` (several devices or workers): a
    ``tf.distribute.DistributedDataset`` for ``fit``.

    The records are partitioned between the ``R`` replicas (record ``i`` to part
    ``i mod R``, a rule that does not look at the data) and every replica draws each step
    a Poisson sample of its part with rate ``q`` (:func:`poisson_batches`, its own seed
    from the operating system). Why this is the mechanism the accountant analyses: a
    Poisson sample keeps every record independently with probability ``q``, so its
    restrictions to the parts are independent Poisson samples of the parts, and
    conversely the union of independent Poisson samples of the parts is a Poisson sample
    of the whole data set -- one global draw per step, sharded. A record lives on one
    replica, so it enters at most one replica's batch in a step (:mod:`lipdp.core.distribute`).

    Every worker calls this with the same ``x`` and ``y`` (it keeps its own replicas'
    parts only). The batches never run out (Keras keeps one iterator of a distributed
    dataset across epochs): ``fit`` runs ``steps_per_epoch`` of them per epoch, the number
    the dataset states.
    """
    sampling_rate = probability("sampling_rate", sampling_rate)
    steps = count("steps_per_epoch", steps_per_epoch, minimum=1)
    x, y = np.asarray(x), np.asarray(y)
    if len(x) != len(y):
        raise ValueError(f"x has {len(x)} examples but y has {len(y)}.")
    replicas = int(strategy.num_replicas_in_sync)

    def worker_dataset(input_context):
        local = replicas // input_context.num_input_pipelines
        parts = range(
            input_context.input_pipeline_id * local, (input_context.input_pipeline_id + 1) * local
        )
        batches = [
            _poisson_stream(x[part::replicas], y[part::replicas], sampling_rate) for part in parts
        ]
        # The worker's replicas receive its dataset's elements in turn, one per replica
        # and step: part after part.
        order = tf.data.Dataset.range(local).repeat()
        return tf.data.Dataset.choose_from_datasets(batches, order)

    dataset = strategy.distribute_datasets_from_function(worker_dataset)
    dataset.lipdp_partitioned = True  # fit accepts it on several workers
    return stating_rate(dataset, sampling_rate, steps)


def poisson_indices(n, sampling_rate, seed) -> tf.Tensor:
    """The indices kept when each of ``range(n)`` is kept independently with probability
    ``sampling_rate`` (a Poisson subsample), in O(expected size) rather than O(n).

    Exact, not an approximation: in a sequence of independent Bernoulli(``q``) trials the
    gaps between consecutive successes are i.i.d. Geometric(``q``) (``P(G = g) =
    (1 - q)^(g-1) q``, ``g >= 1``), and ``G = floor(log(V) / log(1 - q)) + 1`` with ``V``
    uniform on ``(0, 1]`` has that law, since ``P(G > g) = P(V <= (1 - q)^g) = (1 - q)^g``.
    Gaps are drawn in chunks of about the expected size plus six standard deviations
    (float64), their cumulative sums are the kept indices, and a further chunk is drawn
    only while the last index is still below ``n``. ``seed``: an int64 scalar (stateless).
    """
    n = int(n)
    if sampling_rate >= 1.0:
        return tf.range(n, dtype=tf.int64)
    expected = sampling_rate * n
    chunk = int(expected + 6.0 * math.sqrt(expected * (1.0 - sampling_rate)) + 16)
    log_keep = math.log1p(-sampling_rate)
    seed = tf.cast(seed, tf.int64)

    def gaps(round_index):
        u = tf.random.stateless_uniform(
            [chunk], seed=tf.stack([seed, round_index]), dtype=tf.float64
        )
        return tf.cast(tf.floor(tf.math.log1p(-u) / log_keep), tf.int64) + 1  # 1 - u in (0, 1]

    def more(round_index, positions):
        step = tf.cumsum(gaps(round_index)) + positions[-1]
        return round_index + 1, tf.concat([positions, step], axis=0)

    first = tf.cumsum(gaps(tf.constant(1, tf.int64))) - 1  # first kept index: G_1 - 1
    _, positions = tf.while_loop(
        lambda _, p: p[-1] < n,
        more,
        (tf.constant(2, tf.int64), first),
        shape_invariants=(tf.TensorShape([]), tf.TensorShape([None])),
    )
    return tf.boolean_mask(positions, positions < n)


def _step_seeds(seed) -> tf.data.Dataset:
    """One int64 seed per step, fresh every epoch; ``seed=None``: from the OS (S8)."""
    if seed is None:
        seed = secrets.randbits(62)
    # Dataset.random re-draws its seeds at every iteration (every epoch).
    return tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)


def stating_rate(dataset, sampling_rate, steps_per_epoch):
    """``dataset`` with the Poisson rate and steps it was drawn with, which ``fit`` checks
    against the model's metadata (attributes: lost by ``map``/``prefetch``, so set last)."""
    dataset.lipdp_sampling_rate = float(sampling_rate)
    dataset.lipdp_steps_per_epoch = int(steps_per_epoch)
    return dataset


def _poisson_index_batches(n, sampling_rate, steps, seed, make_batch) -> tf.data.Dataset:
    """Poisson batches of ``range(n)`` (each index kept with probability ``sampling_rate``,
    fresh every step), mapped by ``make_batch(indices, random_seed)``: the pipelines'
    ``sampling="poisson"``."""

    def draw(step_seed):
        return make_batch(poisson_indices(n, sampling_rate, step_seed), step_seed)

    return _step_seeds(seed).take(steps).map(draw, num_parallel_calls=tf.data.AUTOTUNE)


# ------------------------------------------- fixed-size batches (used by the pipelines)
def _check_batch_size(batch_size, n) -> int:
    """``batch_size`` as an int in ``[1, n]``: a batch cannot hold more than the data."""
    batch_size = count("batch_size", batch_size, minimum=1)
    if batch_size > n:
        raise ValueError(f"batch_size ({batch_size}) is larger than the training set ({n}).")
    return batch_size


def _partial_last_batch(n, batch_size, drop_remainder) -> bool:
    """Whether the last training batch of an epoch has fewer than ``batch_size`` examples."""
    return (not drop_remainder) and n % batch_size != 0


def _one_hot(labels, nb_classes) -> np.ndarray:
    """Class indices -> one-hot float32 rows, the label format of both pipelines."""
    return np.eye(nb_classes, dtype="float32")[np.asarray(labels, dtype="int64")]


def _shuffled_batches(n, batch_size, drop_remainder, seed, make_batch) -> tf.data.Dataset:
    """Batches of a fresh uniform permutation of ``range(n)`` every epoch, mapped by
    ``make_batch(indices, random_seed)`` (a per-batch int64 seed, fresh every epoch)."""
    indices = tf.data.Dataset.range(n).shuffle(n, seed=seed, reshuffle_each_iteration=True)
    indices = indices.batch(batch_size, drop_remainder=drop_remainder)
    # seed + 1: the per-batch seeds get a seed of their own, not the shuffle's.
    seeds = tf.data.Dataset.random(
        seed=None if seed is None else seed + 1, rerandomize_each_iteration=True
    )
    batches = tf.data.Dataset.zip((indices, seeds))
    return batches.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _training_batches(metadata, drop_remainder, seed, make_batch) -> tf.data.Dataset:
    """The training batches of a pipeline, as ``metadata.sampling`` says: Poisson batches
    (stating their rate) or fixed-size batches of a fresh shuffle every epoch."""
    n, batch_size = metadata.nb_samples_train, metadata.batch_size
    if metadata.sampling == "poisson":
        rate, steps = metadata.sampling_rate, metadata.nb_steps_per_epochs
        batches = _poisson_index_batches(n, rate, steps, seed, make_batch)
        return stating_rate(batches.prefetch(tf.data.AUTOTUNE), rate, steps)
    batches = _shuffled_batches(n, batch_size, drop_remainder, seed, make_batch)
    return batches.prefetch(tf.data.AUTOTUNE)


def _ordered_batches(n, batch_size, make_batch) -> tf.data.Dataset:
    """Batches of ``range(n)`` in order (the last one may be partial): test sets."""
    indices = tf.data.Dataset.range(n).batch(batch_size)
    return indices.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


__all__ = ["distributed_poisson_batches", "poisson_batches", "poisson_indices"]
