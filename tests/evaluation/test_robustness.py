"""lipdp.evaluation.robustness: Lipschitz constants, certificates against attacks, AUC metrics."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.evaluation import outputs, robustness
from tests.evaluation_helpers import vector_model


# --------------------------------------------------------------------- Lipschitz constant
def test_lipschitz_constant_of_the_shipped_cnn(trained):
    assert robustness.lipschitz_constant(trained[0]) == pytest.approx(1.0)


def _identity_dense(units):
    layer = L.DP_QuickSpectralDense(units)
    layer.build((None, units))
    layer.kernel.assign(tf.eye(units))
    return layer


@pytest.mark.parametrize(
    "policy, path_constant, expected",
    [("add", 1.0, 2.0), ("1-lip-add", 1.0, 1.0), ("add", 3.0, 4.0), ("1-lip-add", 3.0, 2.0)],
)
def test_lipschitz_constant_of_residual_blocks(policy, path_constant, expected):
    path = [_identity_dense(6)]
    if path_constant != 1.0:
        path.append(
            L.DP_Lambda(
                lambda t, c=path_constant: c * t,
                lipschitz_constant=path_constant,
                output_gain=path_constant,
            )
        )
    model = vector_model([*L.make_residuals(policy, path), L.DP_QuickSpectralDense(5)])
    lip = robustness.lipschitz_constant(model)
    assert lip == pytest.approx(expected)
    # The skip path and the identity kernel make the block exactly (1 + c) or
    # (1 + c) / 2 times the identity: the constant is attained.
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32") * 0.1

    def block(t):
        for layer in model.dp_layers[1:-1]:
            t = layer(t)
        return t.numpy()

    x2 = x + 0.01
    ratio = np.linalg.norm(block(x2) - block(x), axis=1) / np.linalg.norm(x2 - x, axis=1)
    np.testing.assert_allclose(ratio, expected, rtol=1e-5)


def test_lipschitz_constant_of_nested_residual_blocks():
    # outer "add" around [inner "add" around an identity kernel]: x + (x + x) = 3x
    inner = [
        L.DP_SplitResidual(),
        L.DP_WrappedResidual(_identity_dense(6)),
        L.DP_MergeResidual("add"),
    ]
    model = vector_model([*L.make_residuals("add", inner), L.DP_QuickSpectralDense(5)])
    assert robustness.lipschitz_constant(model) == pytest.approx(3.0)
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32") * 0.1
    h = x
    for layer in model.dp_layers[1:-1]:
        h = layer(h)
    np.testing.assert_allclose(h.numpy(), 3 * x, rtol=1e-5, atol=1e-6)


def test_clip_gradient_counts_as_identity_and_blocks_compose():
    model = vector_model(
        [
            *L.make_residuals("add", [L.DP_QuickSpectralDense(6)]),
            L.DP_ClipGradient(0.01),
            *L.make_residuals("add", [L.DP_QuickSpectralDense(6), L.DP_ClipGradient(0.5)]),
            L.DP_QuickSpectralDense(5),
            L.DP_ClipGradient(0.1),
        ]
    )
    assert robustness.lipschitz_constant(model) == pytest.approx(4.0)


# -------------------------------------------------------------------------- certificates
def test_certified_radius_and_accuracy_hand_values():
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 0.5, 0.4], [2.0, 0.0, 2.5]])
    np.testing.assert_allclose(
        robustness.certified_radius(logits, 1.0),
        [math.sqrt(2), 0.1 / math.sqrt(2), 0.5 / 1.4142135623730951],
    )
    np.testing.assert_allclose(robustness.certified_radius(logits, 2.0)[0], math.sqrt(2) / 2)
    # single logit: decision f > 0, radius |f| / L
    np.testing.assert_allclose(
        robustness.certified_radius(np.array([[-1.5], [0.2]]), 0.5), [3, 0.4]
    )
    # labels: 0 (correct, r = 1.414), 2 (wrong), 2 (correct, r = 0.354)
    acc = robustness.certified_accuracy_from_logits(
        logits, [0, 2, 2], [0, 0.3, 0.36, 1.4, 1.5], 1.0
    )
    np.testing.assert_allclose(acc, [2 / 3, 2 / 3, 1 / 3, 1 / 3, 0])
    onehot = np.eye(3)[[0, 2, 2]]
    np.testing.assert_allclose(
        robustness.certified_accuracy_from_logits(logits, onehot, [0, 0.36], 1.0), [2 / 3, 1 / 3]
    )


def test_no_pgd_attack_succeeds_inside_the_certified_radius(trained, digits):
    model = trained[0]
    lip = robustness.lipschitz_constant(model)
    logits = outputs.predict_logits(model, digits.x_test)
    correct = logits.argmax(axis=1) == digits.y_test
    assert correct.mean() > 0.8
    x, y = digits.x_test[correct], digits.y_test[correct]
    radius = robustness.certified_radius(logits[correct], lip)
    assert np.median(radius) > 0.05
    _, margin = robustness.pgd_l2_attack(model, x, y, 0.999 * radius, steps=30, restarts=3)
    assert np.all(margin < 0), f"adversarial example inside a certificate: {margin.max()}"
    # The same attack is not toothless: at three times the certified radius it
    # changes many decisions.
    x_adv, margin = robustness.pgd_l2_attack(model, x, y, 3 * radius, steps=20, restarts=1)
    assert np.mean(margin > 0) > 0.2
    moved = np.linalg.norm((x_adv - x).reshape(len(x), -1), axis=1)
    assert np.all(moved <= 3 * radius * (1 + 1e-5) + 1e-6)
    flipped = outputs.predict_logits(model, x_adv).argmax(axis=1) != y
    np.testing.assert_array_equal(flipped, margin > 0)


def test_lipschitz_constant_bounds_empirical_ratios(trained, digits):
    model = trained[0]
    lip = robustness.lipschitz_constant(model)
    rng = np.random.default_rng(0)
    a = digits.x_test[:128]
    b = a + rng.normal(size=a.shape).astype("float32") * 0.3
    f = outputs.predict_logits
    ratios = np.linalg.norm(f(model, a) - f(model, b), axis=1) / np.linalg.norm(
        (a - b).reshape(len(a), -1), axis=1
    )
    searched = robustness.empirical_lipschitz(model, digits.x_test[:32], steps=40)
    assert ratios.max() <= lip * (1 + 1e-5)
    assert searched.max() <= lip * (1 + 1e-5)
    assert searched.max() > ratios.max()  # the ascent does push the ratio up


def test_certified_accuracy_is_decreasing_and_starts_at_accuracy(trained, digits):
    model = trained[0]
    radii = np.linspace(0, 2, 9)
    acc = robustness.certified_accuracy(model, digits.x_test, digits.y_test, radii)
    _, clean = model.evaluate(digits.x_test, np.eye(10)[digits.y_test], verbose=0)
    assert acc[0] == pytest.approx(clean, abs=1e-6)
    assert np.all(np.diff(acc) <= 0)


def test_scaled_auc_and_certifiable_auroc_hand_values():
    y = np.array([[1.0], [1.0], [0.0], [0.0]])
    s = np.array([[0.3], [0.1], [0.2], [-0.1]])

    def value(metric):
        metric.update_state(y, s)
        return float(metric.result())

    # 3 of the 4 (positive, negative) pairs are ordered correctly.
    assert value(robustness.ScaledAUC(scale=20.0, num_thresholds=2000)) == pytest.approx(
        0.75, abs=2e-3
    )
    auroc = robustness.CertifiableAUROC
    assert value(auroc(0.0, scale=20.0, num_thresholds=2000)) == pytest.approx(0.75, abs=2e-3)
    # worst-case scores at radius 0.05: positives 0.25, 0.05; negatives 0.25, -0.05:
    # one tie (1/2), two correct pairs, one wrong: 2.5 / 4.
    assert value(auroc(0.05, scale=20.0, num_thresholds=2000)) == pytest.approx(0.625, abs=2e-3)
    # a Lipschitz constant of 2 doubles the shift: positives 0.2, 0.0; negatives 0.3,
    # 0.0: one correct pair, one tie -> 1.5 / 4
    got = value(auroc(0.05, lipschitz=2.0, scale=20.0, num_thresholds=2000))
    assert got == pytest.approx(0.375, abs=2e-3)
    assert value(auroc(1.0, scale=20.0)) == pytest.approx(0.0, abs=1e-3)
    metric = auroc(0.05, lipschitz=2.0, scale=3.0)
    clone = auroc.from_config(metric.get_config())
    assert (clone.radius, clone.lipschitz, clone.scale) == (0.05, 2.0, 3.0)
    with pytest.raises(ValueError):
        robustness.ScaledAUC(scale=1.0, from_logits=False)
