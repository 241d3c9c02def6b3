"""The clipped family on Keras 3's JAX backend (``KERAS_BACKEND=jax``).

One module per concept:

* :mod:`~lipdp.clipped.jax.model` -- :class:`DPSGD_JaxModel`, the Keras model whose JAX
  ``train_step`` clips per-example gradients under ``jit``;
* :mod:`~lipdp.clipped.jax.per_example` -- per-example gradients (``vmap`` of ``grad``),
  their norms, the clipping factors and the clipped sum, with the sensitivity argument;
* :mod:`~lipdp.clipped.jax.ghost` -- ghost norms (``gradient_method="ghost"``, the
  default): the same norms and clipped sum from ``Dense``/``Conv2D`` inputs and output
  cotangents, without per-example gradients;
* :mod:`~lipdp.clipped.jax.isolation` -- rule S2 by construction (each row's loss on a
  batch of one under ``vmap``), and the primitives that would break it, refused;
* :mod:`~lipdp.clipped.jax.keys` -- the noise keys (rule S8);
* :mod:`~lipdp.clipped.jax.ledger` -- the privacy ledger held exactly in JAX variables
  (rule S10), read by the shared :class:`lipdp.core.ledger.PrivacyLedger`;
* :mod:`~lipdp.clipped.jax.batches` -- padded Poisson batches in numpy.

``lipdp.make_private`` returns a :class:`DPSGD_JaxModel` under the JAX backend; the
accounting (:mod:`lipdp.accounting`), ``lipdp.DP_Accountant`` and ``privacy_report`` are
shared with the TensorFlow models. Importing this package imports neither JAX nor the
model (import :mod:`lipdp.clipped.jax.model` for it).
"""
