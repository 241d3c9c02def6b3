"""Rule S10 on every backend: the ledger follows the weights. A private model built from
layers another private model trained (in this process, or loaded from its file) starts
from that model's releases; weights copied layer by layer bring them too; a model whose
layers are reused records into the ledger they share with the new model.

(The TensorFlow suite, tests/core/test_lineage.py, also composes ledgers of several models
and checks epsilon against an independent accountant; these are the same rules through
the public API, on JAX as on TensorFlow: the JAX models lost the spending before.)"""

import keras
import numpy as np
import pytest

from tests.backends import harness as h


def _steps(model) -> int:
    """Noisy steps in the model's ledger (a model made private on layers that already
    spent is calibrated to a larger sigma, so its own steps take a row of their own)."""
    return sum(entry.count for entry in model.privacy_ledger.releases())


def _trained(family, steps=3):
    layers = h.network(family)
    model = h.private(family, layers=layers)
    x, y = h.data(8)
    for _ in range(steps):
        model.train_on_batch(x, y)
    return model, layers


@pytest.mark.parametrize("family", h.FAMILIES)
def test_a_model_built_on_trained_layers_shares_their_ledger(family):
    source, layers = _trained(family)
    reused = h.private(family, layers=layers)
    assert _steps(reused) == 3
    reused.train_on_batch(*h.data(8))
    assert reused.privacy_ledger.entries() == source.privacy_ledger.entries()  # one ledger
    assert _steps(source) == 4
    source.train_on_batch(*h.data(8))
    assert _steps(reused) == 5


@pytest.mark.parametrize("family", h.FAMILIES)
def test_layers_of_a_loaded_model_keep_its_spending(family, tmp_path):
    source, _ = _trained(family)
    path = str(tmp_path / "source.keras")
    source.save(path)
    loaded = keras.models.load_model(path)
    layers = h.layers_of(loaded)
    reused = h.private(family, layers=layers)
    assert reused.privacy_ledger.entries() == source.privacy_ledger.entries()
    assert _steps(reused) == 3


@pytest.mark.parametrize("family", h.FAMILIES)
def test_weights_copied_layer_by_layer_bring_their_spending(family, caplog):
    source, layers = _trained(family)
    copy = h.network(family, seed=1)
    target = h.private(family, layers=copy)
    for into, origin in zip(copy, layers):
        if origin.weights:
            into.set_weights(origin.get_weights())
    with caplog.at_level("WARNING"):
        target.train_on_batch(*h.data(8))
    assert _steps(target) == 4  # the source's 3 releases, then its own step
    assert "copied from a model trained privately" in caplog.text
    assert np.isfinite(h.weights(target)).all()
