"""Former path of :mod:`lipdp.privatize` (``make_private``, ``private_batches``), kept so
that ``from lipdp.entry import make_private`` still works; the code lives there."""

from lipdp.privatize import METHODS, make_private, private_batches

__all__ = ["METHODS", "make_private", "private_batches"]
