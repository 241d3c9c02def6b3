"""What both families share, above :mod:`lipdp.foundation` and :mod:`lipdp.accounting`:
the private model base and its parameters, noise, the privacy ledger, distribution, records
(rule S9), the privacy report and callbacks, the batch-independence checks (rule S12) and
the PGD attack. (Dataset metadata, configuration objects, validation, the Keras-version
differences, variable keys and the layer walk are in :mod:`lipdp.foundation`; their former
paths here still import them.)

Modules here never import :mod:`lipdp.clipless` or :mod:`lipdp.clipped` (checked by
``tests/test_architecture.py``). Nothing is imported here.
"""
