"""The JAX ledger's arithmetic on int32 words (:mod:`lipdp.clipped.jax.ledger`), against
numpy's float64: the order of non-negative doubles read from their words, and the in-graph
placement of a run (``recorded``) against :func:`lipdp.core.ledger.placement`, under
``jit``. ``tests/core/test_privacy_ledger.py`` compares all three placements (TensorFlow's
``PrivacyLedger.record`` too) on the same tables, eagerly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lipdp.clipped.jax import ledger
from lipdp.clipped.jax.ledger import Float64Words
from lipdp.core.ledger import CAPACITY, WIDTH, placement, step_row
from tests.ledger_cases import SPECIAL, expected_after, ledger_cases, same_bits
from tests.marks import thorough


def _values():
    """Edge values and random ones: random bit patterns of every non-negative double but
    NaN (uniform over the patterns: every exponent), and their neighbours."""
    rng = np.random.default_rng(0)
    top = np.float64(np.inf).view(np.uint64)
    patterns = rng.integers(0, int(top), size=300, dtype=np.uint64, endpoint=True)
    values = np.concatenate([SPECIAL, [np.inf, 1.0 + 2.0**-20], patterns.view(np.float64)])
    below_max = values[values < np.finfo(np.float64).max]
    values = np.concatenate([values, np.nextafter(below_max, np.inf)])
    assert not np.isnan(values).any() and (values >= 0).all()
    return values


def _words(values):
    return Float64Words.words(values).reshape(-1, 2)


def test_word_order_is_the_order_of_non_negative_doubles():
    values = _values()
    a, b = np.meshgrid(values, values, indexing="ij")
    a, b = a.ravel(), b.ravel()
    wa, wb = jnp.asarray(_words(a)), jnp.asarray(_words(b))
    less, low, high = jax.jit(
        lambda x, y: (
            ledger.word_less(x, y),
            ledger._word_minimum(x, y),  # noqa: SLF001
            ledger._word_maximum(x, y),  # noqa: SLF001
        )
    )(wa, wb)
    np.testing.assert_array_equal(np.asarray(less), a < b)
    as_float = np.ascontiguousarray(np.asarray(low)).view(np.float64).ravel()
    assert same_bits(as_float, np.minimum(a, b))
    as_float = np.ascontiguousarray(np.asarray(high)).view(np.float64).ravel()
    assert same_bits(as_float, np.maximum(a, b))


def test_a_row_is_refused_unless_non_negative_and_not_nan_and_zero_is_positive():
    row = step_row(1.0, 8, 64, True, 1)
    for bad in (-1e-300, np.nan):
        broken = row.copy()
        broken[1] = bad
        with pytest.raises(ValueError, match="non-negative numbers"):
            ledger.row_words(broken)
    negative_zero, zero = row.copy(), row.copy()
    negative_zero[1], zero[1] = -0.0, 0.0
    np.testing.assert_array_equal(ledger.row_words(negative_zero), ledger.row_words(zero))


#: One case of every path, compiled by default: the rest of ledger_cases() is thorough.
PATHS = (
    "empty",
    "random-0",  # holes: the first row holding the mechanism, else the first empty one
    "full-present-1",
    "full-overflow-empty-1",
    "full-overflow-merge-1-0",  # sigma merged by its minimum
    "full-overflow-merge-3-0",  # Laplace epsilon merged by its maximum
    "full-overflow-holds-row-4",
)


@pytest.mark.parametrize("cases", [PATHS, pytest.param(None, marks=thorough)], ids=["paths", "all"])
def test_the_step_places_a_run_as_placement_does_under_jit(cases):
    """Every path (own row, first empty row past holes, overflow into an empty and into an
    occupied overflow row of each kind), compiled as in the step."""
    chosen = [c for c in ledger_cases(seed=1) if cases is None or c[0] in cases]
    assert len(chosen) == (len(ledger_cases(seed=1)) if cases is None else len(PATHS))
    for name, table, counts, row in chosen:
        step = jax.jit(lambda t, c, row=row: ledger.recorded(t, c, row))
        words, runs = step(jnp.asarray(Float64Words.words(table)), jnp.asarray(counts, jnp.int32))
        index, written = placement(table, row)
        want_table, want_counts = expected_after(table, counts, row, index, written)
        got = np.ascontiguousarray(np.asarray(words)).view(np.float64)
        assert got.shape == (CAPACITY, WIDTH)
        assert same_bits(got, want_table), name
        np.testing.assert_array_equal(np.asarray(runs), want_counts, err_msg=name)
