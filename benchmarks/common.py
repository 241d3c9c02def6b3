"""Pieces shared by the utility benchmarks (``shuttle_utility.py``, ``fmnist_utility.py``)."""

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
