"""Rule S10 on the JAX backend: a restored ledger is never re-priced by the next steps.

Keras 3's JAX ``fit`` makes the train function before ``on_train_begin``, where
``BackupAndRestore`` loads the weights (the ledger with them); a callback may load or set
weights between two epochs. Whatever the ledger holds when a step runs, the step adds its
run to the right row (``lipdp.clipped.jax.ledger.recorded`` places it in-graph from the
current table). The reference epsilon is composed here from the segments the test ran,
mechanism by mechanism, with lipdp's RDP accountant -- independent of the ledger.
``tests/core/test_privacy_ledger.py`` runs the same scenarios on TensorFlow.
"""

import keras
import pytest

import lipdp
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.parameters import DPParameters
from tests.clipped.jax import helpers as h
from tests.marks import representatives
from tests.resume_scenarios import (
    CHANGES,
    EPOCHS,
    FIRST,
    INTERRUPTED_AFTER,
    Interrupt,
    composed,
    ran,
    segment,
)

DELTA = 1e-5


def _model(seed, sigma, batch_size, n):
    return h.private(h.mlp(seed=seed), sigma=sigma, batch_size=batch_size, n=n, lr=0.1)


def _fit(model, epochs, callbacks, seed=0):
    n = model.dataset_metadata.nb_samples_train
    x, y = h.data(n, seed=seed)
    batches = lipdp.private_batches(model, x, y, seed=seed)
    return model.fit(batches, epochs=epochs, verbose=0, callbacks=callbacks)


@pytest.mark.parametrize("change", representatives(CHANGES, default={"sigma"}))
def test_backup_and_restore_into_another_configuration_keeps_the_past_prices(tmp_path, change):
    """Two epochs at sigma 1 (b 8, N 32), interrupted; resumed by BackupAndRestore into a
    model of another sigma, b or N: the ledger lists both segments with their counts and
    the logged epsilon is their composition."""
    backup = str(tmp_path / "backup")
    first = _model(0, **FIRST)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, EPOCHS, [keras.callbacks.BackupAndRestore(backup), Interrupt(2)])
    done = INTERRUPTED_AFTER * 4
    assert int(first.noisy_steps.numpy()) == done

    config = CHANGES[change]
    resumed = _model(1, **config)
    history = _fit(resumed, EPOCHS, [keras.callbacks.BackupAndRestore(backup), DP_Accountant()])
    steps = (EPOCHS - INTERRUPTED_AFTER) * resumed.dataset_metadata.nb_steps_per_epochs
    expected = [segment(FIRST, done), segment(config, steps)]
    assert ran(resumed) == expected
    assert int(resumed.noisy_steps.numpy()) == done + steps
    assert history.history["epsilon"][-1] == composed(expected, DELTA)


def test_loading_an_older_checkpoint_between_and_during_fits_keeps_the_past_prices(tmp_path):
    """A checkpoint of a model trained at sigma 1 is loaded into a model that has trained
    at sigma 2 since: between two fits, and from a callback between two epochs of a fit
    (after the step was compiled). Every step keeps its own price."""
    old = _model(0, **FIRST)
    _fit(old, 1, [])
    checkpoint = str(tmp_path / "old.weights.h5")
    old.save_weights(checkpoint)
    at_sigma_1 = segment(FIRST, 4)

    config = CHANGES["sigma"]
    model = _model(1, **config)
    _fit(model, 1, [])
    model.load_weights(checkpoint)  # between fits
    _fit(model, 1, [])
    assert ran(model) == [at_sigma_1, segment(config, 8)]

    other = _model(2, **config)
    _fit(other, 1, [])

    class LoadAtEpoch1(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.model.load_weights(checkpoint)

    history = _fit(other, 2, [LoadAtEpoch1(), DP_Accountant()])
    expected = [at_sigma_1, segment(config, 12)]
    assert ran(other) == expected
    assert history.history["epsilon"][-1] == composed(expected, DELTA)


def test_weights_set_by_a_callback_mid_fit_keep_the_past_prices():
    """``set_weights`` from another model's weights during a fit whose step was compiled
    before: its ledger comes first, this model's runs after it, each at its price."""
    donor = _model(0, **FIRST)
    _fit(donor, 1, [])
    weights = donor.get_weights()
    config = CHANGES["sigma"]
    model = _model(1, **config)

    class SetAtEpoch1(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                self.model.set_weights(weights)

    _fit(model, 2, [SetAtEpoch1()])
    assert ran(model) == [segment(FIRST, 4), segment(config, 8)]
    model.dp_parameters = DPParameters("global", 3.0, DELTA)  # a third mechanism, next fit
    _fit(model, 1, [])
    assert ran(model)[-1] == segment({**config, "sigma": 3.0}, 4)
