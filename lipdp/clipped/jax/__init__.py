"""The clipped family on Keras 3's JAX backend (``KERAS_BACKEND=jax``).

One module per concept:

* :mod:`~lipdp.clipped.jax.model` -- :class:`DPSGD_JaxModel`, the Keras model whose JAX
  ``train_step`` clips per-example gradients under ``jit``;
* :mod:`~lipdp.clipped.jax.per_example` -- per-example gradients (``vmap`` of ``grad``),
  their norms, the clipping factors and the clipped sum, with the sensitivity argument;
* :mod:`~lipdp.clipped.jax.ghost` -- ghost norms (``gradient_method="ghost"``, the
  default): the same norms and clipped sum from ``Dense``/``Conv2D`` inputs and output
  cotangents, without per-example gradients;
* the step skeleton both families share and its parts moved to :mod:`lipdp.core.jax`
  (issue 38 item 5): :class:`~lipdp.core.jax.trainer.JaxPrivateTrainer` (the base of
  :class:`DPSGD_JaxModel`), :mod:`~lipdp.core.jax.isolation` (rule S2's refused
  primitives), :mod:`~lipdp.core.jax.keys` (rule S8), :mod:`~lipdp.core.jax.ledger` (rule
  S10) and :mod:`~lipdp.core.jax.batches` (padded Poisson batches); their former paths
  here still import them.

``lipdp.make_private`` returns a :class:`DPSGD_JaxModel` under the JAX backend; the
accounting (:mod:`lipdp.accounting`), ``lipdp.DP_Accountant`` and ``privacy_report`` are
shared with the TensorFlow models. Importing this package imports neither JAX nor the
model (import :mod:`lipdp.clipped.jax.model` for it).
"""
