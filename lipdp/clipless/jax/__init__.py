"""The clipless family on Keras 3's JAX backend (prototype, issue 38 item 5).

Only the smallest slice runs here: ``DP_BoundedInput``, the dense constrained layers
(``DP_SpectralDense``, ``DP_QuickSpectralDense``, ``DP_QuickFrobeniusDense``), ``DP_GroupSort``,
``DP_ClipGradient`` (a fixed clip value; ``jax.custom_vjp``) and
``DP_TauCategoricalCrossentropy``, trained by the pure step of
:mod:`lipdp.clipless.jax.step`. The plan of the whole port is the design note of the issue.
Importing this package needs ``KERAS_BACKEND=jax``.
"""
