"""tests/jax runs only under Keras 3's JAX backend (``make test-jax``:
``KERAS_BACKEND=jax pytest tests/jax``); on any other backend its modules are not
collected (they import lipdp.clipped.jax.model, which refuses other backends)."""

import keras
import pytest

if keras.backend.backend() != "jax":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def reproducible_noise():
    """``use_reproducible_noise(seed)`` for the test, then back to the OS's entropy."""
    from lipdp.core import noise

    def use(seed):
        noise.use_reproducible_noise(seed)

    yield use
    noise.use_reproducible_noise(None)
