"""tests/clipped/jax runs only under Keras 3's JAX backend (``make test-jax``:
``KERAS_BACKEND=jax pytest tests/clipped/jax``); on any other backend its modules are not
collected (they import lipdp.clipped.jax.model, which refuses other backends)."""

import keras
import pytest

if keras.backend.backend() != "jax":
    collect_ignore_glob = ["test_*.py"]
else:
    import tempfile

    import jax

    # Many tests build the same small model: its step compiles to the same XLA program,
    # which the persistent compilation cache then serves (compiling dominates these tests).
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="lipdp-jax-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def reproducible_noise():
    """``use_reproducible_noise(seed)`` for the test, then back to the OS's entropy."""
    from lipdp.core import noise

    def use(seed):
        noise.use_reproducible_noise(seed)

    yield use
    noise.use_reproducible_noise(None)
