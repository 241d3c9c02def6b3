"""What both families share: the private model base and its parameters, dataset metadata,
noise, the privacy ledger, distribution, records (rule S9), validation, the privacy report
and callbacks, the batch-independence checks (rule S12) and the PGD attack.

Modules here never import :mod:`lipdp.clipless` or :mod:`lipdp.clipped` (checked by
``tests/test_architecture.py``). Nothing is imported here, so that
``lipdp.core.compat`` can run before TensorFlow is imported.
"""
