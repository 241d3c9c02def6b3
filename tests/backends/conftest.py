"""tests/backends runs on every backend: in the default suite (TensorFlow) and in
``make test-jax`` (``KERAS_BACKEND=jax``, tests/conftest.py collects it there too). Its
tests go through the public API only (``make_private``, ``compile``, ``train_on_batch``,
``save``/``load_model``), so one test is one check on both backends."""

import keras

if keras.backend.backend() == "jax":
    import tempfile

    import jax

    # The same small models are compiled by many tests: the persistent cache serves them.
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="lipdp-jax-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
