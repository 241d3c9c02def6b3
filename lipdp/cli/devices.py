"""``--mirrored R``: the ``tf.distribute`` strategy the run is built and trained under.

Splitting the CPU into logical devices changes TensorFlow's state for the whole process
(and is possible only before TensorFlow starts its devices): a decision for the program's
entry point, not for a recipe, which takes the strategy it is given
(:func:`lipdp.recipes.runs.prepare`).
"""

from __future__ import annotations

import os


def distribution_strategy(replicas):
    """``None``: TensorFlow's default (one device). ``R``: ``MirroredStrategy`` over the
    first ``R`` GPUs, or over ``R`` logical devices the CPU is split into (possible only
    before TensorFlow has started its devices)."""
    import tensorflow as tf

    from lipdp.core.distribute import mirrored_strategy

    if replicas is None:
        return tf.distribute.get_strategy()
    gpus = len(tf.config.list_physical_devices("GPU"))
    if gpus >= replicas:
        devices = [d.name for d in tf.config.list_logical_devices("GPU")[:replicas]]
        return mirrored_strategy(devices)
    _refuse_more_replicas_than_cores(replicas, gpus)
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    except RuntimeError:  # devices already started: use the split already made, if any
        pass
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < replicas:
        raise ValueError(
            f"--mirrored {replicas}: only {len(devices)} device(s) available (TensorFlow had "
            "started its devices before they could be split); run lipdp in a new process."
        )
    return mirrored_strategy(devices[:replicas])


def usable_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _refuse_more_replicas_than_cores(replicas, gpus) -> None:
    """TensorFlow splits the CPU into as many logical devices as asked, but they share its
    cores: replicas beyond the cores add copies of the step to trace and all-reduces to
    wait for, with no parallelism (on 2 cores one epoch of the demo took 15 s with 3
    replicas, 80 s with 16; 99 replicas spend minutes before the first step). Refused."""
    cores = usable_cpu_cores()
    if replicas <= cores:
        return
    most = max(gpus, cores)
    fix = {0: "drop --mirrored", 1: "drop --mirrored", 2: "use --mirrored 2"}.get(
        most, f"use --mirrored R with R <= {most}"
    )
    raise ValueError(
        f"--mirrored {replicas}: this machine gives at most {most} device(s) ({gpus} GPU(s), "
        f"{cores} CPU core(s); more logical CPU devices than cores only slow training "
        f"down): {fix}."
    )
