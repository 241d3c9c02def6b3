"""In fresh interpreters: the JAX path imports no TensorFlow, and a step under
``keras.distribution.DataParallel`` over two devices releases what one device does."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(code, **env):
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def test_make_private_fit_and_the_accountant_import_no_tensorflow():
    code = """
import sys, numpy as np, keras, lipdp
from lipdp.core.callbacks import DP_Accountant
net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
model = lipdp.make_private(net, epsilon=2.0, delta=1e-5, epochs=1, batch_size=8,
                           dataset_size=32, sampling="poisson")
model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
y = np.eye(3, dtype="float32")[np.arange(32) % 3]
h = model.fit(lipdp.private_batches(model, x, y), epochs=1, verbose=0, callbacks=[DP_Accountant()])
print(type(model).__name__, int(model.noisy_steps.numpy()), h.history["epsilon"][-1] <= 2.0,
      "tensorflow" in sys.modules)
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["DPSGD_JaxModel", "4", "True", "False"]


def test_data_parallel_step_equals_the_single_device_step():
    """Same weights, same batch, same key: the step on two devices (the batch sharded,
    the clipped sum over the global batch, the noise added once) gives the weights of the
    step on one device."""
    code = """
import numpy as np, keras, jax
from lipdp.core import noise
from tests.clipped.jax import helpers as h
assert len(jax.devices()) == 2
noise.use_reproducible_noise(4)
x, y = h.data(16, scale=10.0)
mask = np.ones(16, np.float32); mask[5] = 0.0
single = h.private(h.mlp(seed=0), sigma=2.0)
one = h.step_update(single, x, y, mask)
keras.distribution.set_distribution(keras.distribution.DataParallel())
parallel = h.private(h.mlp(seed=0), sigma=2.0)
two = h.step_update(parallel, x, y, mask)
layout = parallel.trainable_variables[0].value.sharding
print(np.abs(one - two).max(), np.linalg.norm(one), len(layout.device_set),
      int(parallel.noisy_steps.numpy()))
"""
    result = _run(code, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert result.returncode == 0, result.stderr[-3000:]
    difference, norm, devices, steps = result.stdout.split()
    assert float(difference) < 1e-5 * float(norm) + 1e-6
    assert float(norm) > 0.1 and int(devices) == 2 and int(steps) == 1
