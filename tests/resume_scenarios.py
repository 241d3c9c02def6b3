"""The interrupted-and-resumed runs of the ledger tests, shared by the TensorFlow side
(``tests/core/test_privacy_ledger.py``) and the JAX side (``tests/clipped/jax/
test_resume.py``): the configurations, the interruption, and the reference epsilon composed
by hand from the segments that ran. Imports no TensorFlow (the JAX test process imports it).
"""

import keras

from lipdp.accounting import SubsampledGaussian, get_accountant

#: The first run: sigma 1, b = 8, N = 32 (4 steps per epoch), interrupted after 2 epochs;
#: the resumed run changes one of sigma, b or N.
FIRST = {"sigma": 1.0, "batch_size": 8, "n": 32}
CHANGES = {
    "sigma": {"sigma": 2.0, "batch_size": 8, "n": 32},
    "batch": {"sigma": 1.0, "batch_size": 16, "n": 32},
    "dataset": {"sigma": 1.0, "batch_size": 8, "n": 64},
}
EPOCHS, INTERRUPTED_AFTER = 3, 2


class Interrupt(keras.callbacks.Callback):
    """Raises at the end of epoch ``after`` (as Keras' own BackupAndRestore tests do)."""

    def __init__(self, after):
        super().__init__()
        self.after = after

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.after:
            raise RuntimeError("interrupted")


def segment(config, steps):
    """``(mechanism, count)`` of ``steps`` steps of a configuration, written by hand."""
    return SubsampledGaussian(config["sigma"], config["batch_size"] / config["n"]), steps


def composed(terms, delta):
    """The epsilon of ``terms`` under lipdp's RDP accountant."""
    return get_accountant("rdp").epsilon(tuple(terms), delta)


def ran(model):
    """``(mechanism, count)`` of every entry of ``model``'s ledger."""
    return [(e.mechanism, e.count) for e in model.privacy_ledger.entries()]
