"""Rule S10: the ledger follows the weights -- a model built from layers a private model
trained starts from that model's spending, loaded from a file or not (issue 37: a head on
a loaded private backbone reported only the head's steps, 3.17 instead of 4.68).

The reference is independent of lipdp's accounting: each test knows the segments it ran
(noise multiplier, Gaussians per step, rate, steps) and composes them with
``dp_accounting``'s PLD accountant (``tests.core.test_privacy_ledger._ReferenceEpsilon``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless.model import DP_Sequential
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.core.parameters import DPParameters
from lipdp.core.report import privacy_report
from tests.core.test_privacy_ledger import (
    DELTA,
    D,
    K,
    _compile,
    _data,
    _fit,
    _gaussians,
    _metadata,
    _ReferenceEpsilon,
)
from tests.marks import thorough

ROOT = Path(__file__).resolve().parents[2]


def _backbone(family):
    if family == "clipless":
        return [
            L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0),
            L.DP_SpectralDense(8),
            L.DP_GroupSort(2),
        ]
    return [tf.keras.layers.Dense(8, activation="tanh", input_shape=(D,))]


def _head(family):
    return L.DP_SpectralDense(K) if family == "clipless" else tf.keras.layers.Dense(K)


def _private(family, layers, sigma, batch_size=8):
    params = DPParameters("per-layer", sigma, DELTA)
    if family == "clipless":
        model = DP_Sequential(layers, dp_parameters=params, dataset_metadata=_metadata(batch_size))
    else:
        model = DPSGD_Sequential(
            layers,
            dp_parameters=params,
            clipping=Clipping("per-layer", 1.0),
            dataset_metadata=_metadata(batch_size),
        )
    if not model.built:  # layers loaded from a Keras 3 file keep no input shape
        model.build((None, D))
    _compile(model)
    return model


class _Run:
    """Trains models and keeps the reference composition of every segment run."""

    def __init__(self):
        self.reference = _ReferenceEpsilon()
        self.epsilon = None

    def fit(self, model, epochs=1):
        meta = model.dataset_metadata
        logged = _fit(model, epochs)
        sigma = model.dp_parameters.noise_multiplier
        steps = epochs * meta.nb_steps_per_epochs
        self.epsilon = self.reference.add(sigma, _gaussians(model), meta.sampling_rate, steps)
        return logged[-1]


def _weighted(model):
    return [layer for layer in model.dp_layers if layer.weights]


@pytest.mark.parametrize(
    "family, how",
    [
        ("dp-sgd", "head"),
        pytest.param("dp-sgd", "nested-frozen", marks=thorough),
        ("dp-sgd", "nested-trainable"),
        pytest.param("clipless", "head", marks=thorough),  # DP models take DP layers only
    ],
)
def test_a_model_built_on_a_loaded_private_model_starts_from_its_spending(family, how, tmp_path):
    """Train privately, save, load (in this process), build a new private model from the
    loaded layers -- a new head on the loaded backbone, or the loaded model nested (frozen
    or not) under a head -- and train it: its epsilon is the composition of both runs."""
    run = _Run()
    first = _private(family, [*_backbone(family), _head(family)], 2.0)
    run.fit(first, epochs=2)
    path = tmp_path / "first.keras"
    first.save(path)
    loaded = tf.keras.models.load_model(path)
    if how == "head":
        layers = [*loaded.dp_layers[:-1], _head(family)]
    else:
        loaded.trainable = how == "nested-trainable"
        layers = [loaded, _head(family)]
    second = _private(family, layers, 3.0)
    logged = run.fit(second)
    assert logged == pytest.approx(run.epsilon, rel=1e-6)
    assert len(privacy_report(second).released) == 2


@pytest.mark.parametrize("family", ["dp-sgd"])
def test_layers_of_a_loaded_model_reused_in_a_new_process_keep_its_spending(family, tmp_path):
    """The same in a process that never saw the first model: only the file carries it."""
    run = _Run()
    first = _private(family, [*_backbone(family), _head(family)], 2.0)
    run.fit(first, epochs=2)
    path = tmp_path / "first.keras"
    first.save(path)
    code = (
        "import json, sys, tensorflow as tf\n"
        "from tests.core.test_lineage import _private, _head, _fit\n"
        f"loaded = tf.keras.models.load_model({str(path)!r})\n"
        f"second = _private({family!r}, [*loaded.dp_layers[:-1], _head({family!r})], 3.0)\n"
        "print(json.dumps(_fit(second, 1)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    logged = json.loads(done.stdout.decode().strip().splitlines()[-1])
    meta = first.dataset_metadata  # the second model: 2 weighted layers, 1 epoch of 8 steps
    expected = run.reference.add(3.0, 2, meta.sampling_rate, meta.nb_steps_per_epochs)
    assert logged[-1] == pytest.approx(expected, rel=1e-6)


def test_a_model_built_from_layers_of_two_private_models_composes_both():
    """Two backbones trained by two private models: a model built from both starts from
    the composition of both ledgers (it was refused before); the two former models can no
    longer train the layers they handed over."""
    run = _Run()
    left = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 2.0)
    right = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 1.5)
    run.fit(left)
    run.fit(right, epochs=2)
    merged = _private("dp-sgd", [left.dp_layers[0], right.dp_layers[1]], 3.0)
    assert privacy_report(merged, accountant="pld").epsilon == pytest.approx(run.epsilon, rel=1e-6)
    logged = run.fit(merged)
    assert logged == pytest.approx(run.epsilon, rel=1e-6)
    x, y = _data()
    with pytest.raises(ValueError, match="belong to another private model"):
        left.train_on_batch(x[:8], y[:8])


def test_a_new_model_sharing_layers_records_into_the_same_ledger():
    """A model built on layers of another private model shares its ledger: each model's
    epsilon holds the other's steps on the shared weights, whichever trains first."""
    run = _Run()
    first = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 2.0)
    second = _private("dp-sgd", [first.dp_layers[0], _head("dp-sgd")], 3.0)
    run.fit(second)
    logged = run.fit(first)
    assert logged == pytest.approx(run.epsilon, rel=1e-6)
    assert privacy_report(second, accountant="pld").epsilon == pytest.approx(run.epsilon, rel=1e-6)
    np.testing.assert_array_equal(
        second.privacy_ledger.counts.numpy(), first.privacy_ledger.counts.numpy()
    )


def test_weights_copied_layer_by_layer_bring_their_spending(caplog):
    """``layer.set_weights(private_layer.get_weights())`` carries no ledger: the copy is
    recognised by its values, once, when the new model is built or first trained, and the
    source's releases are added to the new model's ledger with a warning."""
    run = _Run()
    first = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 2.0)
    run.fit(first, epochs=2)
    second = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 3.0)
    assert not second.privacy_ledger.entries()
    for source, target in zip(first.dp_layers, second.dp_layers):
        target.set_weights(source.get_weights())  # numpy arrays, after the build
    with caplog.at_level("WARNING", logger="lipdp.core.private_model"):
        logged = run.fit(second)
    assert "hold weights copied from a model trained privately" in caplog.text
    assert logged == pytest.approx(run.epsilon, rel=1e-6)
    # Copied again before a build: the same releases are not added twice.
    third_layers = [*_backbone("dp-sgd"), _head("dp-sgd")]
    plain = tf.keras.Sequential(third_layers)
    plain.build((None, D))
    plain.set_weights([w for layer in first.dp_layers for w in layer.get_weights()])
    third = _private("dp-sgd", third_layers, 3.0)
    assert privacy_report(third, accountant="pld").epsilon == pytest.approx(
        _ReferenceEpsilon().add(2.0, 2, 8 / 64, 16), rel=1e-6
    )


def test_values_no_data_touched_are_not_copies(caplog):
    """A private model that trained without moving its weights (learning rate 0) still holds
    its seeded initialisation: a fresh model seeded alike holds the same values without
    copying anything and starts from an empty ledger. Once the source's weights are trained,
    a copy of them is charged (the values it held before its first release are the only
    ones exempt)."""
    tf.keras.utils.set_random_seed(3)
    source = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 2.0)
    source.optimizer.learning_rate.assign(0.0)
    initial = [v.numpy() for v in source.trainable_variables]
    _fit(source)
    assert source.privacy_ledger.entries()
    for before, after in zip(initial, [v.numpy() for v in source.trainable_variables]):
        np.testing.assert_array_equal(before, after)
    tf.keras.utils.set_random_seed(3)
    with caplog.at_level("WARNING", logger="lipdp.core.private_model"):
        alike = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 2.0)
        for before, after in zip(initial, [v.numpy() for v in alike.trainable_variables]):
            np.testing.assert_array_equal(before, after)
        assert not alike.privacy_ledger.entries()
        source.optimizer.learning_rate.assign(0.05)
        _fit(source)
        target = _private("dp-sgd", [*_backbone("dp-sgd"), _head("dp-sgd")], 2.0)
        for copy_to, copy_from in zip(target.dp_layers, source.dp_layers):
            copy_to.set_weights(copy_from.get_weights())
        _fit(target)
    assert caplog.text.count("hold weights copied from a model trained privately") == 1
    assert not alike.privacy_ledger.entries()
    assert (
        sum(e.count for e in target.privacy_ledger.entries())
        == 3 * sum(e.count for e in source.privacy_ledger.entries()) / 2
    )
