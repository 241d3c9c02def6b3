"""lipdp: differentially private deep learning without per-sample clipping.

Lipschitz-constrained layers make the sensitivity of every minibatch gradient
known in advance, so Gaussian noise can be calibrated without clipping
per-example gradients (Béthune et al., *DP-SGD Without Clipping: The Lipschitz
Neural Network Way*, ICLR 2024).

lipdp runs on Keras 3 with the TensorFlow backend (TensorFlow >= 2.16 and the ``keras``
package) and on Keras 2 (TensorFlow 2.15); it sets no environment variable
(:mod:`lipdp.foundation.compat`).
"""


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
    "fix_batch_coupling": "lipdp.core.coupling_fix",
    "make_private": "lipdp.privatize",
    "private_batches": "lipdp.privatize",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lipdp' has no attribute {name!r}")


__all__ = list(_LAZY)
