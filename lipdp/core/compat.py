"""Which Keras lipdp runs on: the one place where lipdp deals with Keras versions.

``tf.keras`` is lipdp's handle on Keras, whatever its major version:

* **Keras 3** (TensorFlow >= 2.16 with the ``keras`` package: ``tf.keras`` *is* the
  ``keras`` package a user imports) with the TensorFlow backend: the stack lipdp is being
  ported to (issue 28). Importing ``keras`` before or after ``lipdp`` makes no difference,
  and lipdp sets no environment variable.
* **Keras 2**: TensorFlow 2.15's own, or ``tf-keras`` when the user sets
  ``TF_USE_LEGACY_KERAS=1`` before importing TensorFlow >= 2.16. The same code runs on it
  while the port lasts; the few places where the two APIs differ ask :func:`keras_3`.

Keras 3 with another backend (JAX, PyTorch) is refused in one line naming the fix: lipdp's
training steps are TensorFlow programs.

This module does not import TensorFlow at import time (``lipdp --help`` and
:mod:`lipdp.accounting` stay TensorFlow-free); :func:`require_supported_keras` is called by
the modules that build models, once TensorFlow is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
import warnings

#: The first TensorFlow release whose ``tf.keras`` is Keras 3 by default.
KERAS_3_DEFAULT_SINCE = (2, 16)
#: The environment variable that routes ``tf.keras`` to ``tf-keras`` (TensorFlow >= 2.15);
#: lipdp never sets it.
LEGACY_KERAS_FLAG = "TF_USE_LEGACY_KERAS"
#: The Keras 3 backend lipdp's steps run on.
SUPPORTED_BACKEND = "tensorflow"
#: The distributions that install the ``tensorflow`` package.
_TENSORFLOW_DISTRIBUTIONS = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-intel",
    "tensorflow-macos",
    "tf-nightly",
    "tf-nightly-cpu",
)


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def tensorflow_version() -> tuple[int, int] | None:
    """``(major, minor)`` of TensorFlow: the imported one, else the installed one (from its
    package metadata, without importing it); ``None`` if neither is known."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(getattr(tf, "__version__", None), str):
        return _major_minor(tf.__version__)
    for name in _TENSORFLOW_DISTRIBUTIONS:
        try:
            return _major_minor(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _keras_package(tf) -> str:
    """``"keras"`` or ``"tf_keras"``: the package behind ``tf.keras`` (resolves it)."""
    return tf.keras.Model.__module__.split(".")[0]


def loaded_keras_version(tf) -> str:
    """The version of the Keras package behind ``tf.keras`` (resolves ``tf.keras``):
    ``keras`` 2.15 on TensorFlow 2.15, ``tf_keras`` with the flag, ``keras`` 3 without."""
    return str(getattr(sys.modules[_keras_package(tf)], "__version__", "?"))


@functools.cache
def keras_3() -> bool:
    """Whether ``tf.keras`` is Keras 3 (imports TensorFlow)."""
    import tensorflow as tf

    return loaded_keras_version(tf).split(".")[0] == "3"


def keras_problem() -> str | None:
    """Why lipdp cannot run on this ``tf.keras``, or ``None`` (imports TensorFlow)."""
    import tensorflow as tf

    try:
        version = loaded_keras_version(tf)
    except ImportError as error:  # the flag is set but tf-keras is missing
        return f"tf.keras cannot be imported ({' '.join(str(error).split())})"
    if version.split(".")[0] != "3":
        return None
    backend = tf.keras.backend.backend()
    if backend != SUPPORTED_BACKEND:
        return (
            f"Keras {version} runs on the {backend} backend while lipdp's training steps are "
            f"TensorFlow programs. Fix: set KERAS_BACKEND={SUPPORTED_BACKEND} before importing "
            "keras"
        )
    return None


def require_supported_keras() -> None:
    """Raise a one-line :class:`ImportError` naming the fix if lipdp cannot run on this
    ``tf.keras`` (:func:`keras_problem`)."""
    problem = keras_problem()
    if problem is not None:
        raise ImportError(f"lipdp cannot run here: {problem}.")


# ------------------------------------------------------------- where the APIs differ
def declared_batch_shape(layer) -> tuple | None:
    """The batch input shape ``(None, ...)`` a layer was declared with -- an ``InputLayer``'s,
    or the ``input_shape=`` given to a first layer --, or ``None``."""
    if keras_3():
        shape = getattr(layer, "batch_shape", None)  # an InputLayer
        if shape is None and getattr(layer, "_input_shape_arg", None) is not None:
            shape = (None, *layer._input_shape_arg)  # noqa: SLF001  (Keras 3 keeps it here)
    else:
        shape = getattr(layer, "_batch_input_shape", None)
    return None if shape is None else tuple(shape)


def input_layer(shape, dtype=None):
    """A Keras ``InputLayer`` for inputs of shape ``shape`` (without the batch) and
    ``dtype`` (default: the float type)."""
    import tensorflow as tf

    if keras_3():
        return tf.keras.layers.InputLayer(shape=tuple(shape), dtype=dtype)
    return tf.keras.layers.InputLayer(input_shape=tuple(shape), dtype=dtype)


def as_layer(item):
    """``item``, or the ``InputLayer`` behind a Keras 3 ``keras.Input(...)`` tensor (Keras 3
    models take such a tensor in a list of layers)."""
    history = getattr(item, "_keras_history", None)
    if keras_3() and history is not None and not hasattr(item, "call"):
        import tensorflow as tf

        operation = history[0]
        if isinstance(operation, tf.keras.layers.InputLayer):
            return operation
    return item


class Reduction:
    """The names of Keras' loss reductions (Keras 2's ``tf.keras.losses.Reduction``, which
    Keras 3 replaced by the same strings; Keras 3 has no ``"auto"``)."""

    AUTO = "auto"
    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"


@contextlib.contextmanager
def input_shape_accepted():
    """Around ``keras.layers.Layer.__init__(..., input_shape=...)``: silence Keras 3's
    warning against ``input_shape``. Keras 3 still honours it (a sequential model's first
    layer declares the input shape with it), and lipdp's first layers take it by design
    (the original package's API)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Do not pass an `input_shape`")
        yield


def symbolic_call(fn, *args):
    """Keras 3: ``fn(*args)`` on symbolic inputs (``keras.KerasTensor``), traced without
    data; the symbolic outputs. Unbuilt layers called by ``fn`` are built. (Keras 3's
    ``Layer.compute_output_spec`` does this unless the layer defines
    ``compute_output_shape``, which a model then cannot define with it.)"""
    from keras.src import backend

    return backend.compute_output_spec(fn, *args)


def is_variable(value) -> bool:
    """Whether ``value`` is a model variable: a ``keras.Variable`` on Keras 3 (which wraps a
    ``tf.Variable`` but is not one), a ``tf.Variable`` on Keras 2."""
    import tensorflow as tf

    if keras_3():
        import keras

        return isinstance(value, (keras.Variable, tf.Variable))
    return isinstance(value, tf.Variable)


def tape_variable(variable):
    """The object a ``tf.GradientTape`` watches when ``variable`` is read (what
    ``tape.watched_variables()`` returns): a Keras 3 variable's backing ``tf.Variable``
    (its ``value`` outside an autocast scope), the variable itself on Keras 2."""
    if keras_3():
        import keras

        if isinstance(variable, keras.Variable):
            return variable.value
    return variable


def variable_path(variable) -> str:
    """How lipdp names a variable in a message: Keras 3's ``path`` (``"dense/kernel"``;
    its ``name`` is only ``"kernel"``), Keras 2's ``name`` (``"dense/kernel:0"``)."""
    return str(getattr(variable, "path", None) or variable.name)
