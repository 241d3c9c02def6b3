"""``row_isolation`` on the JAX backend: its step always computes each example's loss on
its own (``jax.vmap`` over the rows), so ``make_private(..., row_isolation=True)`` is what
it does and ``row_isolation=False`` is refused in one line."""

import pytest

import lipdp
from tests.clipped.jax import helpers as h


def _made(**options):
    return lipdp.make_private(h.mlp(), epsilon=1.0, delta=1e-5, epochs=1, batch_size=8,
                              dataset_size=32, **options)  # fmt: skip


def test_row_isolation_is_what_the_jax_step_does():
    assert _made(row_isolation=True).dataset_metadata.batch_size == 8
    with pytest.raises(ValueError, match="row_isolation=False is not available on the JAX"):
        _made(row_isolation=False)
