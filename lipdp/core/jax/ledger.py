r"""The privacy ledger of the JAX step: :mod:`lipdp.core.ledger`'s rows, held exactly.

The TensorFlow models keep the ledger in a ``float64`` table and ``int64`` counts. JAX
without ``jax_enable_x64`` (its default, which lipdp does not change) stores ``float64`` as
``float32``: a noise multiplier rounded to ``float32`` could round *down*, and the ledger
would price a smaller ``sigma`` than ran (rule S10) or, rounded up, under-state epsilon.
So the same table is stored bit for bit: every ``float64`` entry as its two 32-bit words
in an ``int32`` variable of shape ``(CAPACITY, 2 * WIDTH)`` (:class:`Float64Words`); the
counts are ``int32`` (2^31 steps). :class:`lipdp.core.ledger.PrivacyLedger` reads both
through :class:`Float64Words`, so plans, ``DP_Accountant`` and ``privacy_report`` price
the JAX model's releases with the TensorFlow models' code.

**In a file** the ledger is the TensorFlow models' ``float64`` table and ``int64``
counts, converted from and to the words on the host (:func:`file_entries`,
:func:`from_file`: exact, since the words are the float64's bits), so that one ``.keras``
file loads on either backend; a table or counts that cannot be held exactly are refused.

**Recording inside the step.** A compiled step releases one mechanism, fixed when it is
traced (``sigma``, ``q``, ``b``, ``N``, the sampling): its row is a constant of the step.
*Where* its run is counted is decided inside the step, from the table the step receives
(:func:`recorded`), by the rule of ``PrivacyLedger.record``
(:func:`lipdp.core.ledger.placement` in numpy): the first row already holding that
mechanism, else the first empty regular row, else its kind's overflow row, merged into a
dominating mechanism. Deciding it when the step is compiled would not do: Keras' JAX
``fit`` compiles the step before ``on_train_begin``, where ``BackupAndRestore`` restores
the ledger, and a callback may load or set weights (the ledger with them) between two
epochs; the step would then write its row over a restored one and price past steps at
today's mechanism. The same function records runs outside a step
(:func:`record_on_host`).

**Exact without float64.** Everything is done on the ``int32`` words:

* two rows are the same mechanism when their words are equal: every value a ledger holds
  is a non-negative float64 that is not NaN, written as ``+0.0`` for zero (a row is
  checked when the step is traced, and the table is only written from such rows), and for
  such values equality of the numbers is equality of their bits;
* a row is empty when its ``KIND`` is ``0.0``: both words 0 once the sign bit is masked
  (so ``-0.0`` counts as empty, as ``== 0.0`` says);
* the overflow merge needs the minimum and the maximum of two values. For a non-negative
  IEEE-754 double (sign bit 0) with biased exponent ``E`` and mantissa ``M``, the bit
  pattern read as an unsigned 64-bit integer is ``U = E 2^52 + M``, and the value
  (``M 2^-1074`` when ``E = 0``, denormals and zero; ``(1 + M 2^-52) 2^(E - 1023)``
  otherwise; ``+inf`` at ``E = 2047, M = 0``) is strictly increasing in ``U``: within one
  ``E`` it increases with ``M``, and the largest value of exponent ``E``, below
  ``2^(E - 1022)``, is below the smallest of exponent ``E + 1``, which is ``2^(E - 1022)``.
  So numbers compare as ``U = 2^32 H + L`` does, ``H`` and ``L`` the high and low words
  read unsigned: lexicographically on ``(H, L)``. ``H < 2^31`` (sign bit 0), so ``H`` read
  as a signed ``int32`` is the same number; ``L`` is compared unsigned by flipping its top
  bit and reading it signed (``u -> u - 2^31``, increasing). :func:`word_less` is that
  order; ``tests/clipped/jax/test_ledger_words.py`` checks it against numpy's float64 order on
  random values, zeros, denormals, ``1e308`` and ``inf``.
"""

from __future__ import annotations

import numpy as np

from lipdp.core.ledger import (
    CAPACITY,
    KIND,
    KINDS,
    MERGED,
    WIDTH,
    PrivacyLedger,
    minimum_columns,
)


class Float64Words:
    """A ``(CAPACITY, WIDTH)`` float64 table stored in an ``int32`` Keras variable, two
    words per entry (module docstring); ``numpy()`` and ``assign`` speak float64."""

    def __init__(self, variable):
        self.variable = variable

    @staticmethod
    def words(table) -> np.ndarray:
        """The ``int32`` words of a float64 table (native byte order, as numpy views it)."""
        return np.ascontiguousarray(table, dtype=np.float64).view(np.int32)

    def numpy(self) -> np.ndarray:
        return np.ascontiguousarray(self.variable.numpy(), dtype=np.int32).view(np.float64)

    def assign(self, table) -> None:
        self.variable.assign(self.words(table))


#: The largest count or step number an ``int32`` variable holds.
INT32_MAX = 2**31 - 1


def file_entries(table_words, counts) -> tuple:
    """The ledger as a file holds it on every backend: the TensorFlow models' ``float64``
    table of shape ``(CAPACITY, WIDTH)`` and ``int64`` counts, read exactly from the
    words (the words of a float64 entry are its bits, :class:`Float64Words`)."""
    table = np.ascontiguousarray(np.asarray(table_words), dtype=np.int32).view(np.float64)
    return table.copy(), np.asarray(counts).astype(np.int64)


def from_file(table, counts) -> tuple:
    """The ``int32`` words and counts of a ledger read from a file (:func:`file_entries`'s
    layout, or the words of files written by lipdp's JAX models before it), exactly, or a
    one-line refusal (rule S10: a ledger that cannot be read is never loaded as an empty
    or smaller one): a table of another shape or type, a NaN or a negative entry (not a
    ledger row, :func:`row_words`), counts that are negative, not integers, or beyond
    ``int32``."""
    table, counts = np.asarray(table), np.asarray(counts)
    fix = "load it with the lipdp version and backend that wrote it"
    if table.shape == (CAPACITY, WIDTH) and table.dtype == np.float64:
        words = Float64Words.words(table + 0.0)  # -0.0 (an empty kind) written +0.0
    elif table.shape == (CAPACITY, 2 * WIDTH) and table.dtype == np.int32:
        words, table = table, np.ascontiguousarray(table).view(np.float64)
    else:
        raise ValueError(
            f"The privacy ledger in this file is a {table.dtype} table of shape {table.shape}, "
            f"not a lipdp ledger (float64 {(CAPACITY, WIDTH)}): it cannot be read; {fix}."
        )
    if np.isnan(table).any() or (table < 0).any():
        raise ValueError(
            f"The privacy ledger in this file holds a NaN or a negative value: it cannot be "
            f"read; {fix}."
        )
    if (
        counts.shape != (CAPACITY,)
        or counts.dtype.kind not in "iu"
        or (counts < 0).any()
        or (counts > INT32_MAX).any()
    ):
        raise ValueError(
            f"The privacy ledger counts in this file ({counts.dtype}, shape {counts.shape}) are "
            f"not {CAPACITY} counts between 0 and {INT32_MAX} (the JAX models' int32): they "
            "cannot be read; load the file on the TensorFlow backend (int64 counts)."
        )
    return np.ascontiguousarray(words, np.int32), counts.astype(np.int32)


def create_variables(name="privacy_ledger"):
    """The two variables of an empty ledger (model attributes: saved with the weights)."""
    import keras

    table = keras.Variable(
        np.zeros([CAPACITY, 2 * WIDTH], np.int32), dtype="int32", trainable=False,
        name=f"{name}_table_words",
    )  # fmt: skip
    counts = keras.Variable(
        np.zeros([CAPACITY], np.int32), dtype="int32", trainable=False, name=f"{name}_counts"
    )
    return table, counts


class WordsLedger(PrivacyLedger):
    """The :class:`~lipdp.core.ledger.PrivacyLedger` of the JAX variables: it reads the
    table through :class:`Float64Words` and records on the host by :func:`recorded` (the
    rule of ``PrivacyLedger.record``), so that everything else -- reading, ``snapshot``,
    ``keep_at_least``, ``add`` -- is the shared class's."""

    def __init__(self, table_words, counts):
        super().__init__(Float64Words(table_words), counts)

    @property
    def storage(self):
        """The ``int32`` words variable (a new :class:`Float64Words` wraps it per view)."""
        return self.table.variable

    def record(self, row, count=1) -> None:
        record_on_host(self.table.variable, self.counts, row, count)


def ledger_view(table_words, counts) -> PrivacyLedger:
    """The :class:`~lipdp.core.ledger.PrivacyLedger` reading these variables."""
    return WordsLedger(table_words, counts)


#: Where the high word (sign, exponent, top of the mantissa) of a float64 is among its two
#: ``int32`` words, in the native byte order :meth:`Float64Words.words` uses (1 on
#: little-endian machines).
HIGH = int(np.flatnonzero(np.array([1.0]).view(np.int32))[0])
LOW = 1 - HIGH
_SIGN = -(2**31)  # the int32 with only the top bit set


def row_words(row) -> np.ndarray:
    """The ``2 * WIDTH`` words of one ledger row, refusing values the word arithmetic does
    not order (module docstring): negative or NaN; ``-0.0`` is written ``+0.0``."""
    row = np.asarray(row, np.float64)
    if row.shape != (WIDTH,) or np.isnan(row).any() or (row < 0).any():
        raise ValueError(f"A ledger row is {WIDTH} non-negative numbers, got {row!r}.")
    return Float64Words.words((row + 0.0)[None])[0]


def word_less(a, b):
    """``a < b`` for float64 values given as ``(..., 2)`` int32 words (in-graph): exact for
    non-negative values that are not NaN (module docstring)."""
    a_high, b_high = a[..., HIGH], b[..., HIGH]
    a_low, b_low = a[..., LOW] ^ _SIGN, b[..., LOW] ^ _SIGN
    return (a_high < b_high) | ((a_high == b_high) & (a_low < b_low))


def _word_minimum(a, b):
    import jax.numpy as jnp

    return jnp.where(word_less(b, a)[..., None], b, a)


def _word_maximum(a, b):
    import jax.numpy as jnp

    return jnp.where(word_less(a, b)[..., None], b, a)


def _is_zero(value):
    """``value == 0.0`` for ``(..., 2)`` words: both words 0, the sign bit aside."""
    return ((value[..., HIGH] & ~_SIGN) == 0) & (value[..., LOW] == 0)


def _dominating(old, new, kind):
    """:func:`lipdp.core.ledger._dominating` on words: a row dominating ``old`` (an overflow
    row, maybe empty) and ``new`` (both ``(2 * WIDTH,)`` int32)."""
    import jax.numpy as jnp

    old, new = jnp.reshape(old, (WIDTH, 2)), jnp.reshape(new, (WIDTH, 2))
    by_minimum = np.zeros(WIDTH, bool)
    by_minimum[list(minimum_columns(kind))] = True
    merged = jnp.where(by_minimum[:, None], _word_minimum(old, new), _word_maximum(old, new))
    merged = merged.at[KIND].set(new[KIND])
    merged = merged.at[MERGED].set(jnp.asarray(Float64Words.words(np.ones(1))))
    return jnp.reshape(jnp.where(_is_zero(old[KIND]), new, merged), (2 * WIDTH,))


def recorded(table_words, counts, row, count=1):
    """``(table_words, counts)`` after ``count`` runs of the mechanism ``row`` (a float64
    row, :func:`lipdp.core.ledger.step_row`) are added where ``PrivacyLedger.record`` adds
    them: placed from the values given (in-graph under ``jit``; eager on the host), with
    ``row`` a constant (module docstring)."""
    import jax.numpy as jnp

    new = jnp.asarray(row_words(row))
    kind = int(np.asarray(row)[KIND])
    regular = CAPACITY - len(KINDS)
    overflow = regular + KINDS.index(kind)
    table_words = jnp.asarray(table_words, jnp.int32)
    head = table_words[:regular]
    same = jnp.all(head == new[None], axis=1)
    empty = _is_zero(jnp.reshape(head, (regular, WIDTH, 2))[:, KIND])
    # The first row holding this mechanism, else the first empty one (argmax: the first).
    score = 2 * same.astype(jnp.int32) + empty.astype(jnp.int32)
    best = jnp.argmax(score)
    found = score[best] > 0
    target = jnp.where(found, best, overflow)
    written = jnp.where(found, new, _dominating(table_words[overflow], new, kind))
    at_target = jnp.arange(CAPACITY) == target
    table_words = jnp.where(at_target[:, None], written[None], table_words)
    return table_words, counts + at_target.astype(counts.dtype) * count


def record_on_host(table_words, counts, row, count=1) -> None:
    """Add ``count`` runs of ``row`` to the variables now, outside a step (restoring a
    ledger that weights loaded from an older state would rewind), by :func:`recorded`."""
    import jax.numpy as jnp

    table, runs = recorded(table_words.numpy(), jnp.asarray(counts.numpy(), jnp.int32), row, count)
    table_words.assign(np.asarray(table))
    counts.assign(np.asarray(runs))


__all__ = [
    "Float64Words",
    "WordsLedger",
    "create_variables",
    "file_entries",
    "from_file",
    "ledger_view",
    "record_on_host",
    "recorded",
    "row_words",
    "word_less",
]
