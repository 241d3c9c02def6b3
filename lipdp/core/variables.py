"""A key for a model variable in dictionaries and sets, on Keras 2 and Keras 3.

lipdp keeps per-variable facts (noise standard deviations, sensitivities, owning layers,
per-example gradient sums) in dictionaries keyed by the variable. A Keras 3 variable is
not hashable (``==`` is an element-wise tensor operation) and has no ``tf.Variable.ref()``,
so neither the variable nor ``.ref()`` can be the key on both Keras. :func:`variable_key`
is the one key used everywhere: the variable's identity, as ``tf.Variable.ref()`` is
(``Reference`` hashes by ``id``), for any variable-like object.
"""

from __future__ import annotations


class VariableKey:
    """A hashable reference to one variable object, equal only to a key of the same object
    (the object is kept alive with the key, so its ``id`` cannot be reused meanwhile)."""

    __slots__ = ("_variable",)

    def __init__(self, variable):
        self._variable = variable

    def deref(self):
        """The variable."""
        return self._variable

    def __hash__(self) -> int:
        return id(self._variable)

    def __eq__(self, other) -> bool:
        return isinstance(other, VariableKey) and other._variable is self._variable

    def __repr__(self) -> str:
        return f"VariableKey({getattr(self._variable, 'name', self._variable)!r})"


def variable_key(variable) -> VariableKey:
    """The key of ``variable`` in lipdp's per-variable dictionaries (module doc)."""
    return VariableKey(variable)


def state_variable(value, dtype, name):
    """A non-trainable variable holding privacy state (step count, ledger, clip values):
    a Keras variable on Keras 3, so that a layer or model it is an attribute of saves it
    (``.keras``, ``save_weights``), a ``tf.Variable`` on Keras 2 (which tracks those)."""
    from lipdp.core import compat

    if compat.keras_3():
        import keras

        return keras.Variable(value, dtype=dtype, trainable=False, name=name)
    import tensorflow as tf

    return tf.Variable(value, dtype=dtype, trainable=False, name=name)


__all__ = ["VariableKey", "state_variable", "variable_key"]
