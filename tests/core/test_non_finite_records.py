"""Rule S9: a record with a NaN or an infinity cannot make its contribution unbounded.

In-graph, ``DP_BoundedInput`` zeroes such inputs and every DP loss gives such labels a
zero loss (and a zero gradient); the training step counts them in
``logs["non_finite_examples"]``; ``fit`` on arrays refuses them, naming the rows.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key

D, K, B = 6, 3, 4


def model_for(sampling="shuffle", non_private=True, lr=1.0):
    metadata = DatasetMetadata(
        input_shape=(D,), nb_classes=K, nb_samples_train=64, batch_size=B, sampling=sampling
    )
    sigma = 0.0 if non_private else 1.0
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(D,), upper_bound=2.0),
            L.DP_QuickSpectralDense(8),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(K),
        ],
        dp_parameters=DPParameters("global", sigma, 1e-5, non_private=non_private),
        dataset_metadata=metadata,
    )
    model.compile(
        loss=losses.DP_TauCategoricalCrossentropy(8.0), optimizer=tf.keras.optimizers.SGD(lr)
    )
    return model


def batch(n=B, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32") * 3.0
    y = np.eye(K, dtype="float32")[rng.integers(0, K, size=n)]
    return x, y


def test_bounded_input_zeroes_non_finite_examples_only():
    layer = L.DP_BoundedInput(input_shape=(D,), upper_bound=2.0)
    x, _ = batch(5)
    x[1, 2], x[3, 0], x[4, 5] = np.nan, np.inf, -np.inf
    out = layer(x).numpy()
    np.testing.assert_array_equal(out[[1, 3, 4]], 0.0)
    expected = x[[0, 2]] * np.minimum(1.0, 2.0 / np.linalg.norm(x[[0, 2]], axis=1))[:, None]
    np.testing.assert_allclose(out[[0, 2]], expected, rtol=1e-6)
    unclipped = L.DP_BoundedInput(input_shape=(D,), upper_bound=2.0, enforce_clipping=False)
    np.testing.assert_array_equal(unclipped(x).numpy()[1], 0.0)


@pytest.mark.parametrize(
    "loss",
    [
        losses.DP_TauCategoricalCrossentropy(4.0),
        losses.DP_TauBCE(2.0),
        losses.DP_MulticlassHinge(),
        losses.DP_MulticlassKR(),
        losses.DP_MulticlassHKR(),
        losses.DP_KCosineSimilarity(),
        losses.DP_MeanAbsoluteError(),
    ],
    ids=lambda loss: type(loss).__name__,
)
def test_losses_give_non_finite_labels_zero_loss_and_gradient(loss):
    rng = np.random.default_rng(1)
    logits = tf.constant(rng.normal(size=(4, K)).astype("float32"))
    y = np.eye(K, dtype="float32")[[0, 1, 2, 0]]
    y[1, 0], y[3, 2] = np.nan, np.inf
    with tf.GradientTape() as tape:
        tape.watch(logits)
        values = loss.call(y, logits)
    gradient = tape.gradient(values, logits).numpy()  # of the sum of the losses
    assert np.all(np.isfinite(values.numpy())) and np.all(np.isfinite(gradient))
    np.testing.assert_array_equal(values.numpy()[[1, 3]], 0.0)
    np.testing.assert_array_equal(gradient[[1, 3]], 0.0)
    clean = loss.per_example_loss(tf.constant(y[[0, 2]]), tf.gather(logits, [0, 2]))
    np.testing.assert_allclose(values.numpy()[[0, 2]], clean.numpy(), rtol=1e-6)
    assert np.linalg.norm(gradient, axis=1).max() <= loss.get_L() * (1 + 1e-5)


def _noiseless_update(model, x, y):
    before = [v.numpy() for v in model.trainable_variables]
    model.train_on_batch(x, y)
    update = [v.numpy() - b for v, b in zip(model.trainable_variables, before)]
    for v, b in zip(model.trainable_variables, before):
        v.assign(b)
    return update


@pytest.mark.parametrize("where", ["input", "label", "both"])
def test_one_nan_example_moves_the_update_by_at_most_its_bound(where):
    """Add/remove: the noiseless SGD update (lr 1, no projection effect checked) with the
    NaN example vs without it differs by at most B_v / b per variable, the sensitivity
    the noise is calibrated for (Poisson batches: the loss is divided by b either way)."""
    model = model_for(sampling="poisson")
    model.project = lambda: None  # compare raw gradient steps
    x, y = batch()
    x_bad, y_bad = x.copy(), y.copy()
    if where in ("input", "both"):
        x_bad[2, 1] = np.nan
    if where in ("label", "both"):
        y_bad[2, 0] = np.inf
    with_bad = _noiseless_update(model, x_bad, y_bad)
    without = _noiseless_update(model, np.delete(x, 2, 0), np.delete(y, 2, 0))
    bounds = {variable_key(e.variable): float(e.bound) for e in model.bounds().variables}
    for v, a, b in zip(model.trainable_variables, with_bad, without):
        assert np.all(np.isfinite(a))
        assert np.linalg.norm(a - b) <= bounds[variable_key(v)] / B * (1 + 1e-5)
    if where != "input":  # the label makes the example count zero: exactly no change
        for a, b in zip(with_bad, without):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_fit_on_arrays_refuses_non_finite_rows():
    model = model_for(non_private=False)
    x, y = batch(64)
    x[5, 0], x[40, 3] = np.nan, np.inf
    with pytest.raises(
        ValueError, match=r"x has 2 example\(s\) with NaN or infinite values \(rows 5, 40\)"
    ):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    x, y = batch(64)
    y[7, 1] = np.nan
    with pytest.raises(ValueError, match=r"y has 1 example\(s\).*rows 7\)"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)


def test_pipelines_train_finite_weights_and_count_the_bad_rows():
    model = model_for(non_private=False, lr=0.1)
    x, y = batch(64)
    x[3, 0], y[10, 2], x[20] = np.nan, np.nan, np.inf
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
    history = model.fit(data, epochs=2, verbose=0)
    assert history.history["non_finite_examples"] == [3.0, 3.0]  # per epoch
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
    assert math.isfinite(history.history["loss"][-1])
    # Only the training logs carry the count: evaluate() returns what it always did.
    assert isinstance(model.evaluate(data, verbose=0), float)


def test_input_clipping_has_no_overflow_and_is_tf_clip_by_norm_elsewhere(rng):
    """DP_BoundedInput's row clipping equals tf.clip_by_norm on ordinary rows, and keeps
    every finite row -- entries up to the float32 limit, subnormals, zeros -- finite and
    within the bound (tf.clip_by_norm gives NaN for an entry of 3e38 and B = 2)."""
    from lipdp.clipless.layers.inputs import clip_rows

    x = (
        rng.normal(size=(6, 5, 3)).astype("float32")
        * np.array([0.1, 1, 3, 10, 0, 2])[:, None, None]
    )
    np.testing.assert_allclose(
        clip_rows(tf.constant(x), 2.0), tf.clip_by_norm(x, 2.0, axes=[1, 2]), rtol=1e-6, atol=1e-7
    )
    extreme = np.zeros((4, 3), "float32")
    extreme[0] = [3e38, -3e38, 1.0]
    extreme[1] = [1e-45, 0.0, -1e-45]
    extreme[2] = [3.4e38, 3.4e38, 3.4e38]
    out = clip_rows(tf.constant(extreme), 2.0).numpy()
    assert np.isfinite(out).all()
    norms = np.linalg.norm(out.astype("float64"), axis=1)
    assert np.all(norms <= 2.0 * (1 + 1e-6))
    np.testing.assert_allclose(norms[[0, 2]], 2.0, rtol=1e-6)
    assert np.isnan(tf.clip_by_norm(extreme[:1], 2.0, axes=[1]).numpy()).any()
