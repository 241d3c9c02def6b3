"""A keras-hub backbone made private with one call (Keras 3 only: keras-hub requires it).

A small Vision Transformer built from its configuration (random weights, nothing
downloaded) under a classification head, as a user fine-tuning a keras-hub backbone would
write it: ``make_private`` wraps it in the clipped family, ``fit`` trains it with the
accountant, and the logged epsilon is the target from below. One real step on a batch and on
the batch minus one row (identical noise) moves the released update by the clip norm at most
-- and by nearly the clip norm, since every row's gradient is clipped: the per-example norms
cover every variable of the backbone (a variable missed by them would push the ratio above
1).
"""

import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub requires Keras 3 (installed with the main stack only)"
)

import keras  # noqa: E402

import lipdp  # noqa: E402
from lipdp.core.callbacks import DP_Accountant  # noqa: E402
from tests.remove_one import TOLERANCE, remove_one_ratios  # noqa: E402

SHAPE, CLASSES, N, B, EPOCHS, DELTA, TARGET = (8, 8, 3), 3, 64, 16, 1, 1e-5, 4.0


def _vit_classifier():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=SHAPE, patch_size=4, num_layers=1, num_heads=2, hidden_dim=8,
        mlp_dim=16, use_class_token=True,
    )  # fmt: skip
    inputs = keras.Input(SHAPE)
    tokens = backbone(inputs)
    class_token = keras.layers.Lambda(lambda t: t[:, 0], name="class_token")(tokens)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(class_token))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, *SHAPE)).astype("float32")
    return x, np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, N)]


def _private(clip_norm=1.0):
    model = lipdp.make_private(
        _vit_classifier(), epsilon=TARGET, delta=DELTA, epochs=EPOCHS, batch_size=B,
        dataset_size=N, method="clipped", clip_norm=clip_norm,
    )  # fmt: skip
    model.compile(optimizer="adam", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    return model


def test_a_keras_hub_backbone_trains_privately_and_logs_the_planned_epsilon():
    model = _private()
    x, y = _data()
    history = model.fit(
        lipdp.private_batches(model, x, y, seed=0), epochs=EPOCHS, verbose=0,
        callbacks=[DP_Accountant()],
    )  # fmt: skip
    assert int(model.noisy_steps.numpy()) == EPOCHS * (N // B)
    epsilon = history.history["epsilon"][-1]
    assert TARGET - 0.05 <= epsilon <= TARGET
    assert np.isfinite(history.history["loss"]).all()


def test_removing_one_row_moves_the_released_step_by_the_clip_norm_at_most():
    clip_norm = 1e-3  # below every row's gradient norm at initialisation: all rows clipped
    model = _private(clip_norm)
    x, y = _data()
    ratios = remove_one_ratios(model, x[:B], y[:B], rows=[0, 5])
    assert ratios.max() <= 1 + TOLERANCE
    assert ratios.min() > 0.99
