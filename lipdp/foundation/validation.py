"""Argument validators shared by every module of lipdp.

Each returns the value converted to its canonical type or raises ``ValueError`` with a
one-line message naming the argument, what it must be and what was given.
(:mod:`lipdp.foundation.metadata` keeps its own two-line check: it imports nothing of lipdp.)
"""

from __future__ import annotations

import logging
import math
import numbers


def real(name, value, *, low=None, high=None, low_open=True, high_open=True) -> float:
    """A finite real number, optionally in an interval (open ends by default)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}.")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}.")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value!r}.")
    return value


def positive(name, value) -> float:
    """A finite number ``> 0``."""
    return real(name, value, low=0.0)


def non_negative(name, value) -> float:
    """A finite number ``>= 0``."""
    return real(name, value, low=0.0, low_open=False)


def probability(name, value) -> float:
    """A sampling rate in ``(0, 1]``."""
    return real(name, value, low=0.0, high=1.0, high_open=False)


def open_unit(name, value) -> float:
    """A number in the open interval ``(0, 1)`` (quantiles, fractions)."""
    return real(name, value, low=0.0, high=1.0)


def delta(value, name="delta") -> float:
    """The ``delta`` of an ``(epsilon, delta)`` guarantee, in ``(0, 1)``."""
    try:
        return open_unit(name, value)
    except ValueError as error:
        raise ValueError(f"{error} {name} must be in the open interval (0, 1).") from None


def delta_for_dataset(
    value, n, *, allow_large=False, name="delta", force="allow_large_delta=True"
) -> float:
    """``value``, the ``delta`` of an ``(epsilon, delta)`` guarantee on ``n`` records,
    refused at ``delta >= 1/n`` unless ``allow_large`` (the one rule; the CLI names
    ``--delta`` / ``--allow-large-delta``, the library ``delta`` / ``allow_large_delta``).

    Why: ``delta`` bounds the probability that the guarantee fails. The mechanism that
    publishes one record drawn uniformly at random is ``(0, 1/n)``-DP (neighbouring data
    sets change what it publishes only on the draw of the differing record, probability
    ``1/n``), so any ``delta >= 1/n`` is met by a release that exposes a whole record: it
    protects no one. The usual choice is ``delta`` well below ``1/n`` (``1e-5``, ``1/n^1.1``).
    """
    value = delta(value, name)
    n = count("n", n, minimum=1)
    if value < 1.0 / n:
        return value
    if allow_large:
        logging.getLogger(__name__).warning(
            "%s = %g >= 1/N = %.3g, kept as forced: the guarantee is met by a mechanism "
            "that releases one record at random.",
            name,
            value,
            1.0 / n,
        )
        return value
    suggestion = 10.0 ** math.floor(math.log10(1.0 / n) - 1e-9)  # a power of ten below 1/N
    raise ValueError(
        f"{name} {value:g} >= 1/N = {1.0 / n:.3g} (N = {n} training examples): delta is the "
        "probability the guarantee fails, and with delta >= 1/N a mechanism releasing one "
        f"record at random meets it; give {name} below {1.0 / n:.3g} (e.g. {suggestion:g}), "
        f"or {force} to keep it."
    )


def count(name, value, minimum=0) -> int:
    """An integer ``>= minimum`` (an integral float such as ``3.0`` is accepted)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    if isinstance(value, numbers.Integral):
        out = int(value)
    elif isinstance(value, numbers.Real) and float(value).is_integer():
        out = int(value)
    else:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    if out < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return out


def choice(name, value, options):
    """One of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}.")
    return value


def int_pair(name, value) -> tuple[int, int]:
    """An int ``k`` (meaning ``(k, k)``) or a pair of ints: kernel sizes, strides, pools."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return (int(value), int(value))
    try:
        pair = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}.") from None
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}.")
    return pair


__all__ = [
    "real",
    "positive",
    "non_negative",
    "probability",
    "open_unit",
    "delta",
    "delta_for_dataset",
    "count",
    "choice",
    "int_pair",
]
