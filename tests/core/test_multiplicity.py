"""Augmentation multiplicity: the DP unit is the original example (rule S1, S5)."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.pipeline import load_and_prepare_images_data


def _model(metadata, clip=0.5):
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=metadata.input_shape, upper_bound=metadata.max_norm),
         L.DP_QuickSpectralConv2D(4, 3), L.DP_GroupSort(2), L.DP_Flatten(),
         L.DP_QuickSpectralDense(10), L.DP_ClipGradient(clip)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=metadata,
    )  # fmt: skip
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(8.0), optimizer="adam")
    return model


def test_multiplicity_trains_and_bounds_each_original():
    m, b = 3, 64
    ds_train, _, metadata = load_and_prepare_images_data(
        "digits", batch_size=b, multiplicity=m, bound_fct=3.0, seed=0
    )
    model = _model(metadata)
    assert model.loss_normalizer == b * m  # the clip layers receive it from the model
    history = model.fit(ds_train, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()

    # Per-original contribution to the averaged gradient <= per-example bound / b.
    x, y = next(iter(ds_train))
    with tf.GradientTape() as tape:
        rows = model.loss.call(y, model(x, training=True)) / (b * m)  # mean over b*m rows
    kernel = model.trainable_variables[0]
    jac = tape.jacobian(rows, kernel)
    per_original = tf.reduce_sum(tf.reshape(jac, (b, m, -1)), axis=1)
    bound = next(bound for v, bound, _ in model.per_example_sensitivities() if v is kernel)
    assert float(tf.reduce_max(tf.norm(per_original, axis=1))) * b <= bound * (1 + 1e-5)


def test_multiplicity_refuses_arrays_and_wrong_batches():
    ds_train, _, metadata = load_and_prepare_images_data("digits", batch_size=64, multiplicity=2)
    model = _model(metadata)
    with pytest.raises(ValueError, match="multiplicity"):
        model.fit(np.zeros((128, 8, 8, 1), "float32"), np.zeros((128, 10), "float32"),
                  batch_size=64, verbose=0)  # fmt: skip
    with pytest.raises(ValueError, match="expects 128"):
        model.fit(ds_train.unbatch().batch(64, drop_remainder=True), verbose=0)
