"""lipdp.foundation.compat: lipdp runs on Keras 3 with the TensorFlow backend and on Keras 2
(TensorFlow 2.15), sets no environment variable, and refuses another Keras 3 backend in one
line naming the fix."""

import importlib.util
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from lipdp.foundation import compat

KERAS_3 = keras.__version__.startswith("3.")


def _run(code, **env):
    """``code`` in a fresh interpreter without TF_USE_LEGACY_KERAS, with ``env`` added."""
    base = {
        k: v for k, v in os.environ.items() if k not in (compat.LEGACY_KERAS_FLAG, "KERAS_BACKEND")
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_this_suite_runs_on_a_supported_keras():
    assert compat.keras_problem() is None
    assert compat.keras_3() is KERAS_3
    # lipdp's handle (the keras package) is the Keras of tf.keras: the same classes.
    assert tf.keras.layers.Dense is keras.layers.Dense
    assert compat.loaded_keras_version(tf) == keras.__version__


@pytest.mark.smoke
@pytest.mark.parametrize("order", ["keras first", "lipdp first"])
def test_importing_keras_before_or_after_lipdp_trains_a_keras_model(order):
    """Either order works, and lipdp sets no environment variable."""
    imports = "import keras, lipdp" if order == "keras first" else "import lipdp, keras"
    code = f"""{imports}
import os, numpy as np
inputs = keras.Input((4,))
net = keras.Model(inputs, keras.layers.Dense(3)(inputs))
model = lipdp.make_private(net, epsilon=2.0, delta=1e-5, epochs=1, batch_size=8,
                           dataset_size=32, method="clipped")
model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
y = np.eye(3, dtype="float32")[np.arange(32) % 3]
model.fit(lipdp.private_batches(model, x, y, seed=0), epochs=1, verbose=0)
print(os.environ.get("TF_USE_LEGACY_KERAS"), int(model.noisy_steps.numpy()), keras.__version__)
"""
    result = _run(code)
    assert result.returncode == 0, result.stderr[-3000:]
    flag, steps, version = result.stdout.split()
    assert flag == "None"
    assert int(steps) == 4  # floor(32 / 8) steps of one epoch
    assert version == keras.__version__


@pytest.mark.skipif(
    not KERAS_3 or importlib.util.find_spec("jax") is None,
    reason="another Keras backend needs Keras 3 and JAX installed",
)
def test_another_keras_3_backend_is_refused_in_one_line_naming_the_fix():
    result = _run("import keras, lipdp.clipped.model", KERAS_BACKEND="jax")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: lipdp cannot run here: Keras 3")
    assert "runs on the jax backend" in last
    assert last.endswith("Fix: set KERAS_BACKEND=tensorflow before importing keras.")


def test_declared_input_shapes_are_read_on_either_keras():
    assert compat.declared_batch_shape(compat.input_layer((5, 2))) == (None, 5, 2)
    with compat.input_shape_accepted():
        dense = keras.layers.Dense(3, input_shape=(7,))
    assert compat.declared_batch_shape(dense) == (None, 7)
    assert compat.declared_batch_shape(keras.layers.Dense(3)) is None


@pytest.mark.skipif(not KERAS_3, reason="keras.Input gives a layer-less tensor on Keras 3 only")
def test_a_keras_3_input_tensor_stands_for_its_input_layer():
    layer = compat.as_layer(keras.Input((6,)))
    assert isinstance(layer, keras.layers.InputLayer)
    assert compat.declared_batch_shape(layer) == (None, 6)
    dense = keras.layers.Dense(2)
    assert compat.as_layer(dense) is dense


def test_loss_reduction_names_are_keras_own():
    loss = keras.losses.MeanSquaredError(reduction=compat.Reduction.SUM)
    assert loss.reduction == compat.Reduction.SUM
    assert keras.losses.MeanSquaredError().reduction in (
        compat.Reduction.AUTO,
        compat.Reduction.SUM_OVER_BATCH_SIZE,
    )


def test_layers_of_another_keras_package_are_refused_naming_the_fix():
    """With TF_USE_LEGACY_KERAS=1 on TensorFlow >= 2.16, tf.keras layers are tf-keras's
    (Keras 2), not the keras package's: refused in one line by the model."""
    from lipdp.clipped.model import DPSGD_Sequential
    from lipdp.core.parameters import DPParameters

    foreign = type("Dense", (), {"__module__": "tf_keras.src.layers.core.dense", "name": "d"})()
    compat.refuse_foreign_layers([keras.layers.Dense(2)])  # the keras package's: accepted
    with pytest.raises(TypeError, match="'d' is a tf_keras Dense while lipdp runs on the keras"):
        DPSGD_Sequential([foreign], dp_parameters=DPParameters("global", 1.0, 1e-5))


def test_a_poisson_batch_split_unevenly_between_replicas_trains_as_on_one_device():
    """MirroredStrategy over two devices, a Poisson batch of an odd number of rows: the
    replicas hold parts of unequal sizes. Training runs (Keras 3 would build the model from
    the parts' elementwise mean and fail: compat.first_replica_spec), on the pipeline's
    first draw (Keras 3's build draws none), to the single device's weights, and the
    logged loss is the whole batch's (Keras 3 divides each replica's by the replicas:
    compat.replica_loss)."""
    from lipdp.core.distribute import mirrored_strategy
    from lipdp.pipeline import poisson_batches
    from tests import distribute_helpers as h

    x, y = h.data()

    def batches():  # the same seeded draws for every run
        return poisson_batches(x, y, 0.5, 2, seed=11)

    assert len(next(iter(batches()))[0]) % 2 == 1
    tf.keras.utils.set_random_seed(3)
    single = h.build("dp-sgd", 0.0, 32, "poisson")
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    with mirrored_strategy(devices).scope():
        replicated = h.build("dp-sgd", 0.0, 32, "poisson")
    replicated.set_weights(single.get_weights())
    losses = [m.fit(batches(), verbose=0).history["loss"] for m in (single, replicated)]
    np.testing.assert_allclose(h.flat_weights(replicated), h.flat_weights(single), atol=2e-6)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
