"""The scattering layer: Kymatio's transform, and a Lipschitz certificate that holds.

References: explicit operator matrices built with *spatial* circular convolutions
(no FFT) and their SVDs; autodiff Jacobians and their SVDs; gradient ascent on pairs
of inputs; Kymatio 0.3.0 itself (a dev dependency).
"""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses, wavelets
from lipdp.clipless.features import fixed_features, front_end_bound
from lipdp.clipless.layers.scattering import DP_ScatteringTransform
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.recipes import zoo


def _layer(shape, **options):
    layer = DP_ScatteringTransform(**options)
    layer.build((None, *shape))
    return layer


# ------------------------------------------------------------- node norms vs SVD
def _spatial_filter_outputs(image, h_fourier, factor):
    """``(image * h) down factor`` with a spatial circular convolution (no FFT)."""
    kernel = np.fft.ifft2(h_fourier)
    rows, cols = image.shape
    out = np.zeros((rows, cols), dtype=np.complex128)
    for p in range(rows):
        for q in range(cols):
            out += image[p, q] * np.roll(np.roll(kernel, p, axis=0), q, axis=1)
    return out[::factor, ::factor]


def _explicit_operator(image_shape, pads, mode, filters, factors, weights, complex_inputs):
    """Matrix of ``x -> (sqrt(w_i) (E x * h_i) down s_i)_i`` column by column."""
    size = int(np.prod(image_shape))
    columns = []
    basis = list(np.eye(size))
    if complex_inputs:
        basis += [1j * e for e in np.eye(size)]
    numpy_mode = "reflect" if mode == "reflect" else "constant"
    for e in basis:
        image = np.pad(e.reshape(image_shape), pads, mode=numpy_mode)
        parts = [
            np.sqrt(w) * _spatial_filter_outputs(image, h, k).ravel()
            for h, k, w in zip(filters, factors, weights)
        ]
        out = np.concatenate(parts)
        columns.append(np.concatenate([out.real, out.imag]))
    return np.stack(columns, axis=1)


def _random_filters(rng, grid, count, complex_values):
    filters = rng.normal(size=(count, *grid))
    if complex_values:
        filters = filters + 1j * rng.normal(size=(count, *grid))
    return list(filters)


@pytest.mark.parametrize("complex_values", [False, True])
def test_real_bank_norm_is_the_exact_operator_norm_on_real_inputs(complex_values):
    rng = np.random.default_rng(0)
    grid, factors = (8, 8), [1, 2, 4, 2]
    filters = _random_filters(rng, grid, len(factors), complex_values)
    weights = list(rng.uniform(0.2, 2.0, size=len(factors)))
    spectra = wavelets._basis_spectra(grid, [(0, 0), (0, 0)], "zeros")
    bound = wavelets.real_bank_norm(spectra, filters, factors, weights)
    matrix = _explicit_operator(grid, [(0, 0), (0, 0)], "zeros", filters, factors, weights, False)
    exact = np.linalg.svd(matrix, compute_uv=False)[0]
    assert exact <= bound <= exact * (1 + 1e-6)


@pytest.mark.parametrize("mode", ["reflect", "zeros"])
def test_real_bank_norm_includes_the_padding_exactly(mode):
    rng = np.random.default_rng(1)
    image, pads = (5, 6), [(2, 1), (1, 1)]
    grid = (8, 8)
    filters, factors = _random_filters(rng, grid, 2, True), [1, 2]
    spectra = wavelets._basis_spectra(image, pads, mode)
    bound = wavelets.real_bank_norm(spectra, filters, factors, [1.0, 0.5])
    matrix = _explicit_operator(image, pads, mode, filters, factors, [1.0, 0.5], False)
    exact = np.linalg.svd(matrix, compute_uv=False)[0]
    assert exact <= bound <= exact * (1 + 1e-6)


def test_coset_bound_is_the_exact_norm_on_complex_inputs():
    """The large-grid fallback: exact for complex inputs, hence >= the real-input norm."""
    rng = np.random.default_rng(2)
    grid, factors = (8, 8), [4, 1, 2]
    filters = _random_filters(rng, grid, 3, True)
    weights = [1.0, 0.3, 2.0]
    bound = wavelets.decimated_bank_norm(filters, factors, weights)
    matrix = _explicit_operator(grid, [(0, 0), (0, 0)], "zeros", filters, factors, weights, True)
    exact = np.linalg.svd(matrix, compute_uv=False)[0]
    assert exact <= bound <= exact * (1 + 1e-6)
    spectra = wavelets._basis_spectra(grid, [(0, 0), (0, 0)], "zeros")
    assert wavelets.real_bank_norm(spectra, filters, factors, weights) <= bound * (1 + 1e-9)


def test_large_grids_fall_back_to_the_complex_coset_bound(monkeypatch):
    """Above DENSE_LIMIT pixels each node uses the coset bound times the padding's norm:
    never below the exact real-input constant."""
    bank = wavelets.morlet_filter_bank((16, 16), 2, 4)
    dense = wavelets.scattering_lipschitz(bank, (9, 9), 2, "reflect")
    monkeypatch.setattr(wavelets, "DENSE_LIMIT", 0)
    fallback = wavelets.scattering_lipschitz(bank, (9, 9), 2, "reflect")
    assert dense <= fallback <= 2.5 * dense


def test_padding_norm_counts_copies():
    # Reflecting 3 pixels of a 5-pixel axis copies pixels 1..3 twice; 2 x 2 = 4 copies max.
    assert wavelets.padding_norm((5, 5), [(3, 0), (0, 3)], "reflect") == pytest.approx(2.0)
    assert wavelets.padding_norm((5, 5), [(3, 3), (3, 3)], "zeros") == 1.0


# ---------------------------------------------------------- the layer's constant
def _worst_pair_ratio(layer, shape, steps, seed=0, batch=8):
    """Gradient ascent on ``||S(x + d) - S(x)|| / ||d||`` over ``x`` and ``d``."""
    rng = np.random.default_rng(seed)
    x = tf.Variable(rng.normal(size=(batch, *shape)).astype("float32"))
    d = tf.Variable(rng.normal(size=(batch, *shape)).astype("float32"))
    optimizer = tf.keras.optimizers.Adam(0.05)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            diff = tf.reshape(layer(x + d) - layer(x), [batch, -1])
            ratios = tf.norm(diff, axis=1) / tf.norm(tf.reshape(d, [batch, -1]), axis=1)
            loss = -tf.reduce_sum(ratios)
        optimizer.apply_gradients(zip(tape.gradient(loss, [x, d]), [x, d]))
        return ratios

    worst = 0.0
    for _ in range(steps):
        worst = max(worst, float(tf.reduce_max(step())))
    return worst, x.numpy()


def _jacobian_norms(layer, x, iterations=40):
    """Largest singular value of the autodiff Jacobian at each point of ``x``: power
    iteration on ``J^T J`` (a forward-mode JVP, then a VJP), from below. One iteration is
    one traced function (the eager layer calls took ~90 % of the test's time)."""

    @tf.function
    def iterate(point, v):
        v = v / tf.norm(v)
        with tf.GradientTape() as tape:
            tape.watch(point)
            with tf.autodiff.ForwardAccumulator(point, v) as accumulator:
                y = layer(point)
            jv = accumulator.jvp(y)
            scalar = tf.reduce_sum(tf.stop_gradient(jv) * y)
        return tape.gradient(scalar, point)  # J^T J v

    norms = []
    for point in x:
        point = tf.constant(point[None])
        v = tf.random.stateless_normal(point.shape, seed=(0, 1))
        sigma = 0.0
        for _ in range(iterations):
            v = iterate(point, v)
            sigma = float(tf.sqrt(tf.norm(v)))
        norms.append(sigma)
    return norms


@pytest.mark.parametrize(
    "shape, options, tightness",
    [
        pytest.param(  # ~45 s: make test-slow
            (28, 28, 1), dict(J=2, L=8, padding="zeros"), 0.9, marks=pytest.mark.slow
        ),
        ((12, 10, 1), dict(J=2, L=4, padding="reflect"), 0.6),
        ((9, 9, 1), dict(J=1, L=6, padding="reflect", max_order=1), 0.45),
    ],
)
def test_lipschitz_constant_holds_under_adversarial_pairs_and_jacobians(shape, options, tightness):
    layer = _layer(shape, **options)
    worst, points = _worst_pair_ratio(layer, shape, steps=60 if shape[0] > 20 else 150)
    assert worst <= layer.lipschitz
    assert worst >= tightness * layer.lipschitz  # the certificate is not vacuous
    blank = np.zeros((1, *shape), dtype="float32")  # every modulus at its kink
    random = np.random.default_rng(3).uniform(size=(1, *shape)).astype("float32")
    for norm in _jacobian_norms(layer, np.concatenate([points[:2], blank, random])):
        assert norm <= layer.lipschitz
    print(f"\nscattering {options}: certified {layer.lipschitz:.4f}, reached {worst:.4f}")


def test_output_norm_bound_holds_and_zero_maps_to_zero():
    shape = (12, 12, 2)
    layer = _layer(shape, J=2, L=4)
    assert float(tf.reduce_max(tf.abs(layer(tf.zeros((1, *shape)))))) == 0.0
    x = tf.Variable(np.random.default_rng(4).normal(size=(8, *shape)).astype("float32"))
    optimizer = tf.keras.optimizers.Adam(0.05)
    worst = 0.0
    for _ in range(80):
        with tf.GradientTape() as tape:
            ratios = tf.norm(tf.reshape(layer(x), [8, -1]), axis=1) / tf.norm(
                tf.reshape(x, [8, -1]), axis=1
            )
            loss = -tf.reduce_sum(ratios)
        optimizer.apply_gradients([(tape.gradient(loss, x), x)])
        worst = max(worst, float(tf.reduce_max(ratios)))
    assert 0.5 * layer.lipschitz <= worst <= layer.lipschitz
    assert layer.propagate_inputs(2.0) == pytest.approx(2.0 * layer.lipschitz)
    assert layer.backpropagate_inputs(2.0, 3.0) == pytest.approx(3.0 * layer.lipschitz)


def test_certified_constants_of_the_standard_configuration():
    """J = 2, L = 8 on 28 x 28: the values the docstrings quote (and the zero padding's
    constant is about half the reflection's, whose corners are copied 4 times)."""
    assert _layer((28, 28, 1), padding="zeros").lipschitz == pytest.approx(0.2550, abs=1e-4)
    assert _layer((28, 28, 1), padding="reflect").lipschitz == pytest.approx(0.4925, abs=1e-4)


# ------------------------------------------------------------- Kymatio and shapes
def test_filters_and_transform_match_kymatio(monkeypatch):
    import scipy.special

    # Kymatio 0.3.0 imports scipy.special.sph_harm (3-D module), removed in SciPy 1.15;
    # the 2-D transform never calls it.
    monkeypatch.setattr(scipy.special, "sph_harm", lambda *a: None, raising=False)
    kymatio_numpy = pytest.importorskip("kymatio.numpy")
    from kymatio.scattering2d.filter_bank import filter_bank

    reference = filter_bank(36, 36, 2, 8)
    ours = wavelets.morlet_filter_bank((36, 36), 2, 8)
    for theirs, mine in zip(reference["phi"]["levels"], ours.phi):
        np.testing.assert_allclose(mine, theirs, atol=1e-4 * np.abs(theirs).max())
    for theirs, mine in zip(reference["psi"], ours.psi):
        assert (theirs["j"], theirs["theta"]) == (mine.j, mine.theta)
        for res, level in enumerate(theirs["levels"]):
            np.testing.assert_allclose(mine.levels[res], level, atol=1e-4)
    images = np.random.default_rng(5).uniform(size=(3, 28, 28)).astype("float32")
    expected = kymatio_numpy.Scattering2D(J=2, shape=(28, 28), L=8)(images)  # (3, 81, 7, 7)
    got = _layer((28, 28, 1))(images[..., None]).numpy().transpose(0, 3, 1, 2)
    np.testing.assert_allclose(got, expected, atol=1e-4 * np.abs(expected).max())


def test_channels_are_transformed_separately_and_shapes_agree():
    layer = _layer((10, 13, 2), J=2, L=3)
    x = np.random.default_rng(6).uniform(size=(2, 10, 13, 2)).astype("float32")
    out = layer(x).numpy()
    assert out.shape == tuple(layer.compute_output_shape((2, 10, 13, 2)))
    per_channel = wavelets.coefficients_per_channel(2, 3)
    assert out.shape == (2, 2, 3, 2 * per_channel)
    single = _layer((10, 13, 1), J=2, L=3)
    for c in range(2):
        np.testing.assert_allclose(
            out[..., c * per_channel : (c + 1) * per_channel],
            single(x[..., c : c + 1]).numpy(),
            atol=1e-6,
        )


def test_bad_configurations_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="padding='zeros'"):
        _layer((4, 4, 1), J=2, padding="reflect")
    with pytest.raises(ValueError, match="output would be empty"):
        _layer((3, 8, 1), J=2, padding="zeros")
    with pytest.raises(ValueError, match="height, width, channels"):
        _layer((16,), J=1)
    with pytest.raises(ValueError, match="padding"):
        DP_ScatteringTransform(padding="symmetric")
    with pytest.raises(ValueError, match="max_order"):
        DP_ScatteringTransform(max_order=3)


# ------------------------------------------------------------ in models and features
def _metadata(shape=(12, 12, 1), n=64, batch=16):
    """``n``: the declared training set; ``fit`` on arrays needs the arrays to hold it."""
    return DatasetMetadata(
        input_shape=shape, nb_classes=3, nb_samples_train=n, batch_size=batch, max_norm=4.0
    )


def test_scattering_net_saves_and_reloads_with_its_bounds(tmp_path):
    meta = _metadata(n=16)  # the 16 examples fitted below
    model = zoo.build_model(
        "scattering_net", meta, DPParameters("global", 1.0, 1e-5), J=2, L=4, groups=5, widths=(4,)
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(tau=4.0))
    x = np.random.default_rng(7).uniform(size=(16, 12, 12, 1)).astype("float32")
    y = np.eye(3, dtype="float32")[np.arange(16) % 3]
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "scattering.keras"
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-5)
    assert loaded.layers[1].get_config()["L"] == 4
    assert [float(s) for _, s in loaded.sensitivities()] == pytest.approx(
        [float(s) for _, s in model.sensitivities()]
    )


def test_fixed_features_give_the_model_outputs_and_the_propagated_bound():
    front = zoo.scattering_net(_metadata(), J=2, L=4, groups=5, alpha=0.5)[:3]
    x = np.random.default_rng(8).uniform(size=(10, 12, 12, 1)).astype("float32")
    features, bound = fixed_features(front, x, batch_size=4)
    np.testing.assert_allclose(features, tf.keras.Sequential(front)(x).numpy(), atol=1e-6)
    lip = front[1].lipschitz
    expected = min(4.0 * lip / 0.5, np.sqrt(np.prod(features.shape[1:])))
    assert bound == pytest.approx(expected)
    assert front_end_bound(front) == pytest.approx(expected)
    assert np.linalg.norm(features.reshape(10, -1), axis=1).max() <= bound * (1 + 1e-6)


def test_fixed_features_refuse_weights_and_unbounded_fronts():
    with pytest.raises(ValueError, match="weightless"):
        fixed_features(
            [L.DP_BoundedInput(input_shape=(4,), upper_bound=1.0), L.DP_SpectralDense(2)],
            np.ones((2, 4), "float32"),
        )
    with pytest.raises(ValueError, match="DP_BoundedInput"):
        front_end_bound([DP_ScatteringTransform()])


def test_the_clipped_family_takes_the_layer():
    from lipdp.clipped.model import DPSGD_Sequential

    model = DPSGD_Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=(12, 12, 1)),
            DP_ScatteringTransform(J=2, L=4),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(3),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_metadata(n=16),  # the 16 examples fitted below
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    x = np.random.default_rng(9).uniform(size=(16, 12, 12, 1)).astype("float32")
    before = [w.numpy().copy() for w in model.trainable_variables]
    model.fit(x, np.eye(3, dtype="float32")[np.arange(16) % 3], batch_size=16, verbose=0)
    assert any(not np.allclose(b, w.numpy()) for b, w in zip(before, model.trainable_variables))


def test_a_dp_model_with_the_layer_trains():
    meta = _metadata(n=16)  # the 16 examples fitted below
    model = DP_Sequential(
        zoo.scattering_net(meta, J=2, L=4, groups=None),
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=meta,
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(tau=4.0))
    x = np.random.default_rng(10).uniform(size=(16, 12, 12, 1)).astype("float32")
    history = model.fit(x, np.eye(3, dtype="float32")[np.arange(16) % 3], epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
