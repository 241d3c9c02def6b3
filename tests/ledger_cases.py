"""Ledger tables for the tests of the rule every ledger places a run by.

``PrivacyLedger.record`` (TensorFlow), :func:`lipdp.core.ledger.placement` (numpy) and the
JAX step's :func:`lipdp.clipped.jax.ledger.recorded` (on int32 words) must put a run in
the same row and write the same values there. :func:`ledger_cases` draws the tables they
are compared on: empty, random with holes, full, with the mechanism present or absent, and
overflowing into an empty or an occupied overflow row of every kind, with values spread
over the whole non-negative float64 range (zeros, denormals, ``1e308``, ties) so that the
overflow merge's minima and maxima are exercised. No TensorFlow or JAX here: both the
TensorFlow and the JAX test processes import it.
"""

from __future__ import annotations

import numpy as np

from lipdp.core.ledger import CAPACITY, KIND, KINDS, MERGED, WIDTH

REGULAR = CAPACITY - len(KINDS)

#: Values of the non-kind columns: zero, denormals, the smallest normal, ordinary numbers,
#: numbers one ulp apart (equal high words), and the top of the range.
SPECIAL = np.array(
    [
        0.0,
        5e-324,
        2.2250738585072009e-308,
        2.2250738585072014e-308,
        1e-300,
        0.125,
        0.5,
        1.0,
        np.nextafter(1.0, 2.0),
        1.0 + 2.0**-21,  # the low word's top bit set: its unsigned order matters
        1.0 + 2.0**-21 + 2.0**-52,
        2.0,
        8.0,
        64.0,
        1e308,
        np.finfo(np.float64).max,
    ]
)


#: The smallest normal float64: TensorFlow's CPU kernels flush smaller (denormal) values to
#: zero, numpy and JAX's integer words do not.
TINY = np.finfo(np.float64).tiny


def _random_row(rng, kind=None, denormals=True) -> np.ndarray:
    """A row of ``kind`` (random if ``None``) with every other column drawn from
    :data:`SPECIAL` or log-uniformly over ``[1e-310, 1e308]`` (without denormals: none
    below :data:`TINY` but 0)."""
    special = SPECIAL if denormals else SPECIAL[(SPECIAL == 0.0) | (SPECIAL >= TINY)]
    row = np.where(
        rng.random(WIDTH) < 0.5,
        rng.choice(special, WIDTH),
        10.0 ** rng.uniform(-310 if denormals else -307, 308, WIDTH),
    )
    row[KIND] = rng.choice(KINDS) if kind is None else kind
    row[MERGED] = rng.integers(0, 2)
    return row


def ledger_cases(seed=0, random_tables=24, denormals=True):
    """``[(name, table, counts, row)]``: a float64 ``(CAPACITY, WIDTH)`` table, its int
    counts (positive on occupied rows) and the row of the run to record; with
    ``denormals=False``, no value is denormal (for TensorFlow, :data:`TINY`)."""
    rng = np.random.default_rng(seed)
    cases = []

    def random_row(rng, kind=None):
        return _random_row(rng, kind, denormals)

    def add(name, table, row):
        counts = np.where(table[:, KIND] != 0.0, rng.integers(1, 1000, CAPACITY), 0)
        cases.append((name, table, counts, row))

    add("empty", np.zeros((CAPACITY, WIDTH)), random_row(rng))
    pool = [random_row(rng) for _ in range(12)]
    for k in range(random_tables):  # holes, repeats, the row present or not
        table = np.zeros((CAPACITY, WIDTH))
        occupied = rng.choice(REGULAR, size=int(rng.integers(1, REGULAR)), replace=False)
        table[occupied] = [pool[i] for i in rng.integers(0, len(pool), occupied.size)]
        if rng.random() < 0.3:
            table[REGULAR + rng.integers(0, len(KINDS))] = random_row(rng)
        add(f"random-{k}", table, pool[rng.integers(0, len(pool))].copy())
    for kind in KINDS:
        full = np.stack([random_row(rng) for _ in range(CAPACITY)])
        full[REGULAR:] = 0.0
        add(f"full-present-{kind}", full.copy(), full[rng.integers(0, REGULAR)].copy())
        add(f"full-overflow-empty-{kind}", full.copy(), random_row(rng, kind))
        for k in range(3):
            table = full.copy()
            overflow = REGULAR + KINDS.index(kind)
            table[overflow] = random_row(rng, kind)
            row = random_row(rng, kind)
            ties = (rng.random(WIDTH) < 0.3) & (k > 0)  # case 0: no column equal
            row[ties] = table[overflow][ties]
            row[KIND] = kind
            add(f"full-overflow-merge-{kind}-{k}", table, row)
        # A full table and the row present only in an overflow row: the overflow again.
        table = full.copy()
        row = random_row(rng, kind)
        table[REGULAR + KINDS.index(kind)] = row
        add(f"full-overflow-holds-row-{kind}", table, row.copy())
    return cases


def expected_after(table, counts, row, index, written):
    """The table and counts once ``written`` is put at ``index`` and its count raised."""
    table, counts = np.array(table, np.float64), np.array(counts)
    table[index] = written
    counts[index] += 1
    return table, counts


def same_bits(a, b) -> bool:
    """Equal float64 arrays bit for bit."""
    a, b = np.ascontiguousarray(a, np.float64), np.ascontiguousarray(b, np.float64)
    return a.shape == b.shape and np.array_equal(a.view(np.uint64), b.view(np.uint64))
