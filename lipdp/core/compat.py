"""Which Keras ``tf.keras`` is: the one place where lipdp deals with TensorFlow versions.

lipdp is written against the Keras 2 API of ``tf.keras`` (``Model.train_step`` with
``compiled_loss`` and ``optimizer.apply_gradients``, layers that own ``tf.Variable`` s,
deel-lip's layers, Keras 2's ``.keras`` files). TensorFlow 2.15 ships Keras 2 as its
``tf.keras``. From TensorFlow 2.16 on, ``tf.keras`` is Keras 3 unless the ``tf-keras``
package is installed and the environment variable ``TF_USE_LEGACY_KERAS`` is true when
TensorFlow is imported (TensorFlow reads it once: when it is imported, for the
``tensorflow.keras`` import path deel-lip uses, and on the first access to ``tf.keras``).

``import lipdp`` therefore (see ``lipdp/__init__.py``):

* sets ``TF_USE_LEGACY_KERAS=1`` (unless it is set already) when TensorFlow >= 2.16 is
  installed and not imported yet: importing lipdp before TensorFlow is enough;
* raises a one-line :class:`ImportError` naming the fix when ``tf.keras`` is, or will be,
  Keras 3 (TensorFlow imported before the variable was set, the variable set to false, or
  ``tf-keras`` missing), instead of failing later on a Keras 3 API difference.

On TensorFlow 2.15 nothing is set: its own Keras 2 stays ``tf.keras`` (TensorFlow 2.15 would
route ``tf.keras`` to ``tf-keras`` too if the variable were set).

This module does not import TensorFlow (``lipdp --help`` and :mod:`lipdp.accounting` stay
TensorFlow-free): before TensorFlow is imported, its version is read from the installed
package's metadata.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

#: The first TensorFlow release whose ``tf.keras`` is Keras 3 by default.
KERAS_3_DEFAULT_SINCE = (2, 16)
#: The environment variable that routes ``tf.keras`` to ``tf-keras`` (TensorFlow >= 2.15).
LEGACY_KERAS_FLAG = "TF_USE_LEGACY_KERAS"
#: The values TensorFlow's Keras loader accepts as true.
TRUE_VALUES = ("true", "True", "1")
#: What to do when ``tf.keras`` is Keras 3.
FIX = "pip install tf-keras and export TF_USE_LEGACY_KERAS=1 before importing TensorFlow"
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


def _version_text(version: tuple[int, int] | None) -> str:
    return "?" if version is None else ".".join(map(str, version))


def _flag_text(flag: str | None) -> str:
    return f"{LEGACY_KERAS_FLAG} is unset" if flag is None else f"{LEGACY_KERAS_FLAG}={flag!r}"


def prefer_legacy_keras() -> bool:
    """Set ``TF_USE_LEGACY_KERAS=1`` if TensorFlow >= 2.16 is installed, not imported yet,
    and the variable is not set; True if it was set here."""
    if "tensorflow" in sys.modules or LEGACY_KERAS_FLAG in os.environ:
        return False
    version = tensorflow_version()
    if version is None or version < KERAS_3_DEFAULT_SINCE:
        return False
    os.environ[LEGACY_KERAS_FLAG] = "1"
    return True


def predicted_keras_problem(
    version: tuple[int, int] | None, flag: str | None, has_tf_keras: bool
) -> str | None:
    """Why ``tf.keras`` will not be Keras 2 once TensorFlow ``version`` is imported with
    ``TF_USE_LEGACY_KERAS=flag``, or ``None`` (also when the version is unknown)."""
    if version is None or version < KERAS_3_DEFAULT_SINCE:
        return None
    if flag not in TRUE_VALUES:
        return (
            f"TensorFlow {_version_text(version)} makes tf.keras Keras 3 while {_flag_text(flag)}"
        )
    if not has_tf_keras:
        return f"TensorFlow {_version_text(version)} needs tf-keras for Keras 2, which is missing"
    return None


def _keras_package(tf) -> str:
    """``"keras"`` or ``"tf_keras"``: the package behind ``tf.keras`` (resolves it)."""
    return tf.keras.Model.__module__.split(".")[0]


def loaded_keras_version(tf) -> str:
    """The version of the Keras package behind ``tf.keras`` (resolves ``tf.keras``):
    ``keras`` 2.15 on TensorFlow 2.15, ``tf_keras`` with the flag, ``keras`` 3 without."""
    return str(getattr(sys.modules[_keras_package(tf)], "__version__", "?"))


def keras_problem() -> str | None:
    """Why ``tf.keras`` is (or, TensorFlow not imported yet, will be) not Keras 2, or
    ``None``."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return predicted_keras_problem(
            tensorflow_version(),
            os.environ.get(LEGACY_KERAS_FLAG),
            importlib.util.find_spec("tf_keras") is not None,
        )
    try:
        keras_version = loaded_keras_version(tf)
    except ImportError as error:  # the flag is set but tf-keras is missing
        return f"tf.keras cannot be imported ({' '.join(str(error).split())})"
    if keras_version.split(".")[0] == "2":
        # The flag set after TensorFlow was imported routes tf.keras to tf-keras, but the
        # ``tensorflow.keras`` import path (deel-lip's) was fixed at import: Keras 3 there.
        # TensorFlow records the flag it was imported with (a private name: absent, no check).
        if _keras_package(tf) == "tf_keras" and getattr(tf, "_tf_uses_legacy_keras", None) is False:
            return (
                f"TensorFlow {tf.__version__} was imported before {LEGACY_KERAS_FLAG}=1 was "
                "set, so deel-lip's tensorflow.keras imports give Keras 3"
            )
        return None
    return (
        f"tf.keras is Keras {keras_version} (TensorFlow {tf.__version__} was imported while "
        f"{_flag_text(os.environ.get(LEGACY_KERAS_FLAG))})"
    )


def require_keras_2() -> None:
    """Raise a one-line :class:`ImportError` with the fix if ``tf.keras`` is not Keras 2."""
    problem = keras_problem()
    if problem is not None:
        raise ImportError(f"lipdp needs Keras 2 as tf.keras, but {problem}. Fix: {FIX}.")
