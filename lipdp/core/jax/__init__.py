"""What both families' models share on Keras 3's JAX backend (``KERAS_BACKEND=jax``).

* :mod:`~lipdp.core.jax.trainer` -- :class:`JaxPrivateTrainer`, the stateless private step
  skeleton (rule S9 rows, the noise key, the ledger words, the guards), with the family's
  hooks for the gradient and the projections;
* :mod:`~lipdp.core.jax.keys` -- the noise keys (rule S8);
* :mod:`~lipdp.core.jax.ledger` -- the privacy ledger held exactly in JAX variables
  (rule S10), read by the shared :class:`lipdp.core.ledger.PrivacyLedger`;
* :mod:`~lipdp.core.jax.isolation` -- the primitives that would break row isolation (rule
  S2), refused when a step is traced;
* :mod:`~lipdp.core.jax.batches` -- padded Poisson batches in numpy.

Importing this package imports neither JAX nor TensorFlow.
"""
