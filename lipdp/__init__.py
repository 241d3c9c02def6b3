"""lipdp: differentially private deep learning without per-sample clipping.

Lipschitz-constrained layers make the sensitivity of every minibatch gradient
known in advance, so Gaussian noise can be calibrated without clipping
per-example gradients (Béthune et al., *DP-SGD Without Clipping: The Lipschitz
Neural Network Way*, ICLR 2024).

lipdp needs Keras 2 as ``tf.keras``: TensorFlow 2.15, or TensorFlow 2.16 to 2.21 with
``tf-keras`` and ``TF_USE_LEGACY_KERAS=1`` (set here if TensorFlow is not imported yet;
:mod:`lipdp.core.compat`).
"""

from lipdp.core import compat as _compat

# Before any lipdp module imports TensorFlow (this package's modules import it, this file
# does not): on TensorFlow >= 2.16, route tf.keras to tf-keras unless told otherwise.
_compat.prefer_legacy_keras()
_compat.require_keras_2()


def _version() -> str:
    # One source of truth: ``version`` in setup.cfg, read back from the installed package's
    # metadata. A source checkout imported without being installed reads setup.cfg itself.
    from importlib import metadata

    try:
        return metadata.version("lipdp")
    except metadata.PackageNotFoundError:
        import configparser
        from pathlib import Path

        config = configparser.ConfigParser(interpolation=None)
        config.read(Path(__file__).resolve().parents[1] / "setup.cfg", encoding="utf-8")
        if config.get("metadata", "name", fallback=None) == "lipdp":
            return config.get("metadata", "version", fallback="0+unknown")
        return "0+unknown"  # neither installed nor in its source tree


__version__ = _version()


#: Top-level names and the module defining each, imported on first use so that
#: ``import lipdp`` does not import TensorFlow.
_LAZY = {
    "fix_batch_coupling": "lipdp.core.batch_independence",
    "make_private": "lipdp.entry",
    "private_batches": "lipdp.entry",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lipdp' has no attribute {name!r}")


__all__ = list(_LAZY)
