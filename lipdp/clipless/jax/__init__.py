"""The clipless family on Keras 3's JAX backend (issue 38 item 5).

:mod:`lipdp.clipless.jax.trainer`: the trainer ``DP_Model``/``DP_Sequential`` run on under
``KERAS_BACKEND=jax`` (:class:`~lipdp.clipless.jax.trainer.CliplessJaxTrainer`) and what is
ported to ``jax.jit`` (every layer and loss of the family, written once with
:func:`lipdp.foundation.compat.array_ops`); :mod:`lipdp.clipless.jax.gradients`: the
``jax.custom_vjp`` of ``DP_ClipGradient``. Importing this package needs ``KERAS_BACKEND=jax``.
"""
