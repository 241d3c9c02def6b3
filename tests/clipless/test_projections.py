"""Projections land in their feasible set, checked with exact operator norms (rule S4).

Everything here is verified independently of the power iteration used by the
projections: numpy float64 SVDs of dense kernels and of materialised convolution
matrices (``tf.GradientTape.jacobian`` in float64).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import audit, layers, projections
from lipdp.clipless.layers.convolution import patch_overlap
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata

S4_TOLERANCE = 1e-5


def _svd_norm(matrix) -> float:
    return float(np.linalg.svd(np.asarray(matrix, np.float64), compute_uv=False)[0])


def _jacobian_norm(kernel, input_shape, strides, padding) -> float:
    """Independent exact norm: float64 Jacobian of the convolution, numpy SVD."""
    x = tf.zeros((1, *input_shape), tf.float64)
    k = tf.constant(np.asarray(kernel, np.float64))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = tf.nn.conv2d(x, k, strides=strides, padding=padding.upper())
    jac = tape.jacobian(y, x, experimental_use_pfor=False).numpy()
    return _svd_norm(jac.reshape(int(np.prod(y.shape)), -1))


def _unit_matrix_view(kernel) -> np.ndarray:
    """The kernel rescaled so that its matrix view has spectral norm exactly 1."""
    kernel = np.asarray(kernel, np.float64)
    return kernel / _svd_norm(kernel.reshape(-1, kernel.shape[-1]))


def _box_kernel(k=3):
    """The constant ``k x k`` kernel (c_in = c_out = 1) of reshaped norm 1."""
    return np.full((k, k, 1, 1), 1.0 / k)


# ---------------------------------------------------------------- 1. exactness
CONV_CASES = [
    # (h, w, c_in, c_out, kh, kw, strides, padding)
    (6, 7, 2, 3, 3, 3, (1, 1), "same"),
    (6, 7, 2, 3, 3, 3, (1, 1), "valid"),
    (7, 6, 2, 3, 3, 3, (2, 2), "same"),
    (7, 6, 3, 2, 3, 2, (2, 1), "valid"),
    (8, 8, 1, 2, 4, 4, (2, 2), "same"),
    (5, 5, 3, 2, 5, 5, (3, 3), "valid"),
    (9, 9, 2, 2, 5, 5, (2, 2), "same"),
    (5, 6, 3, 4, 1, 1, (1, 1), "same"),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "x".join(map(str, c[:6])) + str(c[6:]))
def test_conv_operator_norm_is_exact(case):
    h, w, c_in, c_out, kh, kw, strides, padding = case
    rng = np.random.default_rng(sum(case[:6]))
    kernel = rng.normal(size=(kh, kw, c_in, c_out)).astype(np.float32)
    exact = audit.conv_operator_norm(kernel, (h, w, c_in), strides, padding)
    assert exact.method == "svd" and exact.exact
    reference = _jacobian_norm(kernel, (h, w, c_in), strides, padding)
    np.testing.assert_allclose(float(exact), reference, rtol=1e-10)
    bound = audit.conv_fft_bound(kernel, (h, w, c_in), strides, padding)
    assert bound.method == "fft-bound" and not bound.exact
    assert float(bound) >= float(exact) * (1 - 1e-12)


def test_conv_1x1_norm_is_matrix_norm():
    rng = np.random.default_rng(1)
    kernel = rng.normal(size=(1, 1, 5, 3)).astype(np.float32)
    expected = _svd_norm(kernel[0, 0])
    for strides in [(1, 1), (2, 2)]:
        for padding in ["same", "valid"]:
            got = audit.conv_operator_norm(kernel, (4, 5, 5), strides, padding)
            np.testing.assert_allclose(float(got), expected, rtol=1e-10)
            bound = audit.conv_fft_bound(kernel, (4, 5, 5), strides, padding)
            np.testing.assert_allclose(float(bound), expected, rtol=1e-10)


def test_dense_operator_norm():
    rng = np.random.default_rng(2)
    kernel = rng.normal(size=(13, 6)).astype(np.float32)
    norm = audit.dense_operator_norm(kernel)
    assert norm.method == "svd"
    np.testing.assert_allclose(float(norm), _svd_norm(kernel), rtol=1e-12)


def test_fft_fallback_and_limits():
    rng = np.random.default_rng(3)
    kernel = rng.normal(size=(3, 3, 2, 2)).astype(np.float32)
    exact = audit.conv_operator_norm(kernel, (10, 10, 2))
    fallback = audit.conv_operator_norm(kernel, (10, 10, 2), max_exact_size=100)
    assert fallback.method == "fft-bound"
    assert float(fallback) >= float(exact)
    # The bound tightens as the input grows (the border effect vanishes).
    big_exact = audit.conv_operator_norm(kernel, (24, 24, 2))
    big_bound = audit.conv_fft_bound(kernel, (24, 24, 2))
    assert float(big_exact) <= float(big_bound) <= float(big_exact) * 1.02
    with pytest.raises(ValueError, match="max_exact_size"):
        audit.conv_operator_norm(kernel, (10, 10, 2), max_exact_size=100, fallback="raise")
    with pytest.raises(ValueError, match="no output"):
        audit.conv_operator_norm(kernel, (2, 2, 2), padding="valid")
    with pytest.raises(ValueError, match="channels"):
        audit.conv_operator_norm(kernel, (5, 5, 3))


# ------------------------------------------------------ 2. worst-case conv bound
@pytest.mark.parametrize("kernel_size", [2, 3, 5])
@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_correction_bounds_conv_norm_by_matrix_norm(kernel_size, strides, padding):
    """||conv(K * correction)|| <= ||reshape(K)||_2, on random kernels of reshaped norm 1."""
    rng = np.random.default_rng(kernel_size * 10 + strides[0])
    correction = layers.DP_QuickSpectralConv2D(2, kernel_size, strides=strides).correction
    np.testing.assert_allclose(correction, 1 / np.sqrt(patch_overlap((kernel_size,) * 2, strides)))
    for c_in, c_out in [(1, 1), (2, 3), (3, 2)]:
        kernel = _unit_matrix_view(rng.normal(size=(kernel_size, kernel_size, c_in, c_out)))
        for shape in [(7, 7, c_in), (8, 6, c_in)]:
            norm = audit.conv_operator_norm(kernel * correction, shape, strides, padding)
            assert norm.exact
            assert float(norm) <= 1 + 1e-12
        # The Fourier bound certifies the same inequality on inputs of any size.
        assert (
            float(audit.conv_fft_bound(kernel * correction, (40, 40, c_in), strides, padding))
            <= 1 + 1e-12
        )


def test_correction_bound_is_nearly_tight():
    """The constant kernel nearly reaches the bound (stride 1) or reaches it (2x2/2)."""
    box = _box_kernel(3)
    assert _svd_norm(box.reshape(-1, 1)) == pytest.approx(1.0)
    correction = layers.DP_SpectralConv2D(1, 3).correction
    norms = [float(audit.conv_operator_norm(box * correction, (n, n, 1))) for n in (8, 16, 32)]
    assert norms[0] < norms[1] < norms[2] <= 1 + 1e-12
    assert norms[2] > 0.99  # (1 + 2 cos(pi/33))^2 / 9
    # Non-overlapping patches: the 2x2 stride-2 constant kernel is a co-isometry.
    correction = layers.DP_SpectralConv2D(1, 2, strides=2).correction
    norm = audit.conv_operator_norm(_box_kernel(2) * correction, (8, 8, 1), (2, 2), "valid")
    assert float(norm) == pytest.approx(1.0, abs=1e-12)


# ------------------------------------------------------------------ 3. Björck
def _random_matrix(rng, shape, top, spread=1.0):
    """A matrix with spectral norm ``top`` and other singular values in [top*(1-spread), top]."""
    u, _, vt = np.linalg.svd(rng.normal(size=shape), full_matrices=False)
    s = top * rng.uniform(1 - spread, 1, size=min(shape))
    s[0] = top
    return (u * s) @ vt


def test_one_bjorck_step_lands_in_unit_ball():
    rng = np.random.default_rng(4)
    worst = 0.0
    for trial in range(120):
        shape = [(20, 7), (7, 20), (16, 16), (64, 10), (3, 3)][trial % 5]
        top = [2.0, 1.0, np.sqrt(3.0), rng.uniform(1e-3, 2.0)][trial % 4]
        matrix = _random_matrix(rng, shape, top)
        for dtype in (tf.float32, tf.float64):
            stepped = projections.bjorck_step(tf.constant(matrix, dtype)).numpy()
            norm = _svd_norm(stepped)
            worst = max(worst, norm)
            assert norm <= 1 + (1e-6 if dtype == tf.float32 else 1e-12), (shape, top)
    assert worst > 1 - 1e-3  # s = 1 and s = 2 are mapped to norm 1 exactly


def test_orthogonal_projection_converges():
    rng = np.random.default_rng(5)
    for shape in [(27, 8), (8, 27), (16, 16), (72, 10)]:
        scale = rng.uniform(0.1, 10.0)
        matrix = _random_matrix(rng, shape, scale, spread=0.6)  # condition number <= 2.5
        u = tf.constant(rng.normal(size=(1, shape[1])), tf.float32)
        projected, _ = projections.orthogonal_projection(tf.constant(matrix, tf.float32), u)
        singular = np.linalg.svd(projected.numpy().astype(np.float64), compute_uv=False)
        np.testing.assert_allclose(singular, 1.0, atol=1e-3)
        assert singular.max() <= 1 + 1e-6


# ------------------------------------------------------- 4. S4 after training
def _metadata(input_shape):
    return DatasetMetadata(
        input_shape=input_shape, nb_classes=10, nb_samples_train=1000, batch_size=10
    )


def _all_constrained_model(constraint):
    """One model with the five constrained layer classes (one inside a residual block)."""
    shape = (6, 6, 2)
    dp_layers = [
        layers.DP_BoundedInput(input_shape=shape, upper_bound=1.0),
        *layers.make_residuals(
            "1-lip-add",
            [
                layers.DP_QuickSpectralConv2D(2, 3, constraint=constraint, name="res_conv"),
            ],
        ),
        layers.DP_SpectralConv2D(4, 3, constraint=constraint, name="conv"),
        layers.DP_GroupSort(2),
        layers.DP_QuickSpectralConv2D(
            4, 3, strides=2, padding="valid", constraint=constraint, name="quick_conv"
        ),
        layers.DP_Flatten(),
        layers.DP_SpectralDense(12, constraint=constraint, name="dense"),
        layers.DP_GroupSort(2),
        layers.DP_QuickSpectralDense(12, constraint=constraint, name="quick_dense"),
        layers.DP_QuickFrobeniusDense(10, constraint=constraint, name="frobenius_dense"),
    ]
    return DP_Sequential(
        dp_layers,
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_metadata(shape),
    )


def _constrained(model):
    found = []
    for layer in model.layers_forward_order():
        while isinstance(layer, layers.DP_WrappedResidual):
            layer = layer.block
        if hasattr(layer, "kernel_matrix"):
            found.append(layer)
    return found


def _hostile_update(layer, rng, step):
    """Large weight moves an optimizer step with heavy noise could produce."""
    matrix = layer.kernel_matrix().numpy().astype(np.float64)
    rows, units = matrix.shape
    kind = step % 3
    if kind == 0:  # large isotropic Gaussian noise
        matrix = matrix + 0.5 * rng.normal(size=matrix.shape)
    elif kind == 1:  # large rank-one move along a random direction
        a, b = rng.normal(size=rows), rng.normal(size=units)
        matrix = matrix + rng.uniform(0.5, 5.0) * np.outer(
            a / np.linalg.norm(a), b / np.linalg.norm(b)
        )
    else:  # both, with a moderate rank-one part
        a, b = rng.normal(size=rows), rng.normal(size=units)
        matrix = (
            matrix
            + 0.5 * rng.normal(size=matrix.shape)
            + rng.uniform(0.1, 1.0) * np.outer(a / np.linalg.norm(a), b / np.linalg.norm(b))
        )
    layer.kernel.assign(matrix.reshape(layer.kernel.shape).astype(np.float32))


#: Largest exact operator norm seen per (constraint, layer class); filled by the test.
S4_WORST: dict = {}


@pytest.mark.parametrize("constraint", ["orthogonal", "spectral", "frobenius"])
def test_projection_lands_in_feasible_set_after_hostile_steps(constraint):
    tf.keras.utils.set_random_seed(6)
    rng = np.random.default_rng(["orthogonal", "spectral", "frobenius"].index(constraint))
    model = _all_constrained_model(constraint)
    constrained = {layer.name: layer for layer in _constrained(model)}
    assert len(constrained) == 6
    violations = []
    for step in range(50):
        for layer in constrained.values():
            _hostile_update(layer, rng, step)
        model.project()
        for record in audit.audit_model(model):
            assert record.exact and record.declared == 1.0
            layer = constrained[record.name]
            if record.kind == "dense":  # independent check of the audit
                np.testing.assert_allclose(
                    record.measured, _svd_norm(layer.kernel.numpy()), rtol=1e-12
                )
            key = (constraint, type(layer).__name__)
            S4_WORST[key] = max(S4_WORST.get(key, 0.0), record.measured)
            if record.measured > 1 + S4_TOLERANCE:
                violations.append((step, record.name, record.measured))
            if record.kind == "conv2d":
                # The feasible set itself: reshaped kernel of spectral norm <= 1.
                view = _svd_norm(layer.kernel_matrix().numpy())
                key = (constraint, type(layer).__name__ + " matrix view")
                S4_WORST[key] = max(S4_WORST.get(key, 0.0), view)
                if view > 1 + S4_TOLERANCE:
                    violations.append((step, record.name + " matrix view", view))
    print(
        f"\nS4 worst exact norms ({constraint}):",
        {k[1]: round(v, 9) for k, v in S4_WORST.items() if k[0] == constraint},
    )
    assert not violations, violations[:10]


@pytest.mark.parametrize("constraint", ["orthogonal", "spectral"])
def test_projection_after_small_noisy_steps(constraint):
    """Not only hostile moves: DP-SGD-like small Gaussian steps on a 64x64 kernel."""
    tf.keras.utils.set_random_seed(10)
    rng = np.random.default_rng(10)
    layer = layers.DP_QuickSpectralDense(64, constraint=constraint)
    layer.build((None, 64))
    worst = 0.0
    for _ in range(100):
        layer.kernel.assign_add(0.01 * rng.normal(size=(64, 64)).astype(np.float32))
        layer.project()
        worst = max(worst, _svd_norm(layer.kernel.numpy()))
    print(f"\nsmall noisy steps ({constraint}): worst exact norm {worst:.9f}")
    assert worst <= 1 + S4_TOLERANCE


# -------------------------------------------------------------- 5. deel-lip
def test_deel_lip_stride1_factor_exceeds_one_where_lipdp_does_not():
    from deel.lip.layers.convolutional import _compute_conv_lip_factor

    shape = (16, 16, 1)
    box = _box_kernel(3)
    assert _svd_norm(box.reshape(-1, 1)) == pytest.approx(1.0)
    deel_factor = float(_compute_conv_lip_factor((3, 3), (1, 1), (None, *shape), "channels_last"))
    lipdp_factor = layers.DP_SpectralConv2D(1, 3).correction
    assert deel_factor > lipdp_factor == pytest.approx(1 / 3)
    deel_norm = audit.conv_operator_norm(box * deel_factor, shape)
    lipdp_norm = audit.conv_operator_norm(box * lipdp_factor, shape)
    np.testing.assert_allclose(
        float(deel_norm), _jacobian_norm(box * deel_factor, shape, (1, 1), "same"), rtol=1e-10
    )
    print(
        f"\ndeel-lip factor {deel_factor:.6f}: exact norm {float(deel_norm):.6f}; "
        f"lipdp factor {lipdp_factor:.6f}: exact norm {float(lipdp_norm):.6f}"
    )
    assert float(deel_norm) > 1.0
    assert float(lipdp_norm) <= 1.0


# ---------------------------------------------------------------- 6. audit_model
def _small_model(input_shape=(8, 8, 1)):
    return DP_Sequential(
        [
            layers.DP_BoundedInput(input_shape=input_shape, upper_bound=1.0),
            layers.DP_QuickSpectralConv2D(8, 3, name="conv"),
            layers.DP_GroupSort(2),
            *layers.make_residuals(
                "1-lip-add",
                [
                    layers.DP_SpectralConv2D(8, 3, strides=1, name="res_conv"),
                ],
            ),
            layers.DP_SpectralConv2D(4, 3, strides=2, name="strided_conv"),
            layers.DP_Flatten(),
            layers.DP_QuickSpectralDense(10, name="dense"),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_metadata(input_shape),
    )


def test_audit_model_fresh_model_is_sound():
    tf.keras.utils.set_random_seed(7)
    model = _small_model()
    records = audit.audit_model(model)
    assert [r.name for r in records] == ["conv", "res_conv", "strided_conv", "dense"]
    assert [r.kind for r in records] == ["conv2d", "conv2d", "conv2d", "dense"]
    assert [r.input_shape for r in records] == [(8, 8, 1), (8, 8, 8), (8, 8, 8), None]
    assert all(r.ok and r.exact and r.declared == 1.0 for r in records)
    assert audit.assert_sound(model) == records
    # Independent check of one convolution on its real input shape.
    conv = model.get_layer("strided_conv")
    reference = _jacobian_norm(conv.effective_kernel().numpy(), (8, 8, 8), (2, 2), "same")
    np.testing.assert_allclose(records[2].measured, reference, rtol=1e-9)


def test_audit_model_reports_scaled_kernels():
    tf.keras.utils.set_random_seed(8)
    model = _small_model()
    before = {r.name: r.measured for r in audit.audit_model(model)}
    dense = model.get_layer("dense")
    dense.kernel.assign(dense.kernel * 1.1)  # bypasses the projection
    conv = model.get_layer("conv")
    # A smooth kernel of reshaped norm 1 (nearly tight), then scaled by 1.1.
    smooth = np.full(conv.kernel.shape, 1.0 / np.sqrt(np.prod(conv.kernel.shape)), np.float32)
    conv.kernel.assign(smooth * 1.1)
    records = {r.name: r for r in audit.audit_model(model)}
    assert not records["dense"].ok and records["dense"].exact
    assert records["dense"].measured == pytest.approx(1.1 * before["dense"], rel=1e-6)
    assert not records["conv"].ok and records["conv"].measured > 1.0
    assert records["res_conv"].ok and records["strided_conv"].ok
    with pytest.raises(audit.SensitivityViolation) as info:
        audit.assert_sound(model)
    assert {r.name for r in info.value.records} == {"dense", "conv"}
    assert "dense" in str(info.value) and "VIOLATION" in str(info.value)
    assert isinstance(info.value, AssertionError)
    # Projecting again restores the guarantee.
    model.project()
    assert all(r.ok for r in audit.assert_sound(model))


def test_audit_model_large_input_uses_certified_bound():
    tf.keras.utils.set_random_seed(9)
    model = _small_model(input_shape=(24, 24, 1))
    records = audit.audit_model(model, max_exact_size=1024)
    methods = {r.name: r.method for r in records}
    assert methods == {
        "conv": "svd",
        "res_conv": "fft-bound",
        "strided_conv": "fft-bound",
        "dense": "svd",
    }
    assert all(r.ok for r in records)
    assert audit.OperatorNorm(1.5, "fft-bound").exact is False


def test_orthogonal_projection_is_safe_with_a_misleading_power_vector():
    """The Gershgorin certificate, not the power iteration, guarantees the norm."""
    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.normal(size=(32, 16)))
    singular = np.linspace(0.5, 1.0, 16)
    singular[0] = 25.0  # one direction blown up by a hostile step
    v, _ = np.linalg.qr(rng.normal(size=(16, 16)))
    matrix = tf.constant((q * singular) @ v.T, tf.float32)
    misleading = tf.constant(v[:, 1:2].T, tf.float32)  # orthogonal to the top direction
    for iterations in (1, 3, 15):
        projected, _ = projections.orthogonal_projection(
            matrix, misleading, power_iterations=1, bjorck_iterations=iterations
        )
        assert _svd_norm(projected.numpy()) <= 1.0
