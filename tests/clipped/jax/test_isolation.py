"""Rule S2 on the JAX step by construction (:mod:`lipdp.clipped.jax.isolation`): the red
team's couplings (``tests/clipped/jax/couplings.py``, the six of ``tests/couplings.py``) mix the
rows of their batch when the network is called on it, yet train on the JAX step -- both
gradient paths -- with no cross-row effect (each row's released term is what it is with
the other rows deleted) and a remove-one ratio of at most 1 (+ round-off); a statistic
kept in state, a ``custom_vmap`` rule and a host callback (which break the construction)
are refused."""

import jax
import keras
import numpy as np
import pytest

from lipdp.core.noise import ROUNDOFF_SLACK
from tests.clipped.jax import couplings
from tests.clipped.jax import helpers as h
from tests.marks import thorough

B = couplings.BATCH
TRAINED = [name for name in couplings.CONSTRUCTIONS if name != "running-mean"]
DEFAULT = {("gated-magnitude", "ghost"), ("max-logit-loss", "vmap")}
CASES = [
    pytest.param(name, method, marks=() if (name, method) in DEFAULT else thorough)
    for name in TRAINED
    for method in ("ghost", "vmap")
]


def _private(case, **options):
    return h.private(case.network, clip_norm=case.clip, batch_size=B, n=8 * B, loss=case.loss,
                     **options)  # fmt: skip


def _losses(case, x):
    loss = case.loss or keras.losses.CategoricalCrossentropy(from_logits=True)
    return np.asarray(loss.call(case.y[: len(x)], case.network(x, training=True)))


def _couples_on_the_batch(case) -> float:
    """How far the rows' losses move when each row is computed alone instead of in the
    batch (the network called on the batch, as a TensorFlow step calls it): relative."""
    together = _losses(case, case.x)
    alone = np.array([_losses(case, case.x[i : i + 1])[0] for i in range(B)])
    return float(np.max(np.abs(together - alone)) / np.max(np.abs(alone)))


def _restore(model, values):
    for v, value in zip(model.trainable_variables, values):
        v.assign(value)


@pytest.mark.parametrize("name, method", CASES)
def test_a_coupling_trains_with_no_cross_row_effect(name, method):
    """Noise off, SGD of rate 1 (the update is minus the released average): the update on
    the batch is the sum of the updates of each row alone in the batch (the others
    deleted: zero rows of weight 0), to float32 round-off -- although the network,
    called on the batch, mixes its rows (by ``> 1e-3``, relative)."""
    case = couplings.CONSTRUCTIONS[name](0)
    assert _couples_on_the_batch(case) > 1e-3
    model = _private(case, sigma=0.0, gradient_method=method)
    start = [v.numpy() for v in model.trainable_variables]
    full = h.step_update(model, case.x, case.y, np.ones(B, np.float32))
    assert model.gradient_method_used == method
    alone = np.zeros_like(full)
    for i in range(B):
        _restore(model, start)
        x, mask = np.zeros_like(case.x), np.zeros(B, np.float32)
        x[i], mask[i] = case.x[i], 1.0
        alone += h.step_update(model, x, case.y, mask)
    assert np.linalg.norm(full) > 1e-3
    np.testing.assert_allclose(alone, full, rtol=0, atol=1e-5 * np.linalg.norm(full))


@pytest.mark.parametrize("name, method", CASES)
def test_removing_the_row_that_switches_a_coupling_on_moves_by_at_most_r_over_b(
    name, method, reproducible_noise
):
    """The remove-one harness of ``test_step.py`` (masked out, or deleted with a padding
    row in its place; identical noise) on the row that switches the coupling on (row 0):
    ratio to ``R / b`` at most ``1 + slack``; the row is clipped, so close to 1."""
    reproducible_noise(5)
    models = [_private(couplings.CONSTRUCTIONS[name](0), gradient_method=method) for _ in range(3)]
    case = couplings.CONSTRUCTIONS[name](0)
    ratios = [
        moved / (case.clip / B) for moved in h.remove_one_moves(*models, case.x, case.y, row=0)
    ]
    assert models[0].gradient_method_used == method
    assert max(ratios) <= 1 + ROUNDOFF_SLACK + 1e-5, ratios
    assert min(ratios) >= 0.9, ratios


def test_a_statistic_kept_in_state_is_refused_at_the_first_step():
    """``running-mean``: a running mean of the batch assigned in ``call`` would be saved with
    the model, never noised."""
    case = couplings.CONSTRUCTIONS["running-mean"](0)
    model = _private(case)
    with pytest.raises(ValueError, match="training call updates .*running_mean.* Remove"):
        model.train_on_batch(case.x, case.y, sample_weight=np.ones(B, np.float32))
    assert int(model.noisy_steps.numpy()) == 0


# --------------------------------------------------- what breaks the construction
@jax.custom_batching.custom_vmap
def _lane_mean(x):
    return x  # one row: its own mean


@_lane_mean.def_vmap
def _lane_mean_rule(axis_size, in_batched, xs):
    return keras.ops.broadcast_to(keras.ops.mean(xs, axis=0), xs.shape), in_batched[0]


class CustomVmapMean(keras.layers.Layer):
    """Subtracts the batch mean (no gradient through it), computed by a ``custom_vmap``
    rule: under the step's ``vmap`` the rule receives every row."""

    def call(self, x):
        return x - jax.lax.stop_gradient(_lane_mean(jax.lax.stop_gradient(x)))


class CallbackMean(keras.layers.Layer):
    """The same mean computed on the host by ``jax.pure_callback(vmap_method="broadcast_all")``."""

    def call(self, x):
        x0 = jax.lax.stop_gradient(x)

        def mean(a):
            return np.broadcast_to(a.mean(axis=0, keepdims=True), a.shape).astype(a.dtype)

        shape = jax.ShapeDtypeStruct(x0.shape, x0.dtype)
        return x - jax.pure_callback(mean, shape, x0, vmap_method="broadcast_all")


@pytest.mark.parametrize(
    "layer, named",
    [(CustomVmapMean, "custom_vmap"), pytest.param(CallbackMean, "pure_callback")],
)
def test_a_batching_rule_that_sees_every_row_is_refused(layer, named):
    """Without the refusal, deleting the outlier row moved the release of such a network
    by 3.55 ``R / b`` (both layers, both gradient paths, identical noise): the coupling
    is real."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, h.FEATURES)).astype("float32")
    x[0] *= 100.0
    y = np.eye(h.CLASSES, dtype="float32")[rng.integers(0, h.CLASSES, B)]
    network = keras.Sequential(
        [keras.Input((h.FEATURES,)), keras.layers.Dense(8), layer(), keras.layers.Dense(3)]
    )
    model = h.private(network, batch_size=B, n=8 * B)
    with pytest.raises(ValueError, match=f"calls .*{named}.* Write that computation with keras"):
        model.train_on_batch(x, y, sample_weight=np.ones(B, np.float32))
    assert int(model.noisy_steps.numpy()) == 0
