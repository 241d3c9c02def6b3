"""The refusals of the private-model surface, one expected message per bad input, for
every backend (:class:`lipdp.core.private_base.PrivateModelBase` holds them once).

``tests/core/test_private_surface.py`` (TensorFlow, Keras 2 and 3, the clipped model) and
``tests/clipped/jax/test_private_surface.py`` (the JAX model) give their model the same bad input
and compare what it says with the literal messages below: a refusal that drifts on one
backend fails there. The models: features ``FEATURES``, ``CLASSES`` outputs, a first
``Dense`` named ``"wide"``; ``N = 32`` examples, batches of 8.
"""

import numpy as np
import pytest

FEATURES, CLASSES, N, BATCH = 6, 3, 32, 8

MESSAGES = {
    # compile
    "float64 layer": (
        "Mixed precision is not supported (layer 'wide' (float64)): float16 round-off exceeds "
        "the slack of the sensitivity bounds (an input clipped to norm 1 can come out above "
        "1). Use keras.mixed_precision.set_global_policy('float32')."
    ),
    "nested float64 layer": (
        "Mixed precision is not supported (layer 'block/wide' (float64)): float16 round-off "
        "exceeds the slack of the sensitivity bounds (an input clipped to norm 1 can come out "
        "above 1). Use keras.mixed_precision.set_global_policy('float32')."
    ),
    "sum reduction": (
        "Loss reduction 'sum' is not supported: sensitivities are computed for the mean over "
        "the batch. Use reduction=SUM_OVER_BATCH_SIZE (the default)."
    ),
    "loss weights": "loss_weights is not supported: it rescales the sensitivity.",
    # save
    "h5 file": (
        "DP models are saved to .keras files (got 'model.h5'): the SavedModel and HDF5 "
        "formats do not carry the privacy state (step count, DP configuration), so a reload "
        "would under-count epsilon."
    ),
    # fit, on arrays
    "NaN row": (
        "x has 1 example(s) with NaN or infinite values (rows 3): such a record has no "
        "bounded contribution. Remove or repair these rows before fit."
    ),
    "other N": (
        "fit receives 24 training examples but dataset_metadata declares nb_samples_train=32: "
        "the sampling rate b/N of the privacy accounting comes from it. Declare the number of "
        "examples trained on."
    ),
    "partial last batch": (
        "dataset_metadata.partial_last_batch: the last batch of each epoch is partial and "
        "would be refused mid-training. Prepare the data with drop_remainder=True."
    ),
    "class weight": "class_weight is not supported: it changes the sensitivity.",
}


def data(rows=N, seed=0):
    """``(x, y)``: normal features, one-hot labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, rows)]
    return x, y


def refusals(make, keras):
    """``{case: function raising the refusal}`` for a backend's model.

    ``make(dtype=..., nested=..., partial_last_batch=...)`` builds an uncompiled private
    model of the module docstring (the first ``Dense`` of ``dtype``, inside a
    ``Sequential`` named ``"block"`` if ``nested``; fixed-size batches of 8)."""
    loss = keras.losses.CategoricalCrossentropy(from_logits=True)

    def compiled(**kwargs):
        model = make(**kwargs)
        model.compile(optimizer="sgd", loss=loss)
        return model

    x, y = data()
    x_nan = x.copy()
    x_nan[3, 1] = np.nan
    sum_loss = keras.losses.CategoricalCrossentropy(from_logits=True, reduction="sum")
    return {
        "float64 layer": lambda: make(dtype="float64").compile(optimizer="sgd", loss=loss),
        "nested float64 layer": lambda: make(dtype="float64", nested=True).compile(
            optimizer="sgd", loss=loss
        ),
        "sum reduction": lambda: make().compile(optimizer="sgd", loss=sum_loss),
        "loss weights": lambda: make().compile(optimizer="sgd", loss=loss, loss_weights=[2.0]),
        "h5 file": lambda: compiled().save("model.h5"),
        "NaN row": lambda: compiled().fit(x_nan, y, epochs=1, verbose=0),
        "other N": lambda: compiled().fit(x[:24], y[:24], epochs=1, verbose=0),
        "partial last batch": lambda: compiled(partial_last_batch=True).fit(x, y, verbose=0),
        "class weight": lambda: compiled().fit(x, y, class_weight={0: 2.0}, verbose=0),
    }


def check_refusal(case, refuse) -> None:
    """``refuse()`` raises ``ValueError`` with exactly ``MESSAGES[case]``."""
    with pytest.raises(ValueError) as raised:
        refuse()
    assert str(raised.value) == MESSAGES[case], str(raised.value)
