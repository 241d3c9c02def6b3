"""The foundation every other part of lipdp stands on, below :mod:`lipdp.accounting`:
configuration objects (:mod:`~lipdp.foundation.config`), argument validation
(:mod:`~lipdp.foundation.validation`), dataset metadata (:mod:`~lipdp.foundation.metadata`),
the Keras-version differences (:mod:`~lipdp.foundation.compat`), variable keys
(:mod:`~lipdp.foundation.variables`) and the walk of every layer
(:mod:`~lipdp.foundation.layer_walk`).

Its modules import no other part of lipdp (``tests/test_architecture.py``): the accountants
build on it, the private model (:mod:`lipdp.core`) builds on both, so no import runs back
up. Nothing is imported here, so that ``lipdp.foundation.compat`` can run before TensorFlow
is imported. The former paths (``lipdp.core.metadata``, ...) still import these modules.
"""
