"""Weight regularisers and ``add_loss`` (issue 26, rule S13), both families.

A penalty of the weights alone (``kernel_regularizer``, ``bias_regularizer``,
``add_loss(lambda: ...)``) is added to the released gradient after the noise: the
released gradient with it is the one without it plus the penalty's gradient, with
identical noise, and the remove-one ratios do not change. A loss computed from the data
in a call (``add_loss`` of a tensor, an activity regulariser, nested or not) is refused
before any step runs."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as DPL
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.foundation import compat
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.marks import thorough
from tests.remove_one import TOLERANCE, released_gradient, remove_one_ratios

L = tf.keras.layers
BATCH, FEATURES, CLASSES = 6, 5, 3
L2 = 0.3  # the regulariser's weight: its gradient is 2 L2 W


def _metadata():
    return DatasetMetadata(
        input_shape=(FEATURES,),
        nb_classes=CLASSES,
        nb_samples_train=60,
        batch_size=BATCH,
        sampling="poisson",
    )


def _dpsgd(regularised, method="ghost"):
    tf.keras.utils.set_random_seed(7)  # the same weights with and without the penalty
    regulariser = tf.keras.regularizers.L2(L2) if regularised else None
    model = DPSGD_Sequential(
        [
            L.Dense(4, activation="tanh", kernel_regularizer=regulariser, input_shape=(FEATURES,)),
            tf.keras.Sequential([L.Dense(CLASSES, bias_regularizer=regulariser)], name="head"),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", 0.05),
        dataset_metadata=_metadata(),
        gradient_method=method,
    )
    model.compile(loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True), optimizer="sgd")
    return model


def _clipless(regularised):
    tf.keras.utils.set_random_seed(7)
    model = DP_Sequential(
        [
            DPL.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=1.0),
            DPL.DP_QuickSpectralDense(CLASSES),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_metadata(),
    )
    if regularised:
        kernel = model.dp_layers[1].kernel
        if compat.keras_3():  # add_loss takes tensors only there: the variable's regulariser
            kernel.regularizer = tf.keras.regularizers.L2(L2)
        else:
            model.add_loss(lambda: L2 * tf.reduce_sum(tf.square(kernel)))
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(tau=1.0), optimizer="sgd")
    return model


def _batch(rng):
    x = rng.normal(size=(BATCH, FEATURES)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, BATCH)]
    return x, y


def _regularised(model, family):
    if family == "clipless":
        return [model.dp_layers[1].kernel]
    return [model.dp_layers[0].kernel, model.dp_layers[1].layers[0].bias]


def _penalty_gradient(model, regularised):
    """``2 L2 W`` for the regularised variables, 0 elsewhere."""
    refs = {variable_key(v) for v in regularised}
    return [
        2 * L2 * v.numpy() if variable_key(v) in refs else np.zeros(v.shape)
        for v in model.trainable_variables
    ]


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("dpsgd-ghost", marks=thorough),  # 14 s
        pytest.param("dpsgd-jacobian", marks=pytest.mark.slow),
        "clipless",
    ],
)
def test_weight_penalty_is_added_to_the_released_gradient_outside_the_sensitivity(family, rng):
    if family == "clipless":
        plain, penalised = _clipless(False), _clipless(True)
    else:
        method = family.removeprefix("dpsgd-")
        plain, penalised = _dpsgd(False, method), _dpsgd(True, method)
    for a, b in zip(plain.trainable_variables, penalised.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x, y = _batch(rng)
    without = released_gradient(plain, x, y)  # the same noise draws (generator restored)
    with_penalty = released_gradient(penalised, x, y)
    expected = _penalty_gradient(penalised, _regularised(penalised, family))
    assert sum(np.abs(e).sum() for e in expected) > 0.1  # the penalty moves the step
    for w, p, e in zip(without, with_penalty, expected):
        np.testing.assert_allclose(p - w, e, rtol=1e-5, atol=1e-6)
    ratios_without = remove_one_ratios(plain, x, y, rows=[0])
    ratios_with = remove_one_ratios(penalised, x, y, rows=[0])
    np.testing.assert_allclose(ratios_with, ratios_without, rtol=1e-5, atol=1e-7)
    assert ratios_with.max() <= 1 + TOLERANCE


class _ActivationPenalty(L.Layer):
    """``add_loss`` of the activations in its call: a loss computed from the data."""

    def call(self, inputs):
        self.add_loss(tf.reduce_mean(tf.square(inputs)))
        return inputs


@pytest.mark.parametrize("method", ["ghost", "jacobian"])
def test_a_loss_added_from_the_data_is_refused_before_any_step(method, rng):
    model = DPSGD_Sequential(
        [
            L.Dense(4, input_shape=(FEATURES,)),
            tf.keras.Sequential(
                [_ActivationPenalty(name="penalty"), L.Dense(CLASSES)], name="head"
            ),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=_metadata(),
        gradient_method=method,
    )
    model.compile(loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
    x, y = _batch(rng)
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="'head/penalty' adds a loss computed in its call"):
        model.train_on_batch(x, y)
    for v, w in zip(model.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), w)
    assert int(model.noisy_steps) == 0


def test_nested_activity_regularisers_are_refused_at_construction():
    with pytest.raises(ValueError, match="'backbone/dense' \\(Dense\\) has an activity regul"):
        DPSGD_Sequential(
            [
                tf.keras.Sequential(
                    [L.Dense(4, activity_regularizer="l2", input_shape=(FEATURES,))],
                    name="backbone",
                )
            ],
            dp_parameters=DPParameters("global", 1.0, 1e-5),
        )
