r"""Training under ``tf.distribute``: what a private step does when its batch is split.

Under a strategy with ``R`` replicas in sync (``MirroredStrategy`` over devices,
``MultiWorkerMirroredStrategy`` over processes), Keras runs the training step once per
replica on that replica's part of the batch. A private step then does, on each replica
``r`` with local rows ``B_r`` (``B = sum_r B_r`` the global batch):

1. the local gradient ``g_r = grad sum_{i in B_r} loss_i / n`` with ``n`` the *global*
   loss normaliser (``b``, or ``q N`` under Poisson sampling) -- not the local rows, not
   Keras' ``1 / R`` loss scaling -- so that ``sum_r g_r`` is exactly the single-device
   averaged gradient ``grad sum_{i in B} loss_i / n``, whose sensitivity
   :mod:`lipdp.clipless.bounds` computes (``bound / n``: one example lives on one replica);
2. the noise, drawn once per global step by the replica whose ``replica_id_in_sync_group``
   is 0 and by no other (:func:`draws_noise`): ``g_0 + Z``, ``Z ~ N(0, s^2 I)``;
3. the sum over replicas (:func:`sum_over_replicas`, an all-reduce), which every replica
   receives identically: ``sum_r g_r + Z`` -- the released gradient, with exactly the
   noise of one single-device step (no other term carries randomness). Adding noise on
   every replica instead would give ``sqrt(R) s``; scaling it by ``1 / sqrt(R)`` would
   need the replicas' streams to be independent (they are, by construction of
   ``tf.random.Generator`` under a strategy, but one draw needs no such argument);
4. the optimizer update of that identical sum, without a second aggregation
   (:func:`release`, :func:`apply_released`; Keras 3's optimizers always sum the
   replicas' gradients themselves: replica 0 hands them the sum, the others zeros), then
   the step counter and the projections once, in cross-replica context
   (:func:`once_per_step`): every copy of a weight receives the same deterministic
   projection of the same value.

Keras 3 (3.15) needs three more adjustments, none of them touching what is released:
the model is built from one replica's element spec rather than from a batch drawn and
averaged over the replicas (:func:`lipdp.foundation.compat.first_replica_spec`: parts of
unequal rows failed there), the step's logs are read once in cross-replica context
(:func:`logs_across_replicas`) and, on several workers, as vectors of one value
(:func:`reducible_logs`).

Data. A record must sit on at most one replica per step, or its contribution counts
twice. One process (``MirroredStrategy``): Keras splits each global batch of the one
pipeline between the replicas -- a fixed batch of ``b`` into ``b / R`` rows each
(:func:`check_replica_batches` refuses a ``b`` not divisible by ``R``), a Poisson batch
into nearly equal parts. Several processes: each builds its own pipeline, whose
shuffles and Poisson draws differ, so a record could appear on two workers in the same
step; lipdp refuses that unless the data come from
:func:`lipdp.data.sampling.distributed_poisson_batches`, which partitions the records
between the replicas and Poisson-samples each part: since Poisson sampling keeps every
record independently with probability ``q``, the union of independent Poisson samples
of the parts *is* a Poisson sample of the whole data set with rate ``q`` -- the
mechanism the accountant analyses.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from lipdp.foundation import compat


def replica_context():
    """The current replica context, or ``None`` in a cross-replica context (code called
    inside ``strategy.scope()`` but outside ``strategy.run``)."""
    return tf.distribute.get_replica_context()


def replicas_in_sync() -> int:
    """``R``: the replicas whose gradients are summed into one step (1 without a strategy)."""
    return int(tf.distribute.get_strategy().num_replicas_in_sync)


def on_first_replica() -> bool:
    """Whether the code being traced runs on the replica of id 0 in its sync group (always
    true without a strategy, or in a cross-replica context). Python, evaluated when the
    step is traced."""
    context = replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return True
    replica_id = tf.get_static_value(context.replica_id_in_sync_group)
    if replica_id is None:
        raise NotImplementedError(
            f"{type(tf.distribute.get_strategy()).__name__} gives the replicas no static id, "
            "so the noise cannot be drawn once per step: train with MirroredStrategy or "
            "MultiWorkerMirroredStrategy."
        )
    return int(replica_id) == 0


def draws_noise() -> bool:
    """Whether the code being traced runs on the replica that draws the step's noise: the
    replica of id 0 (:func:`on_first_replica`)."""
    return on_first_replica()


def sum_over_replicas(tensors) -> list:
    """``sum_r t_r`` for every tensor, received identically by every replica (identity
    with one replica)."""
    tensors = list(tensors)
    context = replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tensors
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)


def release(optimizer, noisy, penalty, variables) -> list:
    """Apply the step's update and return the released gradients, ``sum_r noisy_r +
    penalty`` (identical on every replica): ``noisy`` the local noisy gradients (the noise
    on one replica only, :func:`draws_noise`), ``penalty`` the gradients of the weight
    penalties (public, added once) or ``None``. The optimizer sees nothing but the
    released gradients (:func:`apply_released`)."""
    released = sum_over_replicas(noisy)
    if penalty is not None:
        released = [r + p for r, p in zip(released, penalty)]
    apply_released(optimizer, released, variables)
    return released


def apply_released(optimizer, released, variables) -> None:
    """One update by ``released`` (the sum over replicas, identical on every replica), not
    aggregated again.

    Keras 2's optimizers apply gradients already summed when told not to aggregate them.
    Keras 3's always sum the replicas' gradients themselves (an all-reduce in
    ``apply_gradients``), after processing each replica's own gradients (``clipnorm``,
    ``clipvalue``, ``global_clipnorm``, gradient accumulation, a loss-scale check). So the
    replica of id 0 hands it ``released`` and every other replica zeros: the sum is
    ``released + 0 + ... + 0 = released`` exactly, and what each replica's processing sees
    -- ``released`` or 0 -- is a function of the release, never of one replica's
    noise-free gradient (clipping ``g_1`` alone before the sum would not be
    post-processing). The price: a second all-reduce per step, of zeros and one copy.
    """
    if not compat.keras_3():
        pairs = list(zip(released, variables))
        if isinstance(optimizer, keras.optimizers.legacy.Optimizer):
            optimizer.apply_gradients(pairs, experimental_aggregate_gradients=False)
        else:
            optimizer.apply_gradients(pairs, skip_gradients_aggregation=True)
        return
    if not on_first_replica():
        released = [tf.zeros_like(r) for r in released]
    optimizer.apply_gradients(list(zip(released, variables)))


def once_per_step(fn) -> None:
    """Run ``fn()`` once per global step in cross-replica context, where assigning a
    mirrored variable writes every copy (a plain call without a strategy)."""
    context = replica_context()
    if context is None:
        fn()
        return
    context.merge_call(lambda _strategy: fn())


def worker_count(strategy=None) -> int:
    """Processes (workers) training in sync under ``strategy`` (default: the current one)."""
    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec()
    jobs = spec.jobs if spec is not None else []
    return sum(spec.num_tasks(job) for job in jobs if job in ("chief", "worker")) or 1


def logs_across_replicas(logs: dict, read) -> dict:
    """A training step's ``logs`` on Keras 3 under a strategy: ``read()`` (every metric's
    result by name) once, in cross-replica context, for the keys of ``logs``; ``logs``
    unchanged elsewhere.

    Why: Keras 3's metrics are synchronised on read. Read in the step, each replica sees
    its own part and Keras averages the replicas' values: the loss is then the mean of the
    replicas' means (parts of unequal rows weigh alike) and a count of neutralised rows is
    divided by ``R``. Read in cross-replica context, every metric sums its replicas'
    totals first: the values of one device on the whole batch (as Keras 2 logs them).
    """
    context = replica_context()
    if not compat.keras_3() or context is None or context.num_replicas_in_sync == 1:
        return logs
    results = context.merge_call(lambda _strategy: read())
    return {key: results[key] for key in logs}


def reducible_logs(logs: dict) -> dict:
    """A training step's ``logs``, each scalar made a vector of one value on Keras 3 under
    a strategy over several workers (unchanged elsewhere).

    Why: Keras 3 (3.15) reduces a step's logs over the workers by
    ``strategy.reduce("MEAN", value, axis=0)``, which fails on a scalar ("Invalid reduction
    dimension 0 for input with 0 dimensions", also for plain Keras models:
    tensorflow/tensorflow#72388). A vector of one value is reduced to the scalar mean.
    """
    strategy = tf.distribute.get_strategy()
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    if not (compat.keras_3() and multi_worker and worker_count(strategy) > 1):
        return logs
    return {
        key: tf.reshape(value, [-1]) if value.shape.rank == 0 else value
        for key, value in logs.items()
    }


# ------------------------------------------------ one record on one replica, every path
def parts_between_replicas(function, strategy):
    """Keras 3's compiled train function made to hand each replica its own rows.

    Why: Keras 3 (3.15) gives ``strategy.run`` whatever its iterator yields. ``fit``
    iterates a distributed dataset (each replica receives its part of the global batch),
    but ``train_on_batch`` iterates a Python generator of the whole batch, and so does a
    custom loop that calls ``model.train_function`` on arrays or on a plain ``tf.data``
    iterator: every replica then receives *every* row, and the sum over replicas counts
    each record ``R`` times (remove-one ratio 2.0 with two replicas) while the noise is
    that of one step. Here every element that is not already distributed is split into
    ``R`` parts of nearly equal rows (:func:`split_between_replicas`), the split ``fit``
    makes; a distributed iterator (``fit``'s) is passed on. Several workers each hold
    their own arrays, which may hold the same record: refused there (use ``fit`` with
    :func:`lipdp.data.sampling.distributed_poisson_batches`). Keras 2's ``train_on_batch``
    distributes its batch itself: ``function`` is returned unchanged, as with one replica.
    """
    if not compat.keras_3() or strategy.num_replicas_in_sync == 1:
        return function
    if getattr(function, "lipdp_splits_batches", False):
        return function

    def train_function(iterator):
        if isinstance(iterator, tf.distribute.DistributedIterator):
            return function(iterator)
        if worker_count(strategy) > 1:
            raise ValueError(
                "train_on_batch (or a train function called on undistributed data) on several "
                "workers: each worker's batch may hold the records of another's. Train with "
                "fit(lipdp.pipeline.distributed_poisson_batches(strategy, x, y, ...))."
            )
        return function(split_between_replicas(strategy, data) for data in iterator)

    train_function.lipdp_splits_batches = True
    return train_function


def check_steps_per_execution(strategy, steps_per_execution) -> None:
    """Keras 3 (3.15) cannot run ``steps_per_execution > 1`` under a strategy of several
    replicas (its loop over steps fails with "You must feed a value for placeholder
    tensor", plain Keras models too): refused before anything runs, with the fix."""
    if compat.keras_3() and strategy.num_replicas_in_sync > 1 and (steps_per_execution or 1) > 1:
        raise ValueError(
            f"compile(steps_per_execution={steps_per_execution}) does not run under a "
            f"distribution strategy of {strategy.num_replicas_in_sync} replicas on Keras 3 "
            "(Keras' loop over steps fails there, plain models too): compile with "
            "steps_per_execution=1."
        )


def split_between_replicas(strategy, data):
    """``data`` (a batch: ``(x, y)``, ``(x, y, sample_weight)`` or ``x``, arrays or tensors
    whose first axis is the rows) as distributed values: replica ``r`` receives rows
    ``[start_r, end_r)`` of ``R`` nearly equal consecutive parts (sizes differ by one at
    most; a part may be empty). Already distributed values are returned as they are."""
    if isinstance(data, tf.distribute.DistributedValues):
        return data
    if isinstance(data, tuple):  # Keras' (x, y, None): a trailing None is no value
        while len(data) > 1 and data[-1] is None:
            data = data[:-1]
    leaves = [leaf for leaf in tf.nest.flatten(data) if leaf is not None]
    if any(isinstance(leaf, tf.distribute.DistributedValues) for leaf in leaves):
        return data
    rows = int(leaves[0].shape[0]) if leaves else 0
    sizes = [len(part) for part in np.array_split(np.arange(rows), strategy.num_replicas_in_sync)]
    bounds = np.concatenate([[0], np.cumsum(sizes)])

    def part(context):
        replica = context.replica_id_in_sync_group
        start, end = int(bounds[replica]), int(bounds[replica + 1])
        return tf.nest.map_structure(
            lambda leaf: None if leaf is None else tf.convert_to_tensor(leaf[start:end]), data
        )

    return strategy.experimental_distribute_values_from_function(part)


def duplicate_part_weight(batch):
    """``0.`` on a replica whose part of the step holds exactly the rows of a replica of
    lower id, ``1.`` elsewhere (``None`` without several replicas): what multiplies the
    replica's local gradient before the sum.

    Why: the last line of defence of "each record counts once" (rule S12) for a path that
    hands every replica the same batch -- a custom loop calling ``strategy.run(
    model.train_step, args=(batch,))`` on an undistributed batch, as Keras 3's own
    ``train_on_batch`` does (:func:`parts_between_replicas` fixes the paths lipdp owns).
    Each replica reduces its part (inputs and labels, non-finite values read as 0) to four
    numbers: its rows and three sums of a fixed projection of each row (plain, squared,
    weighted by position). Equal parts give equal numbers on every device; the numbers of
    the ``R`` replicas are shared by one all-reduce of ``R x 4`` floats. A replica whose
    numbers equal those of a lower replica drops its contribution, so a batch given whole
    to every replica releases exactly the single-device sum. Two different parts with
    equal numbers (not a coincidence that occurs outside a constructed example) would
    drop one part's rows: fewer rows released, never a record counted twice. Works under
    XLA (no assertion: arithmetic only)."""
    context = replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    replicas = context.num_replicas_in_sync
    prints = _row_prints(batch)
    if prints is None:
        return None
    positions = tf.cast(tf.range(tf.shape(prints)[0]) + 1, tf.float64)
    mine = tf.stack(
        [
            tf.cast(tf.shape(prints)[0], tf.float64),
            tf.reduce_sum(prints),
            tf.reduce_sum(tf.square(prints)),
            tf.reduce_sum(prints * positions),
        ]
    )
    replica = context.replica_id_in_sync_group
    slot = tf.one_hot(replica, replicas, dtype=tf.float64)
    table = context.all_reduce(tf.distribute.ReduceOp.SUM, slot[:, None] * mine[None])
    same = tf.reduce_all(tf.equal(table, mine[None]), axis=1)
    lower = tf.range(replicas) < tf.cast(replica, tf.int32)
    return tf.where(tf.reduce_any(same & lower), 0.0, 1.0)


def _row_prints(batch):
    """``(rows,)`` float64: each row's dense inputs and labels projected on a fixed
    pattern (non-finite values as 0), or ``None`` when no leaf is a dense tensor."""
    prints = None
    for leaf in tf.nest.flatten(batch):
        if not isinstance(leaf, tf.Tensor) or leaf.shape.rank is None or leaf.shape.rank == 0:
            continue
        if not (leaf.dtype.is_floating or leaf.dtype.is_integer or leaf.dtype.is_bool):
            continue
        values = tf.reshape(tf.cast(leaf, tf.float64), tf.stack([tf.shape(leaf)[0], -1]))
        values = tf.where(tf.math.is_finite(values), values, tf.zeros((), values.dtype))
        columns = tf.cast(tf.range(tf.shape(values)[1]) + 1, tf.float64)
        pattern = 1.5 + tf.sin(0.618034 * columns)
        projected = tf.linalg.matvec(values, pattern)
        prints = projected if prints is None else prints + projected
    return prints


def weighted(gradients, weight) -> list:
    """``gradients`` times the scalar ``weight`` (``None``: unchanged), ``IndexedSlices``
    kept sparse."""
    if weight is None:
        return list(gradients)
    weight = tf.cast(weight, tf.float32)

    def scale(g):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(
                g.values * tf.cast(weight, g.values.dtype), g.indices, g.dense_shape
            )
        return g * tf.cast(weight, g.dtype)

    return [scale(g) for g in gradients]


_MIRRORED = {}


def mirrored_strategy(devices) -> tf.distribute.MirroredStrategy:
    """One ``MirroredStrategy`` per set of ``devices`` in this process, reused.

    Why: TensorFlow 2.15 numbers the collective all-reduces of each new
    ``MirroredStrategy`` from the same key, so a second strategy over the same devices in
    one process fails on its first step with "Shape mismatch in the collective instance"
    when its model differs (plain Keras models too). Reusing the strategy avoids it.
    """
    key = tuple(devices)
    if key not in _MIRRORED:
        _MIRRORED[key] = tf.distribute.MirroredStrategy(list(key))
    return _MIRRORED[key]


def check_replica_batches(rows_per_batch) -> None:
    """A fixed batch of ``rows_per_batch`` rows must split evenly between the replicas:
    every replica then checks that it holds ``rows_per_batch / R`` (rule S5)."""
    replicas = replicas_in_sync()
    if rows_per_batch % replicas:
        raise ValueError(
            f"The batch of {rows_per_batch} rows does not split evenly between {replicas} "
            f"replicas: choose a batch size divisible by {replicas}."
        )


__all__ = [
    "apply_released",
    "check_steps_per_execution",
    "duplicate_part_weight",
    "parts_between_replicas",
    "split_between_replicas",
    "weighted",
    "check_replica_batches",
    "draws_noise",
    "logs_across_replicas",
    "mirrored_strategy",
    "on_first_replica",
    "once_per_step",
    "reducible_logs",
    "release",
    "replica_context",
    "replicas_in_sync",
    "sum_over_replicas",
    "worker_count",
]
