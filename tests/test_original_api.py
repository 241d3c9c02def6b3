"""The original package's call forms (``deel.lipdp``), with only the import lines changed.

A condensed run of the original MNIST tutorial, on the bundled digits: data pipeline,
``default_delta_value``, ``DP_Sequential`` built from the metadata, ``get_max_epochs``
(bounded and with ``epochs_max=None``), ``fit`` with ``DP_Accountant()``,
``get_eps_delta`` from ``lipdp.model``. The epsilon the accountant logs is the one
``get_eps_delta`` gives for the same epochs.
"""

import pytest
import tensorflow as tf

from lipdp import layers, losses
from lipdp.model import DP_Accountant, DP_Sequential, DPParameters, get_eps_delta
from lipdp.pipeline import bound_normalize, default_delta_value, load_and_prepare_images_data
from lipdp.sensitivity import get_max_epochs


def test_original_tutorial_call_forms():
    ds_train, ds_test, dataset_metadata = load_and_prepare_images_data(
        "digits",
        batch_size=256,
        colorspace="RGB",
        drop_remainder=True,
        bound_fct=bound_normalize(),
    )
    delta = default_delta_value(dataset_metadata)
    assert delta == 1e-4  # 1437 training images: the smallest power of ten above is 1e4
    dp_parameters = DPParameters(noisify_strategy="global", noise_multiplier=4.0, delta=delta)
    model = DP_Sequential(
        [
            layers.DP_BoundedInput(
                input_shape=dataset_metadata.input_shape, upper_bound=dataset_metadata.max_norm
            ),
            layers.DP_SpectralConv2D(filters=8, kernel_size=3, use_bias=False),
            layers.DP_GroupSort(2),
            layers.DP_ScaledL2NormPooling2D(pool_size=2, strides=2),
            layers.DP_Flatten(),
            layers.DP_SpectralDense(10, use_bias=False),
            layers.DP_ClipGradient(clip_value=1.0),
        ],
        dp_parameters=dp_parameters,
        dataset_metadata=dataset_metadata,
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(18.0),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        metrics=["accuracy"],
    )
    epsilon_max = 10.0
    num_epochs = get_max_epochs(epsilon_max, model)
    assert num_epochs == get_max_epochs(epsilon_max, model, epochs_max=None)
    assert (
        get_eps_delta(model, num_epochs)[0] <= epsilon_max < get_eps_delta(model, num_epochs + 1)[0]
    )
    history = model.fit(
        ds_train, epochs=2, validation_data=ds_test, callbacks=[DP_Accountant()], verbose=0
    )
    assert history.history["epsilon"][-1] == pytest.approx(get_eps_delta(model, 2)[0], rel=1e-12)
    assert history.history["delta"][-1] == delta
