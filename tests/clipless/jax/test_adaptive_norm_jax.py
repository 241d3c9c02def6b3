"""Norm-adaptive kernels (``adaptive_norm=True``, Lip-DP-SGD) on Keras 3's JAX backend.

Compared with independent computations: the exact largest singular value in numpy float64
(SVD; for the small adversarial kernels also mpmath at 50 digits), the TensorFlow model of
the same layers and kernels in a subprocess (``tensorflow_adaptive_side.py``: certificates,
sensitivities, noise standard deviations), the standard normal draw of the step's key
recomputed here, and the remove-one check (one row removed from a Poisson batch, identical
noise, after a few real noisy steps: the released difference over the sensitivity the step
declared for the weights it took its gradient at)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import keras
import mpmath
import numpy as np
import pytest

from lipdp.clipless import layers as L
from lipdp.clipless import projections
from lipdp.clipless.losses import DP_TauCategoricalCrossentropy
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.core import noise
from lipdp.core.jax import keys
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests import cases as C
from tests.backends import harness as h
from tests.clipless.jax import tensorflow_adaptive_side as side
from tests.clipless.jax.tensorflow_run import run_tensorflow_side, step_state
from tests.marks import representatives, thorough

SEED = 20261128
TINY = float(np.finfo(np.float32).tiny)


def _orthogonal(rng, n):
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    return q


def _adversarial_kernels():
    """``{name: float32 kernel}``: random, ill-conditioned, huge and tiny entries (up to
    float32's range and into its subnormals), rank-deficient, exactly orthogonal, tied
    top singular values, wide and tall."""
    rng = np.random.default_rng(0)
    f32 = np.float32
    u, v = _orthogonal(rng, 24), _orthogonal(rng, 12)
    ill = (u[:, :12] * np.logspace(0, -30, 12)) @ v.T
    mixed = rng.normal(size=(16, 8)) * np.where(rng.random((16, 1)) < 0.5, 1e20, 1e-20)
    hadamard = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2
    tied = (u[:, :12] * np.r_[1.0, 1.0 - 1e-7, 1.0 - 2e-7, np.ones(9) * 0.5]) @ v.T
    kernels = {
        "random": rng.normal(size=(64, 16)),
        "random wide": rng.normal(size=(10, 48)),
        "ill-conditioned 1e30": ill,
        "huge 1e20": 1e20 * rng.normal(size=(16, 8)),
        "near float32 max": 1e37 * rng.normal(size=(8, 4)),
        "tiny 1e-20": 1e-20 * rng.normal(size=(16, 8)),
        "subnormal": 1e-42 * np.sign(rng.normal(size=(8, 4))),
        "mixed 1e20 / 1e-20": mixed,
        "rank one": np.outer(rng.normal(size=20), rng.normal(size=6)),
        "rank two of tiny": 1e-30 * rng.normal(size=(12, 2)) @ rng.normal(size=(2, 9)),
        "zero": np.zeros((5, 3)),
        "permutation": np.eye(7)[rng.permutation(7)],
        "hadamard / 2": hadamard,
        "tied top singular values": tied,
    }
    return {name: np.asarray(k, f32) for name, k in kernels.items()}


def _exact_sigma(kernel) -> float:
    """The largest singular value of the float32 kernel, float64 SVD."""
    return float(np.linalg.svd(kernel.astype(np.float64), compute_uv=False)[0])


def _mpmath_sigma(kernel) -> float:
    """The same at 50 digits (small kernels): the square root of the largest eigenvalue of
    the exact Gram matrix."""
    with mpmath.workdps(50):
        m = mpmath.matrix(kernel.astype(np.float64).tolist())
        gram = m.T * m if m.rows >= m.cols else m * m.T
        return float(mpmath.sqrt(max(mpmath.eigsy(gram, eigvals_only=True))))


_CERTIFY = jax.jit(projections.certified_operator_norm, static_argnums=1)


def test_certificate_upper_bounds_the_exact_norm_on_adversarial_kernels():
    """Under ``jax.jit``: spectral certificate >= sigma_max (float64 SVD, mpmath at 50 digits)
    and within ``1 + 2 NORM_ROUNDOFF`` of it; Frobenius certificate >= ``||W||_F`` (float64
    sum of the float32 squares) within the same; ``inf`` only where sigma_max exceeds
    float32's range."""
    for name, kernel in _adversarial_kernels().items():
        exact = _exact_sigma(kernel)
        if kernel.size <= 500:
            reference = _mpmath_sigma(kernel)
            assert reference == pytest.approx(exact, rel=1e-12, abs=0.0), name
            exact = max(exact, reference)
        certificate = float(_CERTIFY(jnp.asarray(kernel), "spectral"))
        frobenius = float(_CERTIFY(jnp.asarray(kernel), "frobenius"))
        exact_frobenius = float(np.sqrt(np.sum(kernel.astype(np.float64) ** 2)))
        if exact > float(np.finfo(np.float32).max):
            assert certificate == np.inf, name
            continue
        # Subnormal entries (read as 0 by XLA) add at most sqrt(size) 2^-126; no result
        # below 2^-126 but 0.
        loose = 1 + 2 * projections.NORM_ROUNDOFF, (np.sqrt(kernel.size) + 1) * TINY
        assert exact <= certificate <= exact * loose[0] + loose[1], name
        assert exact_frobenius <= frobenius <= exact_frobenius * loose[0] + loose[1], name
        assert certificate <= frobenius * (1 + 2e-6), name


def test_a_float32_certificate_without_slack_fails_the_same_check():
    """The check has teeth: ``sqrt(max eigvalsh(M^T M))`` in float32 (no float64, no slack)
    is below sigma_max -- to 0 on tiny kernels (the Gram underflows), below by round-off on
    others."""

    @jax.jit
    def float32_sigma(m):
        return jnp.sqrt(jnp.maximum(jnp.max(jnp.linalg.eigvalsh(m.T @ m)), 0.0))

    ratios = {}
    for name, kernel in _adversarial_kernels().items():
        kernel = kernel if kernel.shape[0] >= kernel.shape[1] else kernel.T
        exact = _exact_sigma(kernel)
        if 0 < exact < 1e30:
            ratios[name] = float(float32_sigma(jnp.asarray(kernel))) / exact
    assert ratios["tiny 1e-20"] < 0.5, ratios
    assert min(ratios.values()) < 1.0, ratios


# ------------------------------------------------------------------ the model
def _model(strategy="per-layer", sigma=1.3, sampling="shuffle", n=side.SAMPLES, seed=0, tau=2.0):
    keras.utils.set_random_seed(seed)
    metadata = DatasetMetadata(
        input_shape=(side.FEATURES,), nb_classes=side.CLASSES, nb_samples_train=n,
        batch_size=side.BATCH, sampling=sampling,
    )  # fmt: skip
    model = DP_Sequential(
        side.layers(L),
        dp_parameters=DPParameters(strategy, sigma, 1e-5),
        dataset_metadata=metadata,
    )
    model.compile(loss=DP_TauCategoricalCrossentropy(tau), optimizer=keras.optimizers.SGD(0.1))
    return model


def _inside_the_balls(model, seed=1):
    """Kernels well inside their balls (spectral norm 1.3 of radius 2, Frobenius norm 0.7
    of radius 1.5): the bounds then read the certificates, not the radii."""
    rng = np.random.default_rng(seed)
    d1 = rng.normal(size=(side.FEATURES, 8))
    d2 = rng.normal(size=(8, side.CLASSES))
    kernels = {
        "d1": (1.3 * d1 / np.linalg.svd(d1, compute_uv=False)[0]).astype("float32"),
        "d2": (0.7 * d2 / np.linalg.norm(d2)).astype("float32"),
    }
    for name, kernel in kernels.items():
        model.get_layer(name).kernel.assign(kernel)
    return kernels


def _tensorflow(tmp_path, strategy, kernels, sigma=1.3):
    source, target = tmp_path / f"in_{strategy}.npz", tmp_path / f"out_{strategy}.npz"
    spec = json.dumps({"strategy": strategy, "sigma": sigma})
    np.savez(source, spec=spec, **kernels)
    run_tensorflow_side("tensorflow_adaptive_side", str(source), str(target))
    return dict(np.load(target))


def _data(rows=side.BATCH, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, side.FEATURES)).astype("float32")
    y = np.eye(side.CLASSES, dtype="float32")[rng.integers(0, side.CLASSES, rows)]
    return x, y


@pytest.mark.parametrize("strategy", ["per-layer", pytest.param("global", marks=thorough)])
def test_certificates_sensitivities_and_noise_equal_tensorflow(tmp_path, strategy):
    """Same kernels (inside their balls), same layers: the certificates (adversarial kernels
    too), the sensitivities (host) and the noise standard deviations (computed in the
    compiled step from its state) equal the TensorFlow model's to 1e-6 relative; the noise
    the step adds is exactly ``stddev_v z_v`` (``z``: the seeded key's draw); the step is
    not compiled again when the weights move, and its noise follows them."""
    model = _model(strategy)
    kernels = _inside_the_balls(model)
    # TensorFlow reads subnormal entries as 0 (flush-to-zero, in its cast as in its matmul:
    # its certificate is that of the kernel it computes with); JAX's bounds both kernels.
    adversarial = {
        f"kernel_{i:02d}": k
        for i, (name, k) in enumerate(_adversarial_kernels().items())
        if name != "subnormal"
    }
    tf_numbers = _tensorflow(tmp_path, strategy, {**kernels, **adversarial})
    for norm in ("spectral", "frobenius"):
        ours = [float(_CERTIFY(jnp.asarray(k), norm)) for k in adversarial.values()]
        np.testing.assert_allclose(ours, tf_numbers[f"certificates_{norm}"], rtol=1e-6)
    assert float(tf_numbers["norm_d1"]) < 2.0 and float(tf_numbers["norm_d2"]) < 1.5
    deltas = {e.key.split("/")[0]: float(d) for e, d in model.sensitivities()}
    for name in ("d1", "d2"):
        assert deltas[name] == pytest.approx(float(tf_numbers[f"delta_{name}"]), rel=1e-6)
    x, y = _data()
    noise.use_reproducible_noise(SEED)
    try:
        trainable, non_trainable = step_state(model)
        assert model._step_plan.stddev is None  # computed in the step
        in_step = _in_step(model)
        released, _, _, _ = jax.jit(model._released_gradients)(
            trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), jnp.ones((len(x),))
        )
        clean, _, _ = jax.jit(model._private_gradients)(
            trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), jnp.ones((len(x),))
        )
        _, draw = keys.next_key_and_draw(jnp.asarray(keys.seeded_key(SEED)))
        sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
        z = np.split(np.asarray(jax.random.normal(draw, (sum(sizes),))), np.cumsum(sizes)[:-1])
        for variable, s, r, c, z_v in zip(model.trainable_variables, in_step, released, clean, z):
            name = variable.path.split("/")[-2]
            expected = float(tf_numbers[f"stddev_{name}"])
            assert float(s) == pytest.approx(expected, rel=1e-6)
            drawn = np.asarray(r - c).ravel()
            np.testing.assert_allclose(drawn, expected * z_v, rtol=2e-4, atol=2e-6 * expected)
        # Real steps: one compiled step; its noise is that of the weights it reads.
        model.train_on_batch(x, y)
        compiled = model.train_function
        before = [float(s) for s in _in_step(model)]
        model.get_layer("d2").kernel.assign(0.5 * model.get_layer("d2").kernel.value)
        model.train_on_batch(x, y)
        assert model.train_function is compiled
    finally:
        noise.use_reproducible_noise(None)
    host = model.noise_stddevs()
    after = _in_step(model)
    for variable, s in zip(model.trainable_variables, after):
        assert float(s) == pytest.approx(host[variable_key(variable)], rel=1e-6)
    # d1's bound X_0 c_2 L / b follows the halved (then updated) d2: its noise shrinks.
    assert float(after[0]) < 0.75 * before[0]


def _in_step(model):
    """The step's standard deviations (one per variable) on the model's current state."""
    trainable, non_trainable = step_state(model)
    stddevs = jax.jit(model._stddev_in_step)(trainable, non_trainable)
    return stddevs if isinstance(stddevs, list) else [stddevs] * len(trainable)


def test_remove_one_after_noisy_steps_within_the_sensitivity_of_the_step_s_weights():
    """Three real noisy steps (projections on), then one row removed from a Poisson batch
    whose rows all lie along the top singular direction of the first kernel (clipped to
    ``X_0``: the second kernel's gradient bound ``X_0 c_1 L / n`` is reached up to the
    loss gradient's norm): every mechanism's released difference over the sensitivity of
    the weights the step read is at most 1 + ROUNDOFF_SLACK, and above 0.9 (each row's
    label is its least likely class, the loss sharp (``tau = 32``): the loss gradient's norm
    comes close to ``L``)."""
    model = _model("per-layer", sampling="poisson", n=160, tau=32.0)
    _inside_the_balls(model)
    x, y = _data(seed=3)
    for _ in range(3):
        model.train_on_batch(x, y)
    kernel = np.asarray(model.get_layer("d1").kernel.value, np.float64)
    top = np.linalg.svd(kernel.T)[2][0]  # kernel maps x -> x W: the top left-singular of W^T
    rng = np.random.default_rng(4)
    x = (50.0 * np.sign(rng.normal(size=(len(x), 1))) * top).astype("float32")
    y = np.eye(side.CLASSES, dtype="float32")[np.argmin(np.asarray(model(x)), axis=1)]
    trainable, non_trainable = step_state(model)
    entries = model.sensitivities()  # of the weights the step reads
    assert float(model.get_layer("d1").operator_norm_bound()) < 2.0
    released = jax.jit(model._released_gradients)  # the same state: the same key, noise
    full = released(trainable, non_trainable, jnp.asarray(x), jnp.asarray(y), jnp.ones(16))
    ratios = []
    for i in range(len(x)):
        keep = np.arange(len(x)) != i
        fewer = released(
            trainable, non_trainable, jnp.asarray(x[keep]), jnp.asarray(y[keep]), jnp.ones(15)
        )
        for (_, delta), f, g in zip(entries, full[0], fewer[0]):
            diff = np.asarray(f, np.float64) - np.asarray(g, np.float64)
            ratios.append(float(np.linalg.norm(diff)) / float(delta))
    assert max(ratios) <= 1.0 + ROUNDOFF_SLACK, ratios
    assert max(ratios) > 0.9, ratios


ADAPTIVE_BALLS = [name for name in C.NORM_BALL_CASES if "adaptive" in name]


@pytest.mark.parametrize(
    "case", representatives(ADAPTIVE_BALLS, ["Ball:GroupNormalization(dense,adaptive)"])
)
def test_norm_ball_catalogue_remove_one_on_jax(case):
    """The catalogue's norm-adaptive cases (tests/cases.py, radii above and below 1, every
    constrained layer and ball) attacked as the red team does (tests/backends/harness.py):
    fresh identical models, one real ``train_on_batch`` on a Poisson batch and on the batch
    minus each record, identical noise, projections off; the sensitivity is read before
    the step (the weights the step reads)."""

    def fresh():
        keras.utils.set_random_seed(0)
        model, x, y = C.NORM_BALL_CASES[case]()
        model.dataset_metadata = dataclasses.replace(model.dataset_metadata, sampling="poisson")
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=model.loss)
        return h.without_projection(model), x, y

    model, x, y = fresh()
    delta = h.global_sensitivity(model)
    release = h.released(model, x, y)
    assert np.all(np.isfinite(release))
    ratios = []
    for row in range(len(x)):
        keep = np.arange(len(x)) != row
        without, _, _ = fresh()
        assert h.global_sensitivity(without) == delta
        ratios.append(np.linalg.norm(release - h.released(without, x[keep], y[keep])) / delta)
    assert max(ratios) <= 1.0 + ROUNDOFF_SLACK, ratios
    assert max(ratios) > 0.01, ratios
