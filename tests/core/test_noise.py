"""lipdp.core.noise: the one noise rule (standard deviations and accountant multipliers)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.core.noise import add_noise, noise_multipliers, noise_stddevs


def test_noise_multipliers_for_the_accountant():
    assert noise_multipliers("global", 1.5, [1.0, 2.0, 3.0]) == [1.5]
    assert noise_multipliers("per-layer", 1.5, [1.0, 2.0]) == [1.5, 3.0]
    with pytest.raises(ValueError, match="noisify_strategy"):
        noise_multipliers("local", 1.0, [1.0])


def test_noise_stddevs_hand_derived():
    deltas, coefs = [0.3, 0.4], [1.0, 2.0]
    # global: one Gaussian on the whole gradient, sensitivity sqrt(0.09 + 0.16) = 0.5.
    assert [float(s) for s in noise_stddevs("global", 2.0, deltas, coefs)] == pytest.approx(
        [1.0, 1.0]
    )
    # per-layer: sigma * c_v * Delta_v.
    assert [float(s) for s in noise_stddevs("per-layer", 2.0, deltas, coefs)] == pytest.approx(
        [0.6, 1.6]
    )
    assert noise_stddevs("global", 2.0, [], []) == []


def test_stddevs_follow_a_variable_sensitivity():
    clip = tf.Variable(0.5)
    stddev = noise_stddevs("global", 3.0, [clip * 2.0, 0.0], [1.0, 1.0])[0]
    assert float(stddev) == pytest.approx(3.0)
    clip.assign(1.0)
    assert float(noise_stddevs("global", 3.0, [clip * 2.0, 0.0], [1.0, 1.0])[0]) == 6.0


def test_add_noise_has_the_requested_std():
    tf.random.set_seed(0)
    gradients = [tf.zeros((200, 100)), tf.ones((50_000,))]
    noisy = add_noise(gradients, [0.1, tf.constant(2.5)])
    assert np.std(noisy[0].numpy()) == pytest.approx(0.1, rel=0.03)
    assert np.std(noisy[1].numpy()) == pytest.approx(2.5, rel=0.03)
    assert np.mean(noisy[1].numpy()) == pytest.approx(1.0, abs=4 * 2.5 / math.sqrt(50_000))
