"""``DP_Sequential`` on Keras 3's JAX backend: its JAX trainer
(:class:`lipdp.clipless.jax.trainer.CliplessJaxTrainer`, on
:class:`lipdp.core.jax.trainer.JaxPrivateTrainer`).

Compared with independent computations: the TensorFlow ``DP_Sequential`` of the same layers
and kernels in a subprocess (``tensorflow_model_side.py``: sensitivities, noise standard
deviations, epsilon of the ledger after real steps), the standard normal draw of the step's
key recomputed here from :func:`lipdp.core.noise.use_reproducible_noise`'s seed, and the
remove-one check (one row removed from a Poisson batch, identical noise: the released
difference over the declared sensitivity)."""

import json
import weakref

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import lipdp
from lipdp.accounting import get_accountant
from lipdp.clipless import layers as L
from lipdp.clipless.losses import DP_TauCategoricalCrossentropy
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.core import noise
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.jax import keys
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.clipless.jax.tensorflow_run import run_tensorflow_side, step_state
from tests.marks import thorough

FEATURES, CLASSES = 6, 4
SPEC = {"n": 64, "b": 16, "bound": 2.0, "hidden": 8, "tau": 2.0, "sigma": 1.3, "delta": 1e-5,
        "radius": 2.0, "coef": 1.5, "steps": 3}  # fmt: skip
SEED = 20261128


def _layers(clip=None, one_layer=False):
    first = L.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=SPEC["bound"], name="input")
    if one_layer:  # one kernel: a row's gradient x g^T / n reaches its bound X0 C / n
        body = [L.DP_SpectralDense(CLASSES, name="d2")]
    else:
        body = [
            L.DP_SpectralDense(
                SPEC["hidden"], weight_norm_bound=SPEC["radius"], nm_coef=SPEC["coef"], name="d1"
            ),  # fmt: skip
            L.DP_GroupSort(2, name="sort"),
            L.DP_SpectralDense(CLASSES, name="d2"),
        ]
    return [first, *body, *([L.DP_ClipGradient(clip, name="clip")] if clip else [])]


def _model(strategy="global", clip=None, sampling="shuffle", one_layer=False, seed=0, n=None,
           sigma=SPEC["sigma"], optimizer=None):  # fmt: skip
    keras.utils.set_random_seed(seed)
    metadata = DatasetMetadata(
        input_shape=(FEATURES,), nb_classes=CLASSES, nb_samples_train=n or SPEC["n"],
        batch_size=SPEC["b"], sampling=sampling,
    )  # fmt: skip
    model = DP_Sequential(
        _layers(clip, one_layer),
        dp_parameters=DPParameters(strategy, sigma, SPEC["delta"], non_private=sigma == 0),
        dataset_metadata=metadata,
    )
    model.compile(
        loss=DP_TauCategoricalCrossentropy(SPEC["tau"]),
        optimizer=optimizer or keras.optimizers.SGD(0.1),
        metrics=["accuracy"],
    )
    return model


def _data(rows=SPEC["b"], seed=0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(rows, FEATURES) * rng.choice([0.1, 1.0, 10.0], (rows, 1))).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.randint(0, CLASSES, rows)]
    return x, y


def _released(model, trainable, non_trainable, x, y, weights=None):
    """The real step's released gradient (noise included) on a state: the function
    ``train_step`` calls (:meth:`JaxPrivateTrainer._released_gradients`)."""
    weights = jnp.ones((len(x),), "float32") if weights is None else jnp.asarray(weights)
    if model not in _JITTED:  # one trace per batch shape
        _JITTED[model] = jax.jit(model._released_gradients)
    released, _, _, _ = _JITTED[model](
        trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), weights
    )
    return [np.asarray(r) for r in released]


_JITTED = weakref.WeakKeyDictionary()


def _tensorflow(tmp_path, model, x, y, strategy, clip):
    source, target = tmp_path / f"in_{strategy}.npz", tmp_path / f"out_{strategy}.npz"
    kernels = {}
    for name in ("d1", "d2"):
        kernels[name] = np.asarray(model.get_layer(name).kernel.value)
        kernels[f"u_{name}"] = np.asarray(model.get_layer(name).power_vector.value)
    spec = json.dumps({**SPEC, "strategy": strategy, "clip": clip})
    np.savez(source, x=x, y=y, spec=spec, **kernels)
    run_tensorflow_side("tensorflow_model_side", str(source), str(target))
    return dict(np.load(target))


@pytest.mark.parametrize("strategy", ["per-layer", pytest.param("global", marks=thorough)])
def test_one_step_s_noise_and_epsilon_equal_tensorflow(tmp_path, strategy):
    """The noise of one step with reproducible noise is exactly ``stddev_v z_v``: ``z`` the
    standard normal draw of the seeded key (recomputed here), ``stddev_v`` equal to the
    TensorFlow model's (1e-6 relative); epsilon of the ledger after the same number of
    real steps equal to TensorFlow's (same accountant)."""
    clip = 0.5
    model = _model(strategy, clip=clip)
    x, y = _data()
    start = {}
    for layer in ("d1", "d2"):
        start[layer] = np.asarray(model.get_layer(layer).kernel.value)
        start[f"u_{layer}"] = np.asarray(model.get_layer(layer).power_vector.value)
    tf_numbers = _tensorflow(tmp_path, model, x, y, strategy, clip)
    noise.use_reproducible_noise(SEED)
    try:
        trainable, non_trainable = step_state(model)
        clean, _, _ = jax.jit(model._private_gradients)(
            trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), jnp.ones((len(x),))
        )
        released = _released(model, trainable, non_trainable, x, y)
        _, draw = keys.next_key_and_draw(jnp.asarray(keys.seeded_key(SEED)))
        sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
        z = np.split(np.asarray(jax.random.normal(draw, (sum(sizes),))), np.cumsum(sizes)[:-1])
        for variable, r, c, z_v in zip(model.trainable_variables, released, clean, z):
            name = variable.path.split("/")[-2]
            expected = float(tf_numbers[f"stddev_{name}"])
            drawn = (r - np.asarray(c)).ravel()
            np.testing.assert_allclose(drawn, expected * z_v, rtol=2e-4, atol=2e-6 * expected)
            measured = np.std(drawn)  # and, as a sanity check, the empirical std
            assert 0.5 * expected < measured < 1.5 * expected
        stddevs = model._step_plan.stddev
        stddevs = stddevs if isinstance(stddevs, tuple) else (stddevs,) * len(sizes)
        by_key = model.noise_stddevs()  # the TensorFlow model's API
        for variable, stddev in zip(model.trainable_variables, stddevs):
            name = variable.path.split("/")[-2]
            assert stddev == pytest.approx(float(tf_numbers[f"stddev_{name}"]), rel=1e-6)
            assert by_key[variable_key(variable)] == stddev
        for _ in range(SPEC["steps"]):
            model.train_on_batch(x, y)
    finally:
        noise.use_reproducible_noise(None)
    assert int(model.noisy_steps.numpy()) == int(tf_numbers["steps"]) == SPEC["steps"]
    epsilon = get_accountant("rdp").epsilon(model.privacy_ledger.terms(), SPEC["delta"])
    assert epsilon == pytest.approx(float(tf_numbers["epsilon"]), rel=1e-9)
    # The same steps without noise (SGD with momentum, projections) give TensorFlow's
    # weights, from the same kernels (float32 round-off; the steps move them by ~1e-2).
    reference = _model(strategy, clip=clip, sigma=0.0,
                       optimizer=keras.optimizers.SGD(0.1, momentum=0.9))  # fmt: skip
    for layer in ("d1", "d2"):
        reference.get_layer(layer).kernel.assign(start[layer])
        reference.get_layer(layer).power_vector.assign(start[f"u_{layer}"])
    for _ in range(SPEC["steps"]):
        reference.train_on_batch(x, y)
    for layer in ("d1", "d2"):
        after = np.asarray(reference.get_layer(layer).kernel.value)
        moved = np.abs(after - start[layer]).max()
        assert moved > 1e-3
        np.testing.assert_allclose(after, tf_numbers[f"after_{layer}"], atol=1e-6 + 1e-4 * moved)
    if strategy == "per-layer":  # two Gaussians per step, as TensorFlow's ledger row
        (entry,) = model.privacy_ledger.entries()
        assert "2 Gaussians per step" in model.privacy_ledger.describe()[0], entry


@pytest.mark.parametrize(
    "strategy, one_layer", [("global", True), pytest.param("per-layer", False, marks=thorough)]
)
def test_remove_one_within_the_declared_sensitivity(strategy, one_layer):
    """One row removed from a Poisson batch, identical noise (same state, same key): the
    released difference over the declared sensitivity is at most 1 + ROUNDOFF_SLACK, and
    comes close to 1 (the check is not vacuous)."""
    model = _model(strategy, clip=0.5, sampling="poisson", one_layer=one_layer, n=160)
    x, y = _data(seed=3)
    x *= 50.0  # every row clipped to the input bound: the bound X0 C / n is reached
    trainable, non_trainable = step_state(model)
    entries = model.sensitivities()
    deltas = {e.key: float(d) for e, d in entries}
    full = _released(model, trainable, non_trainable, x, y)
    ratios = []
    for i in range(len(x)):
        keep = np.arange(len(x)) != i
        fewer = _released(model, trainable, non_trainable, x[keep], y[keep])
        diffs = [f - g for f, g in zip(full, fewer)]
        if strategy == "global":
            total = np.sqrt(sum(float(np.sum(d.astype("float64") ** 2)) for d in diffs))
            ratios.append(total / np.sqrt(sum(v**2 for v in deltas.values())))
        else:
            for (entry, _), d in zip(entries, diffs):
                ratios.append(float(np.linalg.norm(d.astype("float64"))) / deltas[entry.key])
    assert max(ratios) <= 1.0 + ROUNDOFF_SLACK
    if one_layer:
        assert max(ratios) > 0.9


def test_ledger_and_weights_across_save_and_reload(tmp_path):
    model = _model("per-layer", clip=0.5)
    x, y = _data()
    for _ in range(2):
        model.train_on_batch(x, y)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is DP_Sequential
    assert int(loaded.noisy_steps.numpy()) == 2
    assert loaded.privacy_ledger.describe() == model.privacy_ledger.describe()
    assert not np.any(loaded.noise_key.numpy())  # rule S8: no key in the file
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        if a.dtype == np.uint32:  # the key
            continue
        np.testing.assert_array_equal(a, b)
    loaded.train_on_batch(x, y)
    assert int(loaded.noisy_steps.numpy()) == 3
    (entry,) = loaded.privacy_ledger.entries()
    assert entry.count == 3


def test_fit_with_the_accountant_logs_the_plan_s_epsilon():
    x, y = _data(rows=160, seed=1)
    model = lipdp.make_private(
        _layers(clip=0.5), epsilon=3.0, delta=1e-5, epochs=2, batch_size=16,
        dataset_size=160, method="clipless",
    )  # fmt: skip
    assert isinstance(model, DP_Sequential)
    automatic = lipdp.make_private(
        _layers(clip=0.5), epsilon=3.0, delta=1e-5, epochs=2, batch_size=16,
        dataset_size=160, method="auto",
    )  # fmt: skip
    assert isinstance(automatic, DP_Sequential)
    planned = lipdp.accounting.get_eps_delta(model, 2)[0]
    model.compile(loss=DP_TauCategoricalCrossentropy(SPEC["tau"]), optimizer="sgd")
    history = model.fit(
        lipdp.private_batches(model, x, y), epochs=2, verbose=0, callbacks=[DP_Accountant()]
    )
    logged = history.history["epsilon"]
    assert logged[-1] == pytest.approx(planned, rel=1e-9)
    assert 3.0 - 0.05 < logged[-1] <= 3.0 and logged[0] < logged[1]
    assert int(model.noisy_steps.numpy()) == 20


class _MyDense(L.DP_SpectralDense):
    """A subclass: its call may differ from the ported one."""


class _MyLoss(DP_TauCategoricalCrossentropy):
    pass


def _one_layer_model(layer, **kwargs):
    return DP_Sequential(
        [*_layers()[:1], layer], dp_parameters=DPParameters("global", 1.0, 1e-5), **kwargs
    )


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: _one_layer_model(_MyDense(CLASSES)),
            r"_MyDense\) does not run under jax.jit yet: train on KERAS_BACKEND=tensorflow",
        ),
        (
            lambda: _one_layer_model(L.DP_SpectralDense(CLASSES), adversarial={"eps": 0.1}),
            "Adversarial training is not ported to JAX yet: train on KERAS_BACKEND=tensorflow",
        ),
    ],
    ids=["layer", "adversarial"],
)
def test_what_is_not_ported_is_refused_in_one_line(make, match):
    with pytest.raises((TypeError, ValueError), match=match) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_a_loss_not_ported_is_refused_in_one_line_before_the_step():
    model = _model()
    model.compile(loss=_MyLoss(2.0), optimizer="sgd")
    message = "_MyLoss does not run under jax.jit yet: train on KERAS_BACKEND=tensorflow"
    with pytest.raises(TypeError, match=message) as caught:
        model.train_on_batch(*_data())
    assert "\n" not in str(caught.value)
