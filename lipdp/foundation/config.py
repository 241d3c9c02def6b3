"""The base of lipdp's configuration objects: :class:`Config`.

``DPParameters``, ``DatasetMetadata``, ``Clipping``, ``SharpnessAscent``, ``PGD``,
``RandomSearch``, ``DynamicClippingSpec``, the accountants' mechanisms and releases,
the ``PrivacyPlan`` and the run recipes (``ModelRecipe``, ``RunConfig``,
``EvaluationConfig``) are frozen dataclasses: a model, its privacy
plan and its traced step read the same instance, so a value changed after a plan was
made would make the plan wrong (``dataclasses.replace`` gives a variant). Each validates
and normalises its fields in ``__post_init__`` (:meth:`Config._set`), and all share one
serialisation: :meth:`Config.to_config` is a dict of plain values (tuples as lists,
nested configurations as their dicts: what JSON and Keras' ``get_config`` hold),
:meth:`Config.from_config` its inverse, :meth:`Config.coerce` accepts an instance, its
dict, or ``None`` where the field is optional. Imports nothing of lipdp.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar


@dataclass(frozen=True)
class Config:
    """A frozen, validated, serialisable configuration (module docstring)."""

    #: what the object is called in ``coerce``'s error message (the argument's name).
    argument_name: ClassVar[str] = "configuration"
    #: whether ``coerce(None)`` is ``None`` (an optional setting) or an error.
    optional: ClassVar[bool] = True

    def _set(self, name: str, value) -> None:
        """Normalise a field in ``__post_init__`` (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    def to_config(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.init}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)

    @classmethod
    def coerce(cls, value):
        """An instance, its config dict, or ``None`` when the setting is optional."""
        if value is None and cls.optional:
            return None
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_config(dict(value))
        raise TypeError(
            f"{cls.argument_name} must be a {cls.__name__} or its config dict, got {value!r}."
        )


def _plain(value):
    """``value`` as JSON holds it: tuples as lists, configurations as their dicts."""
    if isinstance(value, Config):
        return value.to_config()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


__all__ = ["Config"]
