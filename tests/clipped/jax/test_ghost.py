"""Ghost norms on the JAX step (``gradient_method="ghost"``, lipdp.clipped.jax.ghost)
against per-row ``jax.grad`` and the ``vmap`` path: norms, clipped sums, a real step's
remove-one sensitivity, and the fallback to ``vmap`` outside their scope."""

import logging

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import lipdp
from lipdp.clipped.per_example import dense
from lipdp.clipped.per_example.registry import GhostRule, registered_ghost_rule, rows
from lipdp.core.noise import ROUNDOFF_SLACK
from tests.clipped.jax import helpers as h
from tests.clipped.jax.test_per_example import _loop_gradients

L = keras.layers
ROWS = 9


def _init(index):
    return keras.initializers.GlorotUniform(seed=index)


def linear_mlp():
    """No activation: a row scaled by s has gradients scaled by s (adversarial scales)."""
    return keras.Sequential([
        keras.Input((h.FEATURES,)),
        L.Dense(8, kernel_initializer=_init(1)),
        L.Dense(5, activation="tanh", kernel_initializer=_init(2)),
        L.Dense(h.CLASSES, kernel_initializer=_init(3)),
    ])  # fmt: skip


def sequence(units=16):
    """Dense on (batch, time, features): the Gram path (T (d + p) < d p) for the first
    layer, materialised rows for the second."""
    return keras.Sequential([
        keras.Input((3, 12)),
        L.Dense(units, kernel_initializer=_init(4)),
        L.Dense(2, activation="tanh", kernel_initializer=_init(5)),
        L.Flatten(),
        L.Dense(h.CLASSES, kernel_initializer=_init(6)),
    ])  # fmt: skip


def conv():
    return keras.Sequential([
        keras.Input((8, 8, 2)),
        L.Conv2D(4, 3, padding="same", activation="relu", kernel_initializer=_init(7)),
        L.AveragePooling2D(2),
        L.Conv2D(5, (3, 2), strides=(1, 2), kernel_initializer=_init(8)),
        L.Flatten(),
        L.Dense(h.CLASSES, kernel_initializer=_init(9)),
    ])  # fmt: skip


NETWORKS = {"mlp": h.mlp, "linear_mlp": linear_mlp, "sequence": sequence, "conv": conv}


def _state(model):
    return [v.value for v in model.trainable_variables], [
        v.value for v in model.non_trainable_variables
    ]


def _ghost_norms(model, x, y):
    trainable, non_trainable = _state(model)
    return jax.jit(lambda t, x, y: model._ghost_norms(t, non_trainable, x, y)[2])(
        trainable, jnp.asarray(x), jnp.asarray(y)
    )


def _scaled_rows(shape, seed=0):
    """Rows of norms from 1e-20 to 1e20."""
    x, y = h.data(ROWS, shape, seed=seed)
    x = x / np.linalg.norm(x.reshape(ROWS, -1), axis=1).reshape((-1,) + (1,) * len(shape))
    return (x * np.logspace(-20, 20, ROWS).reshape((-1,) + (1,) * len(shape))).astype("float32"), y


@pytest.mark.parametrize("scaled", [False, True], ids=["random", "scaled"])
@pytest.mark.parametrize("name", list(NETWORKS))
def test_ghost_norms_are_the_per_row_gradient_norms(name, scaled):
    model = h.private(NETWORKS[name](), gradient_method="ghost")
    shape = tuple(model.network.input_shape[1:])
    x, y = _scaled_rows(shape) if scaled else h.data(ROWS, shape, scale=2.0)
    expected = np.linalg.norm(_loop_gradients(model, x, y), axis=1)
    got = np.asarray(_ghost_norms(model, x, y), np.float64)
    assert np.all(np.isfinite(expected)) and np.all(expected > 0)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert np.all(got >= expected * (1 - 1e-6))


def test_the_sequence_network_takes_both_paths():
    assert not dense.materialise(3, 12, 16) and dense.materialise(3, 16, 2)


def test_gram_norms_bound_the_norm_through_cancellation():
    """Two positions whose outer products almost cancel: float32 Grams alone would return
    about 0 (or a negative square); the round-off bound keeps an upper bound."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(4, 1, 40))
    a = np.concatenate([a, a], axis=1)
    g = rng.normal(size=(4, 1, 50))
    g = np.concatenate([g, -g + 1e-6 * rng.normal(size=g.shape)], axis=1)
    exact = np.linalg.norm(np.einsum("btd,btp->bdp", a, g), axis=(1, 2))
    got = np.asarray(dense.gram_norms(jnp.asarray(a, "float32"), jnp.asarray(g, "float32")))
    a32, g32 = a.astype("float32").astype(np.float64), g.astype("float32").astype(np.float64)
    exact32 = np.linalg.norm(np.einsum("btd,btp->bdp", a32, g32), axis=(1, 2))
    assert np.all(got >= exact) and np.all(got >= exact32)
    # Random positions: the bound costs little.
    a, g = rng.normal(size=(4, 5, 40)), rng.normal(size=(4, 5, 50))
    exact = np.linalg.norm(np.einsum("btd,btp->bdp", a, g), axis=(1, 2))
    got = np.asarray(dense.gram_norms(jnp.asarray(a, "float32"), jnp.asarray(g, "float32")))
    assert np.all(got >= exact * (1 - 1e-6))
    np.testing.assert_allclose(got, exact, rtol=1e-4)


@pytest.mark.parametrize("name", list(NETWORKS))
def test_ghost_clipped_sum_is_the_vmap_clipped_sum(name):
    model = h.private(NETWORKS[name](), gradient_method="ghost", clip_norm=0.3)
    shape = tuple(model.network.input_shape[1:])
    x, y = h.data(ROWS, shape, scale=3.0)
    weights = jnp.asarray([1, 1, 0, 1, 0.5, 1, 1, 1, 1], "float32")
    trainable, non_trainable = _state(model)

    @jax.jit
    def both(t, x, y):
        return (
            model._vmap_clipped_sum(t, non_trainable, x, y, weights)[0],
            model._ghost_clipped_sum(t, non_trainable, x, y, weights)[0],
        )

    vmapped, ghosted = both(trainable, jnp.asarray(x), jnp.asarray(y))
    for v, g in zip(vmapped, ghosted):
        assert v.shape == g.shape
        np.testing.assert_allclose(g, v, rtol=1e-4, atol=2e-6)


def test_a_row_with_non_finite_gradients_is_selected_out():
    """A row whose forward overflows (logits infinite, loss and cotangents NaN): the ghost
    sum is finite and equals the sum without that row."""
    model = h.private(linear_mlp(), gradient_method="ghost")
    x, y = h.data(ROWS)
    x[4] = 3e38
    trainable, non_trainable = _state(model)
    ones = jnp.ones(ROWS)
    without = ones.at[4].set(0.0)

    @jax.jit
    def sums(t, x, y):
        return (
            model._ghost_norms(t, non_trainable, x, y)[2],
            model._ghost_clipped_sum(t, non_trainable, x, y, ones)[0],
            model._ghost_clipped_sum(t, non_trainable, x, y, without)[0],
        )

    norms, with_row, without_row = sums(trainable, jnp.asarray(x), jnp.asarray(y))
    assert not np.isfinite(norms[4])
    for a, b in zip(with_row, without_row):
        assert np.all(np.isfinite(a))
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_removing_one_record_moves_a_ghost_update_by_at_most_r_over_b(name, reproducible_noise):
    reproducible_noise(11)
    r, b = 0.5, 8
    x, y = h.data(12, tuple(NETWORKS[name]().input_shape[1:]), scale=20.0)
    full, masked, deleted = [
        h.private(NETWORKS[name](), clip_norm=r, batch_size=b, gradient_method="ghost")
        for _ in range(3)
    ]
    moves = h.remove_one_moves(full, masked, deleted, x, y, row=3)
    assert full.gradient_method_used == "ghost"
    for moved in moves:
        assert 0.9 * r / b <= moved <= r / b * (1 + ROUNDOFF_SLACK) + 1e-6


def test_a_ghost_step_is_the_vmap_step(reproducible_noise):
    x, y = h.data(12, scale=5.0)
    updates = {}
    for method in ("vmap", "ghost"):
        reproducible_noise(4)
        model = h.private(h.mlp(), gradient_method=method, clip_norm=0.5)
        updates[method] = h.step_update(model, x, y, np.ones(12, np.float32))
        assert model.gradient_method_used == method
    np.testing.assert_allclose(updates["ghost"], updates["vmap"], rtol=1e-4, atol=1e-6)


class _Tied(keras.Model):
    """Reads a Dense kernel outside the layer's call (weight tying)."""

    input_shape = (None, h.FEATURES)  # what tests.clipped.jax.helpers.private reads

    def __init__(self):
        super().__init__()
        self.dense = L.Dense(8, kernel_initializer=_init(10))

    def call(self, x):
        out = keras.ops.matmul(self.dense(x), keras.ops.transpose(self.dense.kernel))
        return out[:, : h.CLASSES]


def _tied():
    network = _Tied()
    network(np.zeros((1, h.FEATURES), "float32"))
    return network


@pytest.mark.parametrize(
    "network,reason",
    [(h.cnn, "is not the kernel or bias"), (_tied, "read outside its layer's call")],
    ids=["group_normalization", "tied_weights"],
)
def test_outside_its_scope_ghost_falls_back_to_vmap(network, reason, caplog):
    model = h.private(network(), gradient_method="ghost")
    x, y = h.data(8, tuple(model.network.input_shape[1:]))
    with caplog.at_level(logging.INFO, logger="lipdp.clipped.jax.model"):
        update = h.step_update(model, x, y, np.ones(8, np.float32))
    assert model.gradient_method_used == "vmap"
    assert reason in caplog.text
    assert np.all(np.isfinite(update))


def test_gradient_method_is_checked_passed_by_make_private_and_saved():
    with pytest.raises(ValueError, match="gradient_method must be one of"):
        h.private(h.mlp(), gradient_method="jacobian")
    model = lipdp.make_private(
        h.mlp(), epsilon=3.0, delta=1e-5, epochs=1, batch_size=8, dataset_size=64,
        gradient_method="ghost",
    )  # fmt: skip
    assert model.gradient_method == "ghost"
    assert model.get_config()["gradient_method"] == "ghost"


class _Projection(L.Layer):
    """A user's layer: ``x W``, no bias, no activation."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], self.units), initializer=_init(11), name="kernel"
        )

    def call(self, x):
        return keras.ops.matmul(x, self.kernel)


class _ProjectionRule(GhostRule):
    """Its ghost rule, registered once: the backend-neutral pieces (the JAX step's) and the
    TensorFlow engine's (from the Dense identities)."""

    name = "projection"

    def bias(self, layer):
        return None

    def activation(self, layer, z):
        return z

    def product_factors(self, layer, a, g):
        return rows(a, a.shape[-1]), rows(g, layer.units)

    def apply_kernel(self, layer, a, kernel):
        return keras.ops.matmul(a, kernel)

    def linear(self, layer, a):
        return keras.ops.matmul(a, layer.kernel)

    def kernel_sq_norms(self, layer, a, g):
        return dense.product_sq_norms(*self.product_factors(layer, a, g))

    def shift(self, layer, a_new, a, g, kernel_rows):
        raise NotImplementedError


def _projection_network():
    return keras.Sequential([
        keras.Input((3, h.FEATURES)),
        L.Dense(8, activation="tanh", kernel_initializer=_init(12)),
        _Projection(4),
        L.Flatten(),
        L.Dense(h.CLASSES, kernel_initializer=_init(13)),
    ])  # fmt: skip


def test_a_rule_registered_once_runs_on_the_jax_step_too():
    """The JAX step reads the ghost-rule registry: a user's rule with the backend-neutral
    pieces covers its layer (ghost norms equal per-row autodiff); without it the model
    takes the vmap path."""
    x, y = h.data(ROWS, (3, h.FEATURES), scale=2.0)
    model = h.private(_projection_network(), gradient_method="ghost")
    h.step_update(model, x, y, np.ones(ROWS, np.float32))
    assert model.gradient_method_used == "vmap"
    with registered_ghost_rule(_Projection, _ProjectionRule()):
        model = h.private(_projection_network(), gradient_method="ghost")
        expected = np.linalg.norm(_loop_gradients(model, x, y), axis=1)
        got = np.asarray(_ghost_norms(model, x, y), np.float64)
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        h.step_update(model, x, y, np.ones(ROWS, np.float32))
        assert model.gradient_method_used == "ghost"


def test_a_rule_of_tensorflow_only_leaves_the_model_on_vmap(caplog):
    """The Embedding rule defines no backend-neutral pieces: vmap for the whole step."""
    network = keras.Sequential([
        keras.Input((4,), dtype="int32"),
        L.Embedding(5, 3, embeddings_initializer=_init(14)),
        L.Flatten(),
        L.Dense(h.CLASSES, kernel_initializer=_init(15)),
    ])  # fmt: skip
    model = h.private(network, gradient_method="ghost")
    x = np.random.default_rng(0).integers(0, 5, size=(8, 4)).astype("int32")
    y = np.eye(h.CLASSES, dtype="float32")[np.arange(8) % h.CLASSES]
    with caplog.at_level(logging.INFO, logger="lipdp.clipped.jax.model"):
        update = h.step_update(model, x, y, np.ones(8, np.float32))
    assert model.gradient_method_used == "vmap"
    assert "embeddings" in caplog.text and np.all(np.isfinite(update))
