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

**Recording inside the step.** A compiled step releases one mechanism, fixed when it is
traced (``sigma``, ``q``, ``b``, ``N``, the sampling). Where its run is counted is
decided on the host before training, by :func:`lipdp.core.ledger.placement` (the rule of
``PrivacyLedger.record``, in numpy): the row already holding that mechanism, else the
first empty row, else its kind's overflow row, merged into a dominating mechanism. The
step then writes that row's words and adds 1 to its count (:func:`recorded`): no
``float64`` arithmetic under ``jit``. Nothing else writes the ledger during a ``fit``,
so the place stays right for every step; it is decided again before each ``fit``.
"""

from __future__ import annotations

import numpy as np

from lipdp.core.ledger import CAPACITY, WIDTH, PrivacyLedger, placement


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


def ledger_view(table_words, counts) -> PrivacyLedger:
    """The :class:`~lipdp.core.ledger.PrivacyLedger` reading these variables."""
    return PrivacyLedger(Float64Words(table_words), counts)


def planned_write(table_words, row) -> tuple[int, np.ndarray]:
    """``(index, words)``: where a step releasing the mechanism ``row``
    (:func:`lipdp.core.ledger.step_row`) counts its run, and the words it writes there."""
    index, written = placement(Float64Words(table_words).numpy(), row)
    return index, Float64Words.words(written[None])[0]


def recorded(table_words, counts, index, words):
    """``(table_words, counts)`` after one run recorded at ``index`` (in-graph, values)."""
    import jax.numpy as jnp

    table_words = table_words.at[index].set(jnp.asarray(words, jnp.int32))
    return table_words, counts.at[index].add(1)


def record_on_host(table_words, counts, row, count=1) -> None:
    """Add ``count`` runs of ``row`` now, outside a step (restoring a ledger that weights
    loaded from an older state would rewind)."""
    index, words = planned_write(table_words, row)
    values = np.array(table_words.numpy())
    values[index] = words
    table_words.assign(values)
    runs = np.array(counts.numpy())
    runs[index] += count
    counts.assign(runs)


def keep_at_least(table_words, counts, snapshot) -> None:
    """Every row of ``snapshot`` (``(float64 table, counts)``) counted at least as many
    times as there (as :meth:`PrivacyLedger.keep_at_least`)."""
    for row, count in zip(*snapshot):
        if count == 0:
            continue
        table, now = Float64Words(table_words).numpy(), counts.numpy()
        same = np.all(table == row, axis=1)
        have = int(now[same].sum()) if same.any() else 0
        if count > have:
            record_on_host(table_words, counts, row, int(count - have))


__all__ = [
    "Float64Words",
    "create_variables",
    "keep_at_least",
    "ledger_view",
    "planned_write",
    "record_on_host",
    "recorded",
]
