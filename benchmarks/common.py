"""Pieces shared by the benchmarks (utility runs, the step-speed networks, the timing loop
of the component benchmarks)."""

from __future__ import annotations

import datetime
import os
import platform


def dp_sgd_epsilon(sigma, q, steps, delta):
    """Epsilon of tf-privacy's DP-SGD, computed independently of lipdp: ``dp_accounting``'s
    RDP accountant on ``steps`` Poisson-subsampled (rate ``q``) Gaussian steps."""
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(delta)


def machine_description():
    """``"N cores (cpu), Python x, TF y, date"`` for the header of a results table."""
    import tensorflow as tf

    with open("/proc/cpuinfo") as cpuinfo:
        cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if "model name" in ln), "?")
    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"TF {tf.__version__}, {datetime.date.today().isoformat()}"
    )


def plain_cnn_layers(shape=(28, 28, 1), classes=10):
    """The unconstrained ``cnn`` of ``step_speed.py`` as Keras 3 layers for any backend
    (50 080 parameters, no biases): the network of ``cross_library_speed.py`` and
    ``jax_backend_speed.py``. Keras is imported here, so that importing this module imports
    no framework."""
    import keras

    L = keras.layers
    return [
        L.InputLayer(shape=shape),
        L.Conv2D(32, 3, padding="same", use_bias=False),
        L.ReLU(),
        L.AveragePooling2D(2),
        L.Conv2D(64, 3, padding="same", use_bias=False),
        L.ReLU(),
        L.AveragePooling2D(2),
        L.Flatten(),
        L.Dense(classes, use_bias=False),
    ]


def time_forward_backward(candidates, x, w, rounds, reference):
    """CPU time of forward + backward of each candidate function on ``x``, and how far its
    output and input gradient are from those of ``candidates[reference]``.

    Each candidate ``fn`` is timed on ``sum(fn(x) * w)`` and its gradient with respect to
    ``x``, traced once as a ``tf.function``; ``rounds`` rounds round-robin (the order
    rotated each round), five calls a round, CPU seconds of the process per call.
    Returns ``{name: (median seconds, max |y - y_ref|, max |g - g_ref|)}`` in the order of
    ``candidates``. The shared loop of ``l2_pool_speed.py`` and ``groupsort_speed.py``."""
    import statistics
    import time

    import numpy as np
    import tensorflow as tf

    steps, outputs = {}, {}
    for name, fn in candidates.items():

        def step(fn=fn, x=x, w=w):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = fn(x)
                loss = tf.reduce_sum(y * w)
            return y, tape.gradient(loss, x)

        steps[name] = tf.function(step)
        outputs[name] = [t.numpy() for t in steps[name]()]
    times = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.process_time()
            for _ in range(5):
                _, g = steps[name]()
            g.numpy()
            times[name].append((time.process_time() - start) / 5)
    ref_y, ref_g = outputs[reference]
    return {
        name: (
            statistics.median(times[name]),
            float(np.abs(outputs[name][0] - ref_y).max()),
            float(np.abs(outputs[name][1] - ref_g).max()),
        )
        for name in names
    }
