"""A key for a model variable in dictionaries and sets, on Keras 2 and Keras 3.

lipdp keeps per-variable facts (noise standard deviations, sensitivities, owning layers,
per-example gradient sums) in dictionaries keyed by the variable. A Keras 3 variable is
not hashable (``==`` is an element-wise tensor operation) and has no ``tf.Variable.ref()``,
so neither the variable nor ``.ref()`` can be the key on both Keras. :func:`variable_key`
is the one key used everywhere: the variable's identity, as ``tf.Variable.ref()`` is
(``Reference`` hashes by ``id``), for any variable-like object. A Keras 3 variable on
TensorFlow keeps its value in a ``tf.Variable``, which is what a ``tf.GradientTape``
watches, and reports in ``watched_variables()``, when the Keras variable is read: both
have one key, so that the variables a tape saw are found among a model's.
"""

from __future__ import annotations


class VariableKey:
    """A hashable reference to one variable, equal only to a key of the same variable: the
    same object, or a Keras 3 variable and the ``tf.Variable`` holding its value
    (:func:`_storage`; both are kept alive with the key, so their ``id`` cannot be reused
    meanwhile)."""

    __slots__ = ("_storage", "_variable")

    def __init__(self, variable):
        self._variable = variable
        self._storage = _storage(variable)

    def deref(self):
        """The variable the key was made from."""
        return self._variable

    def __hash__(self) -> int:
        return id(self._storage)

    def __eq__(self, other) -> bool:
        return isinstance(other, VariableKey) and other._storage is self._storage

    def __repr__(self) -> str:
        return f"VariableKey({getattr(self._variable, 'name', self._variable)!r})"


def _storage(variable):
    """The object that is the variable: a Keras 3 variable's ``tf.Variable`` (set when it is
    initialised: on creation, outside Keras' stateless scopes), else ``variable``."""
    from lipdp.foundation import compat

    if compat.keras_3():
        import keras

        if isinstance(variable, keras.Variable) and variable._value is not None:  # noqa: SLF001
            return variable._value  # noqa: SLF001
    return variable


def variable_key(variable) -> VariableKey:
    """The key of ``variable`` in lipdp's per-variable dictionaries (module doc)."""
    return VariableKey(variable)


def as_one_of(variable, candidates):
    """The variable of ``candidates`` that ``variable`` is (:func:`variable_key`): the Keras 3
    variable behind a ``tf.Variable`` a tape reported, with its Keras name; else
    ``variable``."""
    key = variable_key(variable)
    return next((c for c in candidates if variable_key(c) == key), variable)


def state_variable(value, dtype, name):
    """A non-trainable variable holding privacy state (step count, ledger, clip values):
    a Keras variable on Keras 3, so that a layer or model it is an attribute of saves it
    (``.keras``, ``save_weights``), a ``tf.Variable`` on Keras 2 (which tracks those)."""
    from lipdp.foundation import compat

    if compat.keras_3():
        import keras

        return keras.Variable(value, dtype=dtype, trainable=False, name=name)
    import tensorflow as tf

    return tf.Variable(value, dtype=dtype, trainable=False, name=name)


__all__ = ["VariableKey", "as_one_of", "state_variable", "variable_key"]
