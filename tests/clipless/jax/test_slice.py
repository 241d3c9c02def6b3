"""The smallest clipless slice on JAX (lipdp.clipless.jax): DP_BoundedInput, DP_SpectralDense,
DP_GroupSort, DP_ClipGradient (fixed) and DP_TauCategoricalCrossentropy trained by a
jit-compiled step.

Compared with independent computations: the TensorFlow DP_Sequential of the same layers and
kernels, run in a subprocess (sensitivities, noise standard deviations, predictions, losses,
gradient), per-row gradients by ``jax.vmap(jax.grad)`` (within the bound pass's bounds), and
the exact singular values of the projected kernels (numpy)."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from lipdp.clipless import layers as L
from lipdp.clipless.jax.step import CliplessJaxStep
from lipdp.clipless.losses import DP_TauCategoricalCrossentropy
from lipdp.core.noise import ROUNDOFF_SLACK
from tests.marks import thorough

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
SPEC = {"n": 640, "b": 16, "bound": 2.0, "hidden": 8, "tau": 2.0, "sigma": 1.5}
FEATURES, CLASSES = 6, 4


def _network(seed=0, hidden=SPEC["hidden"], clip=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            L.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=SPEC["bound"], name="input"),
            L.DP_SpectralDense(hidden, name="d1"),
            L.DP_GroupSort(2, name="sort"),
            L.DP_SpectralDense(CLASSES, name="d2"),
            *([L.DP_ClipGradient(clip, name="clip")] if clip else []),
        ]
    )


def _data(rows=SPEC["b"], seed=0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(rows, FEATURES) * rng.choice([0.1, 1.0, 10.0], (rows, 1))).astype("float32")
    x[0] = 0.0  # a zero row: tied pre-activations in every GroupSort pair
    y = np.eye(CLASSES, dtype="float32")[rng.randint(0, CLASSES, rows)]
    return x, y


def _step(network, sigma=SPEC["sigma"], strategy="global", lr=0.1, seed=1):
    return CliplessJaxStep(
        network, DP_TauCategoricalCrossentropy(SPEC["tau"]), keras.optimizers.SGD(lr),
        noise_multiplier=sigma, batch_size=SPEC["b"], noisify_strategy=strategy, seed=seed,
    )  # fmt: skip


def _tensorflow_numbers(tmp_path, network, x, y, strategy, clip):
    """The TensorFlow model's numbers for the same kernels and batch (subprocess)."""
    source, target = tmp_path / f"in_{strategy}.npz", tmp_path / f"out_{strategy}.npz"
    kernels = {name: np.asarray(network.get_layer(name).kernel.value) for name in ("d1", "d2")}
    np.savez(
        source, x=x, y=y, spec=json.dumps({**SPEC, "strategy": strategy, "clip": clip}), **kernels
    )
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(
        [sys.executable, "-m", "tests.clipless.jax.tensorflow_side", str(source), str(target)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(target))


@pytest.mark.parametrize(
    "strategy, clip",
    [("global", None), pytest.param("per-layer", None, marks=thorough), ("global", 0.05)],
)
def test_the_numbers_of_tensorflow(tmp_path, strategy, clip):
    network, (x, y) = _network(clip=clip), _data()
    step = _step(network, strategy=strategy)
    tf_side = _tensorflow_numbers(tmp_path, network, x, y, strategy, clip)
    # the sensitivities and the noise: the one bound pass and the one noise rule, 1e-6
    deltas = step.sensitivities()
    cotangent = math.sqrt(2.0) if clip is None else min(math.sqrt(2.0), clip)  # L or min(L, C)
    hand = SPEC["bound"] * cotangent * (1 + ROUNDOFF_SLACK) / SPEC["b"]  # X0 G / b
    for index, name in enumerate(("d1", "d2")):
        assert deltas[f"{name}/kernel"] == pytest.approx(float(tf_side[f"delta_{name}"]), rel=1e-6)
        assert deltas[f"{name}/kernel"] == pytest.approx(hand, rel=1e-7)  # C in float32
        assert step.stddevs[index] == pytest.approx(float(tf_side[f"stddev_{name}"]), rel=1e-6)
    # the same function: predictions, per-row losses and the gradient of sum loss / b
    trainable = [v.value for v in network.trainable_variables]
    non_trainable = [v.value for v in network.non_trainable_variables]
    rows, y_pred = step.loss_rows(trainable, non_trainable, jnp.asarray(x), jnp.asarray(y))
    np.testing.assert_allclose(np.asarray(y_pred), tf_side["y_pred"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rows), tf_side["rows"], rtol=1e-5, atol=1e-6)
    grads, _ = step.gradients(trainable, non_trainable, jnp.asarray(x), jnp.asarray(y))
    for name, grad in zip(("d1", "d2"), grads):
        np.testing.assert_allclose(np.asarray(grad), tf_side[f"grad_{name}"], atol=1e-6)


def _row_gradient_norms(step, network, x, y):
    """``(rows, variables)``: ``b`` times the norm of the gradient of row ``i``'s share
    ``loss_i / b`` of the batch loss, in the batch (the weights of the other rows' losses
    set to 0, so a clip layer clips row ``i``'s cotangent at ``C / b`` as in the step), by
    ``vmap`` of ``grad`` over one-hot weights: independent of the bound pass."""
    trainable = [v.value for v in network.trainable_variables]
    non_trainable = [v.value for v in network.non_trainable_variables]
    b = float(SPEC["b"])

    def share(params, weights):
        rows, _ = step.loss_rows(params, non_trainable, jnp.asarray(x), jnp.asarray(y))
        return jnp.sum(weights * rows) / b

    grads = jax.vmap(jax.grad(share), in_axes=(None, 0))(trainable, jnp.eye(len(x)))
    return b * np.stack([np.sqrt(np.sum(np.square(g), axis=(1, 2))) for g in grads], axis=1)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_every_row_within_its_bound_and_remove_one(clip):
    network = _network(seed=3, clip=clip)
    x, y = _data(seed=3)
    step = _step(network, sigma=0.0)
    norms = _row_gradient_norms(step, network, x, y)
    # B_v = X0 * L for both kernels, X0 * min(L, C) behind a clip layer
    bound = SPEC["bound"] * (math.sqrt(2.0) if clip is None else min(math.sqrt(2.0), clip))
    assert norms.max() <= bound * (1 + ROUNDOFF_SLACK)
    assert norms.max() > 0.3 * bound  # the check is not vacuous: rows come near the bound
    # remove one: the noiseless released gradient moves by at most Delta_v
    deltas = list(step.sensitivities().values())
    trainable = [v.value for v in network.trainable_variables]
    non_trainable = [v.value for v in network.non_trainable_variables]
    full, _ = step.gradients(trainable, non_trainable, jnp.asarray(x), jnp.asarray(y))
    for row in range(len(x)):
        keep = np.arange(len(x)) != row
        part, _ = step.gradients(trainable, non_trainable, x[keep], y[keep])
        for f, p, delta in zip(full, part, deltas):
            assert np.linalg.norm(np.asarray(f) - np.asarray(p)) <= delta * (1 + ROUNDOFF_SLACK)


def test_group_sort_gradient_is_a_permutation_at_ties():
    # x = 0: every pair tied. A min/max GroupSort sends both cotangents of a pair to one
    # channel (norm sqrt(2) ||g|| for g = (1, 1)); the permutation keeps ||g||.
    # The layer's own call (ops.sort on the groups on JAX), eager and under jax.jit.
    x = jnp.zeros((1, 8))
    g = jnp.ones((1, 8))
    for n in (2, 4):
        layer = L.DP_GroupSort(n)
        layer.build((None, 8))
        for fn in (layer, jax.jit(layer.__call__)):
            _, pullback = jax.vjp(fn, x)
            norm = float(jnp.linalg.norm(pullback(g)[0]))
            assert norm == pytest.approx(float(jnp.linalg.norm(g)))


def test_jit_step_noise_and_projection():
    network = _network(seed=5, hidden=64)
    x, y = _data(seed=5)
    step = _step(network, sigma=2.0, lr=5.0, seed=7)
    trainable = [v.value for v in network.trainable_variables]
    non_trainable = [v.value for v in network.non_trainable_variables]
    clean, _ = step.gradients(trainable, non_trainable, jnp.asarray(x), jnp.asarray(y))
    released = step(x, y)
    noise = np.concatenate(
        [np.ravel(np.asarray(r) - np.asarray(c)) for r, c in zip(released, clean)]
    )
    expected = step.stddevs[0]  # global: sigma sqrt(sum Delta_v^2) on every coordinate
    assert expected == pytest.approx(
        2.0 * math.sqrt(2) * 2.0 * math.sqrt(2.0) * (1 + ROUNDOFF_SLACK) / 16
    )
    assert np.std(noise) == pytest.approx(expected, rel=0.05)  # 6 * 64 + 64 * 4 = 640 values
    for _ in range(3):  # large noisy steps push the kernels out; the projection brings them back
        step(x, y)
    for variable in network.trainable_variables:
        sigma_max = np.linalg.svd(np.asarray(variable.value, np.float64), compute_uv=False)[0]
        assert sigma_max <= 1.0
        assert sigma_max > 0.99  # orthogonal: the projection is not a collapse
