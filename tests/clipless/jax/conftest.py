"""tests/clipless/jax runs only under Keras 3's JAX backend (``KERAS_BACKEND=jax pytest
tests/clipless/jax``); on any other backend its modules are not collected (they import
lipdp.clipless.jax, which needs JAX arrays)."""

import keras

if keras.backend.backend() != "jax":
    collect_ignore_glob = ["test_*.py"]
