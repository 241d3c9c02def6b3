"""``DP_ClipGradient(mode="dynamic")`` and the dynamic clipping callbacks
(:mod:`lipdp.clipless.dynamic`) on Keras 3's JAX backend.

Compared with independent computations: the TensorFlow model of the same kernels in a
subprocess (``tensorflow_dynamic_side.py``: the cotangent norms of its ``GradientTape``
tap, the clip values after one update of each callback, the ledger and epsilon after
``fit``), per-row ``jax.vmap(jax.grad)`` of each row's loss w.r.t. the logits, the standard
normal draw of the step's key recomputed here, and the remove-one check after a clip
update."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lipdp.clipless.dynamic import per_example_cotangent_norms
from lipdp.core import noise
from lipdp.core.jax import keys
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation.variables import variable_key
from tests.clipless.jax.tensorflow_dynamic_side import (
    SPEC,
    callback,
    fitted_ledger,
    model,
    updated_clip_values,
)
from tests.clipless.jax.tensorflow_run import run_tensorflow_side
from tests.marks import thorough

SEED = 20261128


def _data(rows=SPEC["n"], seed=0, scale=1.0):
    rng = np.random.RandomState(seed)
    x = (rng.randn(rows, SPEC["features"]) * rng.choice([0.1, 1.0, 3.0], (rows, 1))) * scale
    y = np.eye(SPEC["classes"], dtype="float32")[rng.randint(0, SPEC["classes"], rows)]
    return x.astype("float32"), y


def _kernels(network):
    out = {}
    for name in ("d1", "d2"):
        out[name] = np.asarray(network.get_layer(name).kernel.value)
        out[f"u_{name}"] = np.asarray(network.get_layer(name).power_vector.value)
    return out


@pytest.fixture(scope="module")
def tensorflow_numbers(tmp_path_factory):
    """The JAX model's kernels and data, and the TensorFlow numbers on them."""
    import keras

    keras.utils.set_random_seed(0)
    x, y = _data()
    kernels = _kernels(model(SPEC, callback("laplace", x, y).spec))
    folder = tmp_path_factory.mktemp("dynamic")
    source, target = folder / "in.npz", folder / "out.npz"
    np.savez(source, x=x, y=y, spec=json.dumps(SPEC), **kernels)
    run_tensorflow_side("tensorflow_dynamic_side", str(source), str(target))
    return x, y, kernels, dict(np.load(target))


def test_cotangent_norms_equal_tensorflow_s_and_per_row_autodiff(tensorflow_numbers):
    """The probes' norms at both dynamic clip layers equal the TensorFlow tape's (1e-5); at
    the last one (before its clipping) they are also ``||d loss_i / d logits_i||`` by
    per-row ``vmap(grad)`` of the loss alone. The inner layer's norms see the outer layer's
    clipping (some rows reach it)."""
    x, y, kernels, numbers = tensorflow_numbers
    network = model(SPEC, callback("laplace", x, y).spec, kernels)
    mid, last = per_example_cotangent_norms(network, x[:37], y[:37])  # a size not a power of 2
    np.testing.assert_allclose(mid, numbers["norm_mid"][:37], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(last, numbers["norm_clip"][:37], rtol=1e-5, atol=1e-7)
    logits = np.asarray(network.predict_on_batch(x[:37]))
    loss = network.loss

    def row_loss(z, t):
        return loss.call(t[None], z[None])[0]

    grads = jax.vmap(jax.grad(row_loss))(jnp.asarray(logits), jnp.asarray(y[:37]))
    np.testing.assert_allclose(last, np.linalg.norm(np.asarray(grads), axis=1), rtol=1e-5)
    assert np.sum(last > SPEC["clip"]) > 3  # the outer clip bites for the inner norms


@pytest.mark.parametrize("kind", ["laplace", pytest.param("quantiles", marks=thorough)])
def test_clip_values_after_an_update_equal_tensorflow_s_within_the_limits(tensorflow_numbers, kind):
    """One update of the callback (same seed, same kernels, same data) gives TensorFlow's
    clip values, each in the callback's limits ``[floor, U]``, and moved from the start."""
    x, y, kernels, numbers = tensorflow_numbers
    clips, limits = updated_clip_values(SPEC, kind, x, y, kernels)
    np.testing.assert_allclose(clips, numbers[f"clips_{kind}"], rtol=1e-5)
    for value, (lower, upper) in zip(clips, limits):
        assert lower <= value <= upper
    assert clips != [SPEC["mid_clip"], SPEC["clip"]]


@pytest.mark.parametrize("kind", ["laplace", pytest.param("quantiles", marks=thorough)])
def test_ledger_and_epsilon_after_fit_equal_tensorflow_s(tensorflow_numbers, kind):
    """``fit`` for the same epochs with the callback: the same ledger rows (the noisy steps
    and the callback's releases) and the same epsilon (1e-9) as TensorFlow's; the clip
    values after ``fit`` are the callback's last ones."""
    x, y, kernels, numbers = tensorflow_numbers
    terms, epsilon, releases, kept = fitted_ledger(SPEC, kind, x, y)  # fresh: no lineage
    assert kept
    assert terms == str(numbers[f"terms_{kind}"])
    assert releases == int(numbers[f"releases_{kind}"]) == 2 * SPEC["epochs"]
    assert epsilon == pytest.approx(float(numbers[f"epsilon_{kind}"]), rel=1e-9)


def test_updates_between_epochs_of_one_fit_do_not_retrace_the_step(monkeypatch):
    """``fit`` for 3 epochs with updates after each: one trace of the step (the clip values
    and the noise come from the state), the clip values moved."""
    from lipdp.clipless.jax.trainer import CliplessJaxTrainer

    x, y = _data(seed=7)
    cb = callback("laplace", x, y)
    network = model(SPEC, cb.spec)
    traces = []
    step = CliplessJaxTrainer.train_step

    def counted(self, state, data):
        traces.append(1)  # Python runs only while jax.jit traces
        return step(self, state, data)

    monkeypatch.setattr(CliplessJaxTrainer, "train_step", counted)
    network.fit(x, y, batch_size=SPEC["b"], epochs=3, callbacks=[cb], verbose=0)
    assert len(traces) == 1
    assert len(cb.history) == 6 and any(old != new for _, _, old, new in cb.history)


def _stepped(network):
    """The plan made (as ``fit`` makes it before its first epoch) and a jitted release."""
    network.make_train_function()
    return jax.jit(network._released_gradients)


def _state(network):
    return (
        [v.value for v in network.trainable_variables],
        [v.value for v in network.non_trainable_variables],
    )


@pytest.mark.parametrize("strategy", ["global", pytest.param("per-layer", marks=thorough)])
def test_noise_after_a_clip_update_follows_the_new_clip_value(strategy):
    """The plan is made with the first clip values; the callback then updates them between
    steps (as between epochs of one ``fit``, with no new plan): the next step's noise is the
    one noise rule on the sensitivities of the NEW clip values (``sigma sqrt(sum Delta^2)``
    or ``sigma Delta_v``) times the seeded key's normal draw (recomputed here) -- and
    differs from the plan's."""
    import keras

    keras.utils.set_random_seed(1)
    x, y = _data(rows=SPEC["b"], seed=2)
    cb = callback("laplace", *_data(seed=4))
    network = model(SPEC, cb.spec, strategy=strategy)
    noise.use_reproducible_noise(SEED)
    try:
        release = _stepped(network)
        before = network.noise_stddevs()  # the host rule on the first clip values
        planned = np.array([before[variable_key(v)] for v in network.trainable_variables])
        cb.set_model(network)
        cb.on_train_begin()
        cb._update(0)
        cb.on_train_end()
        deltas = {variable_key(e.variable): float(d) for e, d in network.sensitivities()}
        keys_ = [variable_key(v) for v in network.trainable_variables]
        if strategy == "global":
            total = float(np.sqrt(sum(d * d for d in deltas.values())))
            expected = np.full(len(keys_), SPEC["sigma"] * total)
        else:
            expected = np.array([SPEC["sigma"] * deltas[k] for k in keys_])
        assert np.all(np.abs(expected / planned - 1) > 0.05)  # the update moved the noise
        trainable, non_trainable = _state(network)
        ones = jnp.ones((len(x),))
        released, _, _, _ = release(trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), ones)
        clean, _, _ = jax.jit(network._private_gradients)(
            trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), ones
        )
        _, draw = keys.next_key_and_draw(jnp.asarray(keys.seeded_key(SEED)))
        sizes = [int(np.prod(v.shape)) for v in network.trainable_variables]
        z = np.split(np.asarray(jax.random.normal(draw, (sum(sizes),))), np.cumsum(sizes)[:-1])
        for r, c, z_v, s in zip(released, clean, z, expected):
            drawn = np.ravel(np.asarray(r - c))
            measured = float(np.dot(drawn, z_v) / np.dot(z_v, z_v))  # drawn = stddev z
            assert measured == pytest.approx(s, rel=1e-4)
    finally:
        noise.use_reproducible_noise(None)


def test_remove_one_after_a_clip_update_within_the_declared_sensitivity():
    """After a callback's update (plan made before it), one row removed from a Poisson
    batch, identical noise: the released difference over the sensitivity of the NEW clip
    values is at most 1 + ROUNDOFF_SLACK, and close to 1 (inputs beyond the input bound,
    the clip values lowered: the bound is reached)."""
    import keras

    from lipdp.clipless import layers as L
    from lipdp.clipless import losses
    from lipdp.clipless.model import DP_Sequential, DPParameters
    from lipdp.foundation.metadata import DatasetMetadata

    keras.utils.set_random_seed(3)
    n, rows = 160, SPEC["b"]
    x, y = _data(rows=rows, seed=5, scale=50.0)
    cb = callback("laplace", *_data(seed=6))
    metadata = DatasetMetadata(
        input_shape=(SPEC["features"],), nb_classes=SPEC["classes"], nb_samples_train=n,
        batch_size=rows, sampling="poisson",
    )  # fmt: skip
    network = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(SPEC["features"],), upper_bound=SPEC["bound"]),
            L.DP_SpectralDense(SPEC["classes"], name="d2"),
            L.DP_ClipGradient(10.0, mode="dynamic", name="clip"),
        ],
        dp_parameters=DPParameters(
            "global", SPEC["sigma"], SPEC["delta"], dynamic_clipping=cb.spec
        ),
        dataset_metadata=metadata,
    )
    network.compile(loss=losses.DP_TauCategoricalCrossentropy(SPEC["tau"]), optimizer="sgd")
    release = _stepped(network)
    cb.set_model(network)
    cb.on_train_begin()
    _, upper = cb._limits(cb._clip_layers[0][0])  # U: the bound the planned noise used
    cb._update(0)
    cb.on_train_end()
    assert float(network.get_layer("clip").clip_value.numpy()) < 0.9 * upper
    delta = float(np.sqrt(sum(float(d) ** 2 for _, d in network.sensitivities())))
    trainable, non_trainable = _state(network)

    def released(keep):
        out, _, _, _ = release(
            trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), jnp.asarray(keep, "float32")
        )
        return np.concatenate([np.ravel(np.asarray(r, "float64")) for r in out])

    full = released(np.ones(rows))
    ratios = [np.linalg.norm(full - released(np.arange(rows) != i)) / delta for i in range(rows)]
    assert max(ratios) <= 1.0 + ROUNDOFF_SLACK
    assert max(ratios) > 0.9
