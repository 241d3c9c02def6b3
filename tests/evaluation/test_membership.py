"""lipdp.evaluation.membership: attacks on known separations, and on an overfit vs a DP model."""

import math

import numpy as np
import pytest
import tensorflow as tf
from scipy.stats import norm

from lipdp.evaluation import membership


# --------------------------------------------------------------------- membership inference
def test_auroc_and_advantage_hand_values():
    assert membership.roc_auc([1, 3], [2, 0]) == pytest.approx(0.75)
    assert membership.attacker_advantage([1, 3], [2, 0]) == pytest.approx(0.5)
    # ties count 1/2
    assert membership.roc_auc([1, 1], [1, 0]) == pytest.approx(0.75)
    assert membership.attacker_advantage([1, 1], [1, 0]) == pytest.approx(0.5)
    result = membership.loss_threshold_attack([0.1, 0.2], [0.3, 0.4])
    assert (result.auroc, result.advantage) == (1.0, 1.0)
    assert membership.dp_advantage_bound(0.0) == 0.0
    assert membership.dp_advantage_bound(math.log(3.0)) == pytest.approx(0.5)


def test_attacks_on_synthetic_scores_with_known_separation():
    rng = np.random.default_rng(0)
    n = 20000
    members, nonmembers = rng.normal(1.0, 1.0, n), rng.normal(0.0, 1.0, n)
    # N(1, 1) vs N(0, 1): AUROC = Phi(1 / sqrt(2)), best advantage 2 Phi(1/2) - 1
    auroc, advantage = norm.cdf(1 / math.sqrt(2)), 2 * norm.cdf(0.5) - 1
    result = membership.loss_threshold_attack(-members, -nonmembers)
    assert result.auroc == pytest.approx(auroc, abs=0.01)
    assert result.advantage == pytest.approx(advantage, abs=0.02)
    lr = membership.logistic_regression_attack(members[:, None], nonmembers[:, None])
    assert lr.auroc == pytest.approx(auroc, abs=0.015)
    assert lr.n_members == n // 2
    # random scores and features: no signal
    noise = membership.loss_threshold_attack(rng.random(2000), rng.random(2000))
    assert abs(noise.auroc - 0.5) < 0.04
    random_features = membership.logistic_regression_attack(
        rng.normal(size=(2000, 4)), rng.normal(size=(2000, 4))
    )
    assert abs(random_features.auroc - 0.5) < 0.05


def test_membership_inference_detects_an_overfit_model_not_the_dp_one(digits, trained):
    tf.keras.utils.set_random_seed(0)
    x_in, y_in = digits.x_train[:50], digits.y_train[:50]
    baseline = tf.keras.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=(8, 8, 1)),
            tf.keras.layers.Dense(256, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    baseline.compile(
        optimizer=tf.keras.optimizers.Adam(0.01),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    logged = []
    metrics = membership.PrivacyMetrics(
        (x_in, y_in, digits.x_test, digits.y_test), log_fn=logged.append, by_class=False
    )
    # 200 steps on the same 50 rows, as one epoch (Keras' per-epoch cost, not the steps,
    # made 200 epochs of one step take seconds); the callback attacks at the end of training.
    repeated = (np.tile(x_in, (200, 1, 1, 1)), np.tile(y_in, 200))
    baseline.fit(*repeated, batch_size=50, epochs=1, shuffle=False, verbose=0, callbacks=[metrics])
    overfit = logged[0]["mia_auc_entire_dataset"]
    assert overfit > 0.7, metrics.attack_results.format()
    assert metrics.attack_results.result("logistic regression").auroc > 0.6
    model, x, y = trained
    dp = membership.membership_inference(model, x, y, digits.x_test, digits.y_test).summary()
    assert dp["mia_auc_entire_dataset"] < overfit - 0.1


def test_labels_of_shape_n_by_1_are_class_indices():
    """``(n, 1)`` labels are indices, as ``(n,)`` ones (they were once read as one-hot rows,
    which made every label class 0)."""
    probs = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    labels = np.array([1, 0, 1])
    expected = -np.log(probs[np.arange(3), labels])
    for shaped in (labels, labels[:, None], np.eye(2)[labels]):
        np.testing.assert_allclose(membership.per_example_loss(probs, shaped), expected)
