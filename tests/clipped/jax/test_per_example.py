"""Per-example gradients, norms and the clipped sum of the JAX step, against independent
computations: one ``jax.grad`` per row in a Python loop and float64 numpy."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from lipdp.clipped.clipping import Clipping
from lipdp.clipped.jax import per_example
from tests.clipped.jax import helpers as h


def _loop_gradients(model, x, y):
    """Row by row: ``jax.grad`` of the Keras loss of a batch of one, through the model's
    own stateless call (the independent computation)."""
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def batch_loss(params, xi, yi):
        y_pred, _ = model.stateless_call(params, non_trainable, xi, training=True)
        return loss(yi, y_pred)

    grad = jax.jit(jax.grad(batch_loss))  # compiled once, called once per row
    rows = []
    for i in range(len(x)):
        grads = grad(trainable, x[i : i + 1], y[i : i + 1])
        rows.append(np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in grads]))
    return np.stack(rows)


def _vmapped(model, x, y):
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    row_loss = model._row_loss_function(non_trainable)

    @jax.jit
    def grads(params, x, y):
        return per_example.per_example_gradients(row_loss, params, x, y)[0]

    return grads(trainable, jnp.asarray(x), jnp.asarray(y))


@pytest.mark.parametrize("network", [h.mlp, h.cnn], ids=["mlp", "cnn"])
def test_per_example_gradients_match_a_loop_over_rows(network):
    model = h.private(network())
    shape = tuple(model.network.input_shape[1:])
    x, y = h.data(7, shape)
    grads = _vmapped(model, x, y)
    flat = np.concatenate([np.asarray(g, np.float64).reshape(7, -1) for g in grads], axis=1)
    np.testing.assert_allclose(flat, _loop_gradients(model, x, y), rtol=2e-5, atol=1e-6)


def test_clipped_sum_matches_float64_numpy():
    model = h.private(h.cnn())
    x, y = h.data(9, (8, 8, 1), scale=30.0)  # large inputs: most rows are clipped
    grads = _vmapped(model, x, y)
    loop = _loop_gradients(model, x, y)
    norms = np.linalg.norm(loop, axis=1)
    weights = np.array([1, 1, 0, 1, 1, 1, 1, 0.5, 1], np.float32)
    expected = ((weights * np.minimum(1.0, 2.0 / norms))[:, None] * loop).sum(axis=0)
    got_norms = per_example.row_norms(grads)
    np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
    factors = Clipping("flat", 2.0).factors(got_norms)
    summed = per_example.clipped_sum(grads, got_norms, factors, jnp.asarray(weights))
    flat = np.concatenate([np.ravel(np.asarray(s, np.float64)) for s in summed])
    assert (norms > 2.0).sum() >= 5
    np.testing.assert_allclose(flat, expected, rtol=1e-4, atol=1e-6)


def test_norms_neither_overflow_nor_underflow_in_float32():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(4, 50))
    scales = np.array([1e30, 1e-30, 1.0, 0.0])
    grads = [jnp.asarray((base * scales[:, None])[:, :20], jnp.float32),
             jnp.asarray((base * scales[:, None])[:, 20:], jnp.float32)]  # fmt: skip
    expected = np.linalg.norm(base, axis=1) * scales
    got = np.asarray(per_example.row_norms(grads), np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # Squared in float32 the first would be inf and the second 0.
    with np.errstate(over="ignore", under="ignore"):
        squares = np.square((base[:2] * scales[:2, None]).astype(np.float32))
    assert np.isinf(squares[0].sum()) and squares[1].sum() == 0.0


@pytest.mark.parametrize(
    "mode,options", [("flat", {}), ("automatic", {}), ("global", {"threshold": 3.0})]
)
def test_every_clipped_term_is_within_the_radius(mode, options):
    rng = np.random.default_rng(1)
    g = jnp.asarray(rng.normal(size=(64, 30)) * np.exp(rng.normal(size=(64, 1)) * 3), jnp.float32)
    norms = per_example.row_norms([g])
    factors = Clipping(mode, 0.7, **options).factors(norms)
    clipped = np.asarray(factors)[:, None].astype(np.float64) * np.asarray(g, np.float64)
    assert np.linalg.norm(clipped, axis=1).max() <= 0.7 * (1 + 1e-6)


def test_non_finite_gradients_are_selected_out_not_multiplied():
    g = jnp.asarray([[1.0, 2.0], [np.nan, 1.0], [np.inf, 0.0], [3.0, 4.0]], jnp.float32)
    norms = per_example.row_norms([g])
    assert np.isnan(norms[1]) and not np.isfinite(norms[2])
    factors = Clipping("flat", 1.0).factors(norms)
    (summed,) = per_example.clipped_sum([g], norms, factors, jnp.ones(4))
    expected = np.array([1.0, 2.0]) / np.sqrt(5.0) + np.array([3.0, 4.0]) / 5.0
    np.testing.assert_allclose(summed, expected, rtol=1e-6)
