"""The clipped family: DP-SGD with per-example clipping (flat, per-layer, automatic,
global), its sharpness-aware variants (BAM, DP-SAT), and the per-example gradient engine.

:mod:`lipdp.clipped.model` holds ``DPSGD_Model``/``DPSGD_Sequential`` (TensorFlow);
:mod:`lipdp.clipped.jax` the same family on Keras 3's JAX backend.
"""
