"""CONTRIBUTING.md's example rule runs as written: the toy layer gets its ghost rule, and a
clipped model with it trains one step whose per-example norms match a naive loop."""

import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.clipped.per_example import ghost_rule, per_example_gradients, unregister_ghost_rule
from lipdp.core.parameters import DPParameters
from lipdp.foundation.metadata import DatasetMetadata

GUIDE = Path(__file__).parents[1] / "CONTRIBUTING.md"


@pytest.fixture
def example():
    namespace = {}
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    assert blocks, "CONTRIBUTING.md lost its example"
    for block in blocks:
        exec(block, namespace)  # noqa: S102  (the guide's own code, run as a reader would)
    yield namespace
    unregister_ghost_rule(namespace["XW"])


def test_the_guide_s_rule_is_used_and_exact(example):
    tf.keras.utils.set_random_seed(0)
    layer = example["XW"](3)
    model = DPSGD_Sequential(
        [tf.keras.layers.InputLayer((5, 4)), layer],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", 1.0),
        dataset_metadata=DatasetMetadata(
            input_shape=(5, 4), nb_classes=3, nb_samples_train=60, batch_size=6
        ),
    )
    model.compile(loss="mse", optimizer=tf.keras.optimizers.SGD(0.1))
    assert ghost_rule(layer) == "xw"
    x = tf.constant(np.random.default_rng(0).normal(size=(6, 5, 4)), tf.float32)
    target = tf.constant(np.random.default_rng(1).normal(size=(6, 5, 3)), tf.float32)

    def losses(y_pred):
        return tf.reduce_sum(target * y_pred, axis=[1, 2])

    facts = per_example_gradients(model, x, losses)
    assert [record.rule for record in facts.records] == ["xw"]
    naive = []
    for i in range(6):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(target[i] * model(x[i : i + 1]))
        (gradient,) = tape.gradient(loss, model.trainable_variables)
        naive.append(float(tf.reduce_sum(tf.cast(gradient, tf.float64) ** 2)))
    np.testing.assert_allclose(facts.sq_norms[0].numpy(), naive, rtol=1e-5)
    y = np.zeros((6, 5, 3), "float32")
    assert np.all(np.isfinite(model.train_on_batch(x, y)))
