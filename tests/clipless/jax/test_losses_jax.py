"""Every loss of lipdp.clipless.losses on JAX: the TensorFlow numbers (per-row losses and
gradients w.r.t. the logits, eager and under jax.jit) and the sensitivity constant.

Independent computations: TensorFlow's losses in a subprocess
(``tests/clipless/jax/tensorflow_losses.py``), and every row's gradient by
``jax.vmap(jax.grad)`` of that row's loss alone, whose norm must not exceed ``get_L()`` on
random and adversarial rows (logits of +-1e30, ties, wrong / NaN / infinite labels)."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from tests.clipless.jax.loss_cases import LOSS_CASES, inputs
from tests.clipless.jax.tensorflow_run import run_tensorflow_side
from tests.marks import representatives

#: float32 round-off of a gradient norm (the bound is a supremum, reached by some rows).
ROUNDOFF = 1e-6


@pytest.fixture(scope="module")
def tensorflow_numbers(tmp_path_factory):
    target = tmp_path_factory.mktemp("tf") / "losses.npz"
    run_tensorflow_side("tensorflow_losses", str(target))
    return dict(np.load(target))


CASES = {tag: (name, kwargs) for tag, name, kwargs in LOSS_CASES}
#: The bound check runs one configuration of every loss class by default; the comparisons
#: with TensorFlow and the jit step (slower) a few, every configuration under ``thorough``.
ONE_PER_LOSS = ["tcce_hot", "tbce", "hinge_k", "kr", "hkr_k", "kcos", "mae"]
FEW = ["tcce_hot", "hkr_k", "mae"]


def _loss(name, kwargs, **more):
    return getattr(losses, name)(**kwargs, **more)


def _row_gradients(loss, y, z):
    """Row ``i``: the gradient of row ``i``'s loss alone (a batch of one) w.r.t. its logits."""

    def one(y_row, z_row):
        return loss.call(y_row[None], z_row[None])[0]

    return jax.vmap(jax.grad(one, argnums=1))(jnp.asarray(y), jnp.asarray(z))


@pytest.mark.parametrize("tag", representatives(CASES, FEW))
def test_every_loss_gives_the_tensorflow_numbers(tensorflow_numbers, tag):
    name, kwargs = CASES[tag]
    loss = _loss(name, kwargs, reduction="none")

    def total(z, y):
        return jnp.sum(loss.call(y, z))

    jitted_rows = jax.jit(lambda y, z: loss.call(y, z))
    jitted_grad = jax.jit(jax.grad(total))
    for case, (y, z) in inputs().items():
        expected_rows = tensorflow_numbers[f"{tag}/{case}/rows"]
        expected_grad = tensorflow_numbers[f"{tag}/{case}/grad"]
        for rows, grad in [
            (loss(y, z), jax.grad(total)(jnp.asarray(z), jnp.asarray(y))),
            (jitted_rows(y, z), jitted_grad(jnp.asarray(z), jnp.asarray(y))),
        ]:
            np.testing.assert_allclose(np.asarray(rows), expected_rows, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-6, atol=1e-6)
    y, z = inputs()["random"]
    weights = np.linspace(0.0, 1.0, 24).astype(np.float32)
    weighted = _loss(name, kwargs)(y, z, sample_weight=weights)
    np.testing.assert_allclose(float(weighted), tensorflow_numbers[f"{tag}/weighted"], rtol=1e-6)


@pytest.mark.parametrize("tag", representatives(CASES, ONE_PER_LOSS))
def test_every_row_gradient_within_get_L(tag):
    name, kwargs = CASES[tag]
    loss = _loss(name, kwargs, reduction="none")
    bound = loss.get_L()
    for case, (y, z) in inputs(seed=1).items():
        if z.ndim != 2:
            continue  # a row of a rank-3 batch is averaged: covered by the TF comparison
        grads = np.asarray(jax.jit(lambda y, z: _row_gradients(loss, y, z))(y, z))
        assert np.isfinite(grads).all(), (tag, case)
        norms = np.linalg.norm(grads, axis=1)
        assert norms.max() <= bound * (1 + ROUNDOFF), (tag, case, norms.max(), bound)
        unusable = ~np.isfinite(y).all(axis=1)
        assert (norms[unusable] == 0).all()  # rule S9: a NaN / inf label counts 0
    # The constant is reached (tight) for the losses whose docstring says so: some random
    # logits come close; a bound far above every gradient would hide nothing, but a test
    # whose bound is never approached could not tell a wrong gradient from a right one.
    y, z = inputs(seed=2)["random"]
    norms = np.linalg.norm(np.asarray(_row_gradients(loss, y, z)), axis=1)
    assert norms.max() > 0.1 * bound


def test_sample_weights_outside_0_1():
    y, z = inputs()["random"]
    loss = losses.DP_MulticlassHKR(alpha=2.0, nb_classes=5)
    with pytest.raises(ValueError, match=r"sample_weight must be in \[0, 1\]"):
        loss(y, z, sample_weight=np.full(24, 1.5, np.float32))
    with pytest.raises(ValueError, match=r"sample_weight must be in \[0, 1\]"):
        loss(y, z, sample_weight=np.full(24, np.nan, np.float32))
    # Traced weights cannot be checked: they are mapped into [0, 1] (a NaN to 0).
    bad = np.linspace(-1.0, 2.0, 24).astype(np.float32)
    bad[3] = np.nan
    traced = jax.jit(lambda w: loss(y, z, sample_weight=w))(bad)
    mapped = np.where(np.isfinite(bad), np.clip(bad, 0.0, 1.0), 0.0)
    expected = loss(y, z, sample_weight=mapped)
    np.testing.assert_allclose(float(traced), float(expected), rtol=1e-6)


def test_class_index_labels_are_refused_on_jax():
    loss = losses.DP_TauCategoricalCrossentropy(1.0, reduction="none")
    with pytest.raises(ValueError, match="one-hot encode"):
        loss(np.array([0, 1], np.int32), np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("tag", representatives(CASES, FEW[:2]))
def test_every_loss_trains_in_the_jit_step(tag):
    """The real ``DP_Sequential`` (Poisson batches, so a batch minus a row is legal) trains
    with every loss: on hostile rows (huge / NaN input, wrong / NaN label; the step's rule
    S9 zeroes and weighs the rows as ``train_step`` does) each row moves the released
    gradient by at most ``Delta_v`` of the bound pass, and ``train_on_batch`` (no noise,
    SGD of rate 1, no projection) applies exactly that released gradient."""
    name, kwargs = CASES[tag]
    y, _ = inputs()["adversarial"]  # labels: zero, two-hot, negative, NaN, inf, 1e30...
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(16, 6)) * rng.choice([0.01, 1.0, 1e30], size=(16, 1))).astype("f4")
    x[1] = 1e30  # clipped to the ball by DP_BoundedInput
    x[3, 2] = np.nan  # zeroed (rule S9)
    keras.utils.set_random_seed(0)
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(6,), upper_bound=2.0),
            L.DP_SpectralDense(8),
            L.DP_GroupSort(2),
            L.DP_QuickFrobeniusDense(5),
        ],
        dp_parameters=DPParameters("global", 0.0, 1e-5, non_private=True),
        dataset_metadata=DatasetMetadata(
            input_shape=(6,),
            nb_classes=5,
            nb_samples_train=160,
            batch_size=16,
            sampling="poisson",
        ),  # fmt: skip
    )
    model.compile(loss=_loss(name, kwargs), optimizer=keras.optimizers.SGD(1.0))
    model._projected = lambda trainable, non_trainable: (trainable, non_trainable)
    model.make_train_function()
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )
    released_gradients = jax.jit(model._released_gradients)

    def released(x, y):  # train_step's rows (rule S9), then its release
        x, y, weights, _ = model._neutralised_batch((jnp.asarray(x), jnp.asarray(y)))
        return [np.asarray(g) for g in released_gradients(*state, x, y, weights)[0]]

    deltas = [float(delta) for _, delta in model.sensitivities()]
    full = released(x, y)
    for removed in (1, 3, 4, 8, 9):  # huge / NaN input, wrong / NaN label
        keep = np.arange(16) != removed
        part = released(x[keep], y[keep])
        for f, p, delta in zip(full, part, deltas):
            assert np.isfinite(f).all(), tag
            gap = np.linalg.norm(f - p)
            assert gap <= delta * (1 + ROUNDOFF), (tag, removed, gap / delta)
    before = [np.asarray(v.value) for v in model.trainable_variables]
    model.train_on_batch(x, y)  # the compiled step runs (no noise: sigma = 0)
    for b, v, f in zip(before, model.trainable_variables, full):
        np.testing.assert_allclose(b - np.asarray(v.value), f, rtol=1e-5, atol=1e-6)
