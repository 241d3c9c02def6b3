"""TensorFlow numbers of the clipless layers, projections and losses, for a before/after check.

``PYTHONPATH=. python benchmarks/clipless_tf_numbers.py out.npz`` (from the checkout whose
``lipdp`` is measured: it prints the path it imported) writes, on the TensorFlow backend
(Keras 3, or Keras 2 with ``.venv-keras2``), every number a rewrite of these modules must
keep: outputs and gradients of DP_BoundedInput (clip_rows), the three dense constrained
layers (initial projected kernels, forward, gradients, one projection of a perturbed kernel
and its power vector), the projection functions on tall and wide matrices, DP_GroupSort
(n = 2 with and without XLA, n = 4, with ties), DP_ClipGradient, every loss of
:mod:`lipdp.clipless.losses` (per-row values and gradients w.r.t. the logits on random and
adversarial inputs: huge logits, ties, wrong, NaN and ``-0.0`` labels; rank-3 inputs; sample
weights) and the weights after three noisy ``train_on_batch`` steps of a DP_Sequential
(reproducible noise). It also times 30 ``train_on_batch`` steps.

``python benchmarks/clipless_tf_numbers.py --compare before.npz after.npz`` prints, per
entry, whether both are bitwise equal, else the largest difference in units of the last
place (ulp) of float32.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np

logger = logging.getLogger(__name__)


def _numbers():  # noqa: PLR0915 - one flat list of cases
    import tensorflow as tf

    from lipdp.clipless import layers as L
    from lipdp.clipless import losses, projections
    from lipdp.clipless.layers.inputs import clip_rows
    from lipdp.clipless.model import DP_Sequential, DPParameters
    from lipdp.core import noise
    from lipdp.foundation.metadata import DatasetMetadata

    try:
        import keras
    except ImportError:  # Keras 2
        keras = tf.keras
    out = {}
    rng = np.random.default_rng(0)

    def grads_of(fn, *tensors):
        tensors = [tf.constant(t) for t in tensors]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            value = fn(*tensors)
            weight = tf.constant(rng.normal(size=value.shape).astype(np.float32))
            total = tf.reduce_sum(value * weight)
        return value, tape.gradient(total, tensors)

    # ---------------------------------------------------------------- inputs
    x = rng.normal(size=(12, 20)).astype(np.float32)
    x[1] *= 1e-20
    x[2] = 0.0
    x[3, 0] = np.nan
    x[4, 5] = np.inf
    x[5] = 1e30
    x[6, :3] = 3e38
    x[7] *= 1e-3
    layer = L.DP_BoundedInput(input_shape=(20,), upper_bound=2.0)
    value, (g,) = grads_of(lambda t: layer(t), x)
    out["bounded_input"], out["bounded_input_grad"] = value, g
    out["clip_rows"] = clip_rows(tf.constant(x[np.isfinite(x).all(1)]), 1.5)
    loose = L.DP_BoundedInput(input_shape=(20,), upper_bound=2.0, enforce_clipping=False)
    out["bounded_input_unclipped"] = loose(tf.constant(x))

    # ---------------------------------------------------------------- dense layers
    h = rng.normal(size=(6, 3, 20)).astype(np.float32)
    for name, cls, kw in [
        ("spectral", L.DP_SpectralDense, {}),
        ("quick", L.DP_QuickSpectralDense, {}),
        ("quick_sball", L.DP_QuickSpectralDense, {"constraint": "spectral"}),
        ("frobenius", L.DP_QuickFrobeniusDense, {}),
        ("wide", L.DP_SpectralDense, {"weight_norm_bound": 2.0}),
    ]:
        units = 32 if name == "wide" else 16
        layer = cls(units, kernel_initializer=keras.initializers.GlorotUniform(seed=3), **kw)
        layer.build((None, 3, 20))
        out[f"{name}_kernel0"] = layer.kernel
        out[f"{name}_u0"] = layer.power_vector
        value, (gx,) = grads_of(lambda t: layer(t), h)  # noqa: B023
        out[f"{name}_y"], out[f"{name}_gx"] = value, gx
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(layer(tf.constant(h)) ** 2)
        out[f"{name}_gk"] = tape.gradient(total, layer.kernel)
        layer.kernel.assign(layer.kernel + 0.3 * rng.normal(size=layer.kernel.shape))
        layer.project()
        out[f"{name}_kernel1"], out[f"{name}_u1"] = layer.kernel, layer.power_vector
        out[f"{name}_lip"] = np.float32(layer.backpropagate_inputs(1.0, 1.0))

    # ---------------------------------------------------------------- projections
    for shape in [(30, 12), (12, 30), (16, 16)]:
        m = tf.constant(rng.normal(size=shape).astype(np.float32))
        u = tf.constant(rng.normal(size=(1, shape[1])).astype(np.float32))
        tag = "x".join(map(str, shape))
        out[f"power_{tag}"], out[f"power_u_{tag}"] = projections.power_iteration(m, u, 5)
        out[f"gersh_{tag}"] = projections.gershgorin_sigma_bound(m)
        out[f"bjorck_{tag}"] = projections.bjorck_step(m / 10.0)
        out[f"ortho_{tag}"], out[f"ortho_u_{tag}"] = projections.orthogonal_projection(
            m, u, radius=1.5
        )
        out[f"sball_{tag}"] = projections.spectral_ball_projection(m, radius=2.0)
        out[f"sigma_{tag}"] = projections.largest_singular_value(m)
        out[f"fball_{tag}"] = projections.frobenius_ball_projection(m, radius=3.0)
        out[f"cert_s_{tag}"] = projections.certified_operator_norm(m, "spectral")
        out[f"cert_f_{tag}"] = projections.certified_operator_norm(m, "frobenius")
    out["l2ball"] = projections.l2_ball_projection(tf.constant(rng.normal(size=(9,))), 0.5)
    out["l2ball_in"] = projections.l2_ball_projection(tf.constant([0.1, 0.2]), 0.5)

    # ---------------------------------------------------------------- group sort, clip
    s = rng.integers(-2, 3, size=(8, 2, 16)).astype(np.float32)  # many ties
    for tag, layer in [
        ("gs2", L.DP_GroupSort(2, jit_compile=False)),
        ("gs2xla", L.DP_GroupSort(2, jit_compile=True)),
        ("gs4", L.DP_GroupSort(4)),
        ("gsall", L.DP_GroupSort(None)),
    ]:
        value, (g,) = grads_of(lambda t: layer(t), s)  # noqa: B023
        out[tag], out[f"{tag}_grad"] = value, g
    scales = np.array([[0.01], [1], [10], [0], [3], [1e3], [0.5]], np.float32)
    c = rng.normal(size=(7, 5)).astype(np.float32) * scales
    for tag, normalizer in [("clip_none", None), ("clip_8", 8)]:
        layer = L.DP_ClipGradient(0.7)
        value, (g,) = grads_of(lambda t: layer(t, loss_normalizer=normalizer), c)  # noqa: B023
        out[tag], out[f"{tag}_grad"] = value, g
    out["clip_bound"] = L.DP_ClipGradient(0.7).backpropagate_inputs(1.0, 3.0)

    # ---------------------------------------------------------------- losses
    k = 5
    z = rng.normal(size=(16, k)).astype(np.float32) * 3
    z[1] = 1e30
    z[2] = [1e30, -1e30, 0, 0, 5]
    z[3] = 0.0
    z[4] = [2, 2, 2, -1, -1]
    z[5] = [-1e30, 1e30, -1e30, 1e30, 0]
    z[13] = [2, 0, 0, 0, 0]  # ||z|| = K of DP_KCosineSimilarity(K=2): its kink
    y = np.eye(k, dtype=np.float32)[rng.integers(0, k, size=16)]
    y[6] = [0, 0, 0, 0, 0]
    y[7] = [1, 1, 0, 0, 0]
    y[8] = [-1, 3, 0.5, 0, 0]
    y[9, 0] = np.nan
    y[10, 2] = np.inf
    y[11] = [-0.0, 0.0, -1, -1, -1]
    y[12] = [-1, 1, -1, -1, -1]
    y[13] = [0.2, 0.2, 0.2, 0.2, 0.2]
    y[14] = 1e30
    z3 = rng.normal(size=(4, 3, k)).astype(np.float32)
    y3 = np.eye(k, dtype=np.float32)[rng.integers(0, k, size=(4, 3))]
    weights = np.linspace(0, 1, 16).astype(np.float32)
    loss_list = [
        ("tcce", losses.DP_TauCategoricalCrossentropy, {"tau": 2.0}),
        ("tbce", losses.DP_TauBCE, {"tau": 3.0}),
        ("hinge", losses.DP_MulticlassHinge, {"min_margin": 0.5}),
        ("hinge_k", losses.DP_MulticlassHinge, {"nb_classes": k}),
        ("kr", losses.DP_MulticlassKR, {}),
        ("kr_k", losses.DP_MulticlassKR, {"nb_classes": k}),
        ("hkr", losses.DP_MulticlassHKR, {"alpha": 5.0, "min_margin": 0.3}),
        ("hkr_k", losses.DP_MulticlassHKR, {"nb_classes": k}),
        ("kcos", losses.DP_KCosineSimilarity, {"K": 2.0}),
        ("kcos_small", losses.DP_KCosineSimilarity, {"K": 0.1}),
        ("mae", losses.DP_MeanAbsoluteError, {}),
    ]
    for tag, cls, kw in loss_list:
        rows = cls(reduction="none", **kw)
        value, (_, gz) = grads_of(lambda a, b: rows(a, b), y, z)  # noqa: B023
        out[f"loss_{tag}"], out[f"loss_{tag}_grad"] = value, gz
        value, (_, gz) = grads_of(lambda a, b: rows(a, b), y3, z3)  # noqa: B023
        out[f"loss3_{tag}"], out[f"loss3_{tag}_grad"] = value, gz
        mean = cls(**kw)
        finite = np.isfinite(y).all(1)
        out[f"lossw_{tag}"] = mean(y[finite], z[finite], sample_weight=weights[finite])
        out[f"lossL_{tag}"] = np.float64(mean.get_L())

    # ---------------------------------------------------------------- training steps
    tf.keras.utils.set_random_seed(5)
    xs = rng.normal(size=(64, 20)).astype(np.float32)
    ys = np.eye(k, dtype=np.float32)[rng.integers(0, k, size=64)]
    glorot = keras.initializers.GlorotUniform
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(20,), upper_bound=2.0),
            L.DP_SpectralDense(64, kernel_initializer=glorot(seed=1)),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(32, kernel_initializer=glorot(seed=2)),
            L.DP_GroupSort(4),
            L.DP_QuickFrobeniusDense(k, kernel_initializer=glorot(seed=4)),
            L.DP_ClipGradient(0.5),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=DatasetMetadata(
            input_shape=(20,), nb_classes=k, nb_samples_train=6400, batch_size=64
        ),
    )
    model.compile(
        loss=losses.DP_MulticlassHKR(alpha=2.0, nb_classes=k),
        optimizer=tf.keras.optimizers.SGD(0.5),
    )
    noise.use_reproducible_noise(11)
    for _ in range(3):
        model.train_on_batch(xs, ys)
    for i, w in enumerate(model.weights):
        if w.dtype in (tf.float32, "float32"):
            out[f"model_w{i}"] = w
    noise.use_reproducible_noise(None)
    start = time.perf_counter()
    for _ in range(30):
        model.train_on_batch(xs, ys)
    out["seconds_30_steps"] = np.float64(time.perf_counter() - start)
    return {key: np.asarray(value) for key, value in out.items()}


def _ulps(a, b):
    a32, b32 = a.astype(np.float32).ravel(), b.astype(np.float32).ravel()
    ia = a32.view(np.int32).astype(np.int64)
    ib = b32.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.max(np.abs(ia - ib))) if ia.size else 0


def compare(before, after) -> int:
    a, b = np.load(before), np.load(after)
    bad = 0
    for key in sorted(set(a.files) | set(b.files)):
        if key.startswith("seconds"):
            continue
        if key not in a.files or key not in b.files:
            print(f"{key}: only in {'before' if key in a.files else 'after'}")
            bad += 1
            continue
        x, y = a[key], b[key]
        if x.shape != y.shape:
            print(f"{key}: shapes {x.shape} != {y.shape}")
            bad += 1
        elif x.tobytes() != y.tobytes():
            same_nan = np.array_equal(np.isnan(x), np.isnan(y)) if x.dtype.kind == "f" else True
            ulp = _ulps(np.nan_to_num(x), np.nan_to_num(y)) if x.dtype.kind == "f" else -1
            print(f"{key}: differs, max {ulp} ulp, same NaN positions: {same_nan}")
            bad += 1
    ta, tb = float(a["seconds_30_steps"]), float(b["seconds_30_steps"])
    print(f"{len(a.files)} entries, {bad} not bitwise equal; 30 steps {ta:.3f}s -> {tb:.3f}s")
    return bad


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    if sys.argv[1] == "--compare":
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
    import lipdp

    print(f"lipdp from {lipdp.__file__}")
    np.savez(sys.argv[1], **_numbers())
