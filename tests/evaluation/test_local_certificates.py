"""Certified radii that ``lipdp evaluate`` reports, against independent computations.

* Without a group normalisation: the global certificate ``margin / (sqrt(2) L)`` with ``L``
  the product of the kernels' exact spectral norms (numpy SVD of the weights).
* With one (the scattering network of ``lipdp train``): the local certificate of
  :mod:`lipdp.evaluation.local_certificates` against a float64 numpy forward pass and a
  bisection on the certificate's condition (not the closed form); then the radius
  attacked: random directions and PGD at 0.999 times it never change the decision,
  while the same attack at a few times the radius does (it has teeth).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.evaluation import local_certificates, outputs, robustness
from lipdp.model import DPParameters
from lipdp.recipes import run_evaluation
from tests.evaluation_helpers import vector_model

INPUT_DIM, HIDDEN, GROUPS, CLASSES = 6, 12, 3, 5
ALPHA = 1e-3
BOUND_1, BOUND_2 = 2.5, 1.5


def _set_kernel(layer, rng, norm):
    """A random kernel rescaled to spectral norm exactly ``norm`` (its constraint's ball)."""
    shape = tuple(layer.kernel.shape)
    w = rng.normal(size=shape)
    layer.kernel.assign((w * norm / np.linalg.norm(w, 2)).astype("float32"))


def _model(group_norm: bool, seed=0):
    rng = np.random.default_rng(seed)
    first = L.DP_QuickSpectralDense(HIDDEN, weight_norm_bound=BOUND_1, name="first")
    last = L.DP_QuickSpectralDense(CLASSES, weight_norm_bound=BOUND_2, name="last")
    middle = [L.DP_GroupNormalization(GROUPS, ALPHA)] if group_norm else [L.DP_GroupSort(2)]
    model = vector_model([first, *middle, last], input_dim=INPUT_DIM, upper_bound=3.0)
    model(np.zeros((1, INPUT_DIM), "float32"))
    _set_kernel(first, rng, BOUND_1)
    _set_kernel(last, rng, BOUND_2)
    return model


def _data(n=64, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, INPUT_DIM)).astype("float32")
    return x


class _Data:
    def __init__(self, x, y):
        self.x_test, self.y_test = x, y


def _evaluate(model, x):
    """``lipdp evaluate``'s measurements, labelled by the model's own predictions (so that
    every example is correct and has a certificate to check)."""
    predicted = outputs.predict_logits(model, x).argmax(axis=1)
    y = np.eye(CLASSES, dtype="float32")[predicted]
    config = run_evaluation.EvaluationConfig(radii=(0.0, 0.05, 0.2), attack_steps=0)
    return run_evaluation.evaluate_model(model, _Data(x, y), x, y, config), predicted


def _margins(logits):
    top2 = np.sort(np.asarray(logits, np.float64), axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def _numpy_forward(model, x, group_norm):
    """The model in float64 numpy: clip to the ball, dense, (group norm | group sort), dense."""
    w1 = model.get_layer("first").kernel.numpy().astype(np.float64)
    w2 = model.get_layer("last").kernel.numpy().astype(np.float64)
    x = np.asarray(x, np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x * np.minimum(1.0, 3.0 / np.maximum(norms, 1e-30))
    u = x @ w1
    if group_norm:
        g = u.reshape(len(u), GROUPS, -1)
        z = g - g.mean(axis=2, keepdims=True)
        sd = np.sqrt(np.maximum(np.mean(z**2, axis=2, keepdims=True), ALPHA**2))
        h = (z / sd).reshape(len(u), -1)
    else:
        pairs = u.reshape(len(u), -1, 2)
        h = np.sort(pairs, axis=2).reshape(len(u), -1)
    return u, h @ w2


# ------------------------------------------------------------------ global certificate
def test_the_global_radius_is_margin_over_sqrt2_times_the_product_of_svd_norms():
    model = _model(group_norm=False)
    x = _data()
    results, _ = _evaluate(model, x)
    assert results.certificate == "global"
    w1 = model.get_layer("first").kernel.numpy()
    w2 = model.get_layer("last").kernel.numpy()
    lipschitz = np.linalg.norm(w1.astype(np.float64), 2) * np.linalg.norm(w2, 2)
    assert results.lipschitz == pytest.approx(lipschitz, rel=1e-5)
    _, logits = _numpy_forward(model, x, group_norm=False)
    np.testing.assert_allclose(
        results.radius, _margins(logits) / (math.sqrt(2) * lipschitz), rtol=1e-3, atol=1e-6
    )
    expected = [1.0, np.mean(results.radius > 0.05), np.mean(results.radius > 0.2)]
    np.testing.assert_allclose(results.certified, expected)


# ------------------------------------------------------------------- local certificate
def _bisection_radius(margin, s, before, after, group_size):
    """The largest ``rho`` with ``sqrt2 before after sqrt(n) rho / max(a, s - before rho) <
    margin``, found numerically on the condition itself."""
    a = ALPHA * math.sqrt(group_size)

    def holds(rho):
        t = max(a, s - before * rho)
        return math.sqrt(2) * before * after * math.sqrt(group_size) * rho / t < margin

    lo, hi = 0.0, 1.0
    while holds(hi):
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


def test_the_local_radius_matches_a_numpy_forward_pass_and_a_bisection():
    model = _model(group_norm=True)
    x = _data()
    results, _ = _evaluate(model, x)
    assert results.certificate == "local"
    assert results.lipschitz == pytest.approx(BOUND_1 * BOUND_2 / ALPHA, rel=1e-5)
    u, logits = _numpy_forward(model, x, group_norm=True)
    np.testing.assert_allclose(logits, outputs.predict_logits(model, x), rtol=1e-4, atol=1e-4)
    g = u.reshape(len(u), GROUPS, -1)
    s = np.linalg.norm(g - g.mean(axis=2, keepdims=True), axis=2).min(axis=1)
    w1 = model.get_layer("first").kernel.numpy().astype(np.float64)
    w2 = model.get_layer("last").kernel.numpy().astype(np.float64)
    before, after = np.linalg.norm(w1, 2), np.linalg.norm(w2, 2)
    expected = [
        _bisection_radius(m, si, before, after, HIDDEN // GROUPS)
        for m, si in zip(_margins(logits), s)
    ]
    np.testing.assert_allclose(results.radius, expected, rtol=1e-3)
    # Never below the global certificate, and here far above it.
    global_radius = _margins(logits) / (math.sqrt(2) * results.lipschitz)
    assert np.all(results.radius >= global_radius * (1 - 1e-6))
    assert np.median(results.radius / global_radius) > 50


def test_the_closed_form_takes_both_branches():
    """``s <= a`` (the floor: the global certificate) and ``s > a`` (the slope)."""
    radius = local_certificates.radius_from_slopes(
        margins=[1.0, 1.0, 1.0],
        smallest_group_norms=[0.5, 2.0, 100.0],
        before=1.0,
        after=1.0,
        alpha=0.5,  # a = 1 for groups of 4
        group_size=4,
        factor=1.0,
    )
    # k = 1 / 2; s = 0.5 <= a: k a = 0.5; s = 2: rho_0 = 1 >= k a, k s / (1 + k) = 2 / 3;
    # s = 100: 50 / 1.5.
    np.testing.assert_allclose(radius, [0.5, 2 / 3, 100 / 3])


def test_models_outside_the_scope_keep_the_global_certificate():
    two = vector_model(
        [
            L.DP_QuickSpectralDense(HIDDEN),
            L.DP_GroupNormalization(GROUPS, ALPHA),
            L.DP_QuickSpectralDense(HIDDEN),
            L.DP_GroupNormalization(GROUPS, ALPHA),
            L.DP_QuickSpectralDense(CLASSES),
        ],
        input_dim=INPUT_DIM,
    )
    assert local_certificates.group_norm_split(two) is None
    assert local_certificates.local_certified_radius(two, _data(4)) is None
    _, kind = robustness.model_certified_radius(two, _data(4))
    assert kind == "global"


def test_no_perturbation_inside_the_local_radius_changes_the_decision():
    model = _model(group_norm=True, seed=3)
    x = _data(48, seed=4)
    results, predicted = _evaluate(model, x)
    radius = results.radius
    assert np.all(radius > 0)
    rng = np.random.default_rng(5)
    for _ in range(20):  # random directions on the sphere of 0.999 times the radius
        d = rng.normal(size=x.shape)
        d *= (0.999 * radius / np.linalg.norm(d, axis=1))[:, None]
        moved = outputs.predict_logits(model, (x + d).astype("float32")).argmax(axis=1)
        np.testing.assert_array_equal(moved, predicted)
    _, margin = robustness.pgd_l2_attack(
        model, x, predicted, 0.999 * radius, steps=40, restarts=4, seed=0
    )
    assert np.all(margin < 0), f"adversarial example inside a certificate: {margin.max()}"
    # The attack has teeth: at 30 times the certified radius it changes decisions.
    _, margin = robustness.pgd_l2_attack(model, x, predicted, 30 * radius, steps=40, restarts=2)
    assert np.mean(margin > 0) > 0.2


def test_evaluate_prints_the_constant_and_the_median_radius():
    from lipdp.cli import output

    model = _model(group_norm=True)
    results, _ = _evaluate(model, _data())
    config = run_evaluation.EvaluationConfig(radii=(0.0, 0.05, 0.2), attack_steps=0)
    lines = output.evaluation_lines(results, config)
    text = "\n".join(lines)
    assert (
        f"Lipschitz constant w.r.t. the raw input (from the layers): {results.lipschitz:.6g}"
        in text
    )
    assert "local certificate" in text
    assert f"median {np.median(results.radius):.4g}" in text


def test_a_batch_size_of_zero_is_refused():
    with pytest.raises(ValueError, match="batch_size"):
        local_certificates.local_certified_radius(_model(True), _data(2), batch_size=0)


def test_the_scattering_network_is_in_scope():
    from lipdp.foundation.metadata import DatasetMetadata
    from lipdp.recipes import zoo

    meta = DatasetMetadata(
        input_shape=(8, 8, 1), nb_classes=10, nb_samples_train=64, batch_size=16, max_norm=5.0
    )
    model = zoo.build_model("scattering_net", meta, DPParameters("global", 1.0, 1e-5))
    model(tf.zeros((1, 8, 8, 1)))
    split = local_certificates.group_norm_split(model)
    assert split is not None
    assert split.lipschitz == pytest.approx(robustness.lipschitz_constant(model))
    assert split.before * split.after / split.layer.alpha == pytest.approx(split.lipschitz)
