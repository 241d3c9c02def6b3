"""The clipless step of ``DP_Sequential`` on Keras 3's JAX backend, piece by piece
(:class:`lipdp.clipless.jax.trainer.CliplessJaxTrainer`): its gradient, sensitivities, noise
and projections, on the model's own state (``make_train_function``, then the trainer's
pure ``_private_gradients`` / ``_released_gradients``) and through ``train_on_batch``.

Compared with independent computations: the TensorFlow ``DP_Sequential`` of the same
layers and kernels in a subprocess (``tensorflow_step_side.py``: sensitivities, noise
standard deviations, predictions, per-row losses, the gradient of ``sum loss / b`` -- behind
a ``DP_ClipGradient`` TensorFlow's ``tf.custom_gradient`` against JAX's ``custom_vjp``),
hand-derived bounds (``X0 L / b``), per-row gradients by ``jax.vmap(jax.grad)`` over
one-hot row weights, and the exact singular values of the projected kernels (numpy)."""

import json
import math

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from lipdp.clipless import layers as L
from lipdp.clipless.losses import DP_TauCategoricalCrossentropy
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.core import noise
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.clipless.jax.tensorflow_run import run_tensorflow_side, step_state
from tests.marks import thorough

SPEC = {"n": 640, "b": 16, "bound": 2.0, "hidden": 8, "tau": 2.0, "sigma": 1.5}
FEATURES, CLASSES = 6, 4
KERNELS = ("d1", "d2")


def _model(seed=0, hidden=SPEC["hidden"], clip=None, strategy="global", sigma=SPEC["sigma"],
           lr=0.1):  # fmt: skip
    """The real ``DP_Sequential`` (fixed-size batches of ``b`` rows), compiled."""
    keras.utils.set_random_seed(seed)
    metadata = DatasetMetadata(
        input_shape=(FEATURES,), nb_classes=CLASSES, nb_samples_train=SPEC["n"],
        batch_size=SPEC["b"],
    )  # fmt: skip
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=SPEC["bound"], name="input"),
            L.DP_SpectralDense(hidden, name="d1"),
            L.DP_GroupSort(2, name="sort"),
            L.DP_SpectralDense(CLASSES, name="d2"),
            *([L.DP_ClipGradient(clip, name="clip")] if clip else []),
        ],
        dp_parameters=DPParameters(strategy, sigma, 1e-5, non_private=sigma == 0),
        dataset_metadata=metadata,
    )
    model.compile(
        loss=DP_TauCategoricalCrossentropy(SPEC["tau"]), optimizer=keras.optimizers.SGD(lr)
    )
    return model


def _data(rows=SPEC["b"], seed=0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(rows, FEATURES) * rng.choice([0.1, 1.0, 10.0], (rows, 1))).astype("float32")
    x[0] = 0.0  # a zero row: tied pre-activations in every GroupSort pair
    y = np.eye(CLASSES, dtype="float32")[rng.randint(0, CLASSES, rows)]
    return x, y


def _clean(model, state, x, y, weights=None):
    """The trainer's ``(gradient of sum_i w_i loss_i / b, per-row losses, predictions)``."""
    weights = jnp.ones((len(x),), "float32") if weights is None else weights
    return jax.jit(model._private_gradients)(*state, jnp.asarray(x), jnp.asarray(y), weights)


def _released(model, state, x, y):
    """The real step's released gradient on a state (noise included, from its key)."""
    weights = jnp.ones((len(x),), "float32")
    released, _, _, _ = jax.jit(model._released_gradients)(
        *state, jnp.asarray(x), jnp.asarray(y), weights
    )
    return [np.asarray(r) for r in released]


def _deltas(model) -> dict:
    """``{"<layer>/<variable>": Delta_v}`` of the model's bound pass."""
    return {entry.key: float(delta) for entry, delta in model.sensitivities()}


def _tensorflow_numbers(tmp_path, model, x, y, strategy, clip):
    """The TensorFlow model's numbers for the same kernels and batch (subprocess)."""
    source, target = tmp_path / f"in_{strategy}.npz", tmp_path / f"out_{strategy}.npz"
    kernels = {name: np.asarray(model.get_layer(name).kernel.value) for name in KERNELS}
    np.savez(
        source, x=x, y=y, spec=json.dumps({**SPEC, "strategy": strategy, "clip": clip}), **kernels
    )
    run_tensorflow_side("tensorflow_step_side", str(source), str(target))
    return dict(np.load(target))


@pytest.mark.parametrize(
    "strategy, clip",
    [("global", None), pytest.param("per-layer", None, marks=thorough), ("global", 0.05)],
)
def test_the_numbers_of_tensorflow(tmp_path, strategy, clip):
    """Sensitivities and noise standard deviations to 1e-6 of TensorFlow's (and the hand
    value), predictions, per-row losses and the gradient of ``sum loss / b`` to float32
    round-off (behind ``DP_ClipGradient(0.05)``: the ``custom_vjp`` clips as TensorFlow's
    ``custom_gradient``)."""
    model, (x, y) = _model(clip=clip, strategy=strategy), _data()
    tf_side = _tensorflow_numbers(tmp_path, model, x, y, strategy, clip)
    state = step_state(model)
    deltas, stddevs = _deltas(model), model.noise_stddevs()
    planned = model._step_plan.stddev  # what the compiled step adds
    planned = planned if isinstance(planned, tuple) else (planned,) * len(KERNELS)
    cotangent = math.sqrt(2.0) if clip is None else min(math.sqrt(2.0), clip)  # L or min(L, C)
    hand = SPEC["bound"] * cotangent * (1 + ROUNDOFF_SLACK) / SPEC["b"]  # X0 G / b
    for index, name in enumerate(KERNELS):
        kernel = model.get_layer(name).kernel
        assert deltas[f"{name}/kernel"] == pytest.approx(float(tf_side[f"delta_{name}"]), rel=1e-6)
        assert deltas[f"{name}/kernel"] == pytest.approx(hand, rel=1e-7)  # C in float32
        expected = float(tf_side[f"stddev_{name}"])
        assert stddevs[variable_key(kernel)] == pytest.approx(expected, rel=1e-6)
        assert planned[index] == pytest.approx(expected, rel=1e-6)
    # the same function: predictions, per-row losses and the gradient of sum loss / b
    grads, rows, y_pred = _clean(model, state, x, y)
    np.testing.assert_allclose(np.asarray(y_pred), tf_side["y_pred"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rows), tf_side["rows"], rtol=1e-5, atol=1e-6)
    for name, grad in zip(KERNELS, grads):
        np.testing.assert_allclose(np.asarray(grad), tf_side[f"grad_{name}"], atol=1e-6)


def _row_gradient_norms(model, state, x, y):
    """``(rows, variables)``: ``b`` times the norm of the gradient of row ``i``'s share
    ``loss_i / b`` of the batch loss, in the batch (the other rows' weights set to 0, so a
    clip layer clips row ``i``'s cotangent at ``C / b`` as in the step), by ``vmap`` of the
    trainer's ``jax.grad`` over one-hot weights: independent of the bound pass."""
    x, y = jnp.asarray(x), jnp.asarray(y)

    def share(weights):
        return model._private_gradients(*state, x, y, weights)[0]

    grads = jax.jit(jax.vmap(share))(jnp.eye(len(x)))
    return SPEC["b"] * np.stack(
        [np.sqrt(np.sum(np.square(np.asarray(g, np.float64)), axis=(1, 2))) for g in grads],
        axis=1,
    )


@pytest.mark.parametrize("clip", [None, 0.05])
def test_every_row_within_its_bound_and_remove_one(clip):
    model = _model(seed=3, clip=clip, sigma=0.0)
    x, y = _data(seed=3)
    state = step_state(model)
    norms = _row_gradient_norms(model, state, x, y)
    # B_v = X0 * L for both kernels, X0 * min(L, C) behind a clip layer
    bound = SPEC["bound"] * (math.sqrt(2.0) if clip is None else min(math.sqrt(2.0), clip))
    assert norms.max() <= bound * (1 + ROUNDOFF_SLACK)
    assert norms.max() > 0.3 * bound  # the check is not vacuous: rows come near the bound
    # remove one: the (noiseless) released gradient moves by at most Delta_v
    deltas = list(_deltas(model).values())
    full = _released(model, state, x, y)
    for row in range(len(x)):
        keep = np.arange(len(x)) != row
        part = _released(model, state, x[keep], y[keep])
        for f, p, delta in zip(full, part, deltas):
            assert np.linalg.norm(f - p) <= delta * (1 + ROUNDOFF_SLACK)


def test_noise_of_the_step_and_projection():
    """The noise the step adds has the standard deviation of the one noise rule (``"global"``:
    ``sigma sqrt(sum Delta_v^2)`` on every coordinate, hand value); large noisy steps of
    ``train_on_batch`` push the kernels out of the spectral ball and the projection brings
    every one back to ``sigma_max <= 1`` (orthogonal: not a collapse)."""
    model = _model(seed=5, hidden=64, sigma=2.0, lr=5.0)
    x, y = _data(seed=5)
    noise.use_reproducible_noise(7)
    try:
        state = step_state(model)
        clean, _, _ = _clean(model, state, x, y)
        released = _released(model, state, x, y)
        drawn = np.concatenate([np.ravel(r - np.asarray(c)) for r, c in zip(released, clean)])
        expected = model._step_plan.stddev  # global: one float
        assert expected == pytest.approx(
            2.0 * math.sqrt(2) * 2.0 * math.sqrt(2.0) * (1 + ROUNDOFF_SLACK) / 16
        )
        assert np.std(drawn) == pytest.approx(expected, rel=0.05)  # 6*64 + 64*4 = 640 values
        for _ in range(3):
            model.train_on_batch(x, y)
    finally:
        noise.use_reproducible_noise(None)
    for variable in model.trainable_variables:
        sigma_max = np.linalg.svd(np.asarray(variable.value, np.float64), compute_uv=False)[0]
        assert sigma_max <= 1.0
        assert sigma_max > 0.99
