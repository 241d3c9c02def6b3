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
averaged over the replicas (:func:`lipdp.core.compat.first_replica_spec`: parts of
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
import tensorflow as tf

from lipdp.core import compat


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
