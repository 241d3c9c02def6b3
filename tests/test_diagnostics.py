"""lipdp.evaluation.diagnostics measures in the units training uses (issue 10, drift 1).

The model divides the summed loss by its loss normaliser (``b * m`` rows with
augmentation multiplicity ``m``) and its clip layers clip every row's cotangent at ``C``
in those units. The diagnostics used ``b``: with ``m = 3`` they saw cotangents clipped at
``C / 3`` and lost a factor 3 of power to catch a violation. Here the cotangent each
diagnostic gradient carries is read off the last dense layer (``dL/dW = h c^T``, so
``||dL/dW|| / ||h|| = ||c||``) and compared with ``min(||dloss/dlogits||, C)`` computed by
autodiff, row by row.
"""

import numpy as np
import pytest
import tensorflow as tf

from lipdp import layers as L
from lipdp import losses
from lipdp.evaluation.diagnostics import gradient_statistics, per_example_gradients
from lipdp.metadata import DatasetMetadata
from lipdp.model import DP_Sequential, DPParameters

D, CLASSES, CLIP = 10, 4, 0.1


def clipped_model(batch, multiplicity=0, clip=None):
    metadata = DatasetMetadata(
        input_shape=(D,),
        nb_classes=CLASSES,
        nb_samples_train=100 * batch,
        batch_size=batch,
        multiplicity=multiplicity,
    )
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(D,), upper_bound=3.0),
            L.DP_QuickSpectralDense(16),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(CLASSES),
            clip or L.DP_ClipGradient(CLIP),
        ],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=metadata,
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(16.0), optimizer="sgd")
    return model


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, size=n)]
    return x, y


def cotangents_seen_by_diagnostics(model, x, y):
    """``||c_i||`` of every row, from the per-row gradient of the last dense kernel."""
    kernel = model.dp_layers[3].kernel
    grads = per_example_gradients(model, x, y)
    index = [v.ref() for v in model.trainable_variables].index(kernel.ref())
    hidden = model.dp_layers[2](model.dp_layers[1](model.dp_layers[0](x)))
    grad_norms = np.linalg.norm(grads[index].numpy().reshape(len(x), -1), axis=1)
    return grad_norms / np.linalg.norm(hidden.numpy(), axis=1)


def clipped_loss_gradients(model, x, y):
    """``min(||d loss_i / d logits||, C)`` by autodiff, without the model's clip layer."""
    logits = tf.constant(model(x).numpy())
    with tf.GradientTape() as tape:
        tape.watch(logits)
        total = tf.reduce_sum(model.loss.call(y, logits))
    norms = np.linalg.norm(tape.gradient(total, logits).numpy(), axis=1)
    return np.minimum(norms, CLIP), norms


@pytest.mark.parametrize("multiplicity", [0, 3])
def test_diagnostics_see_cotangents_clipped_at_c(multiplicity):
    b = 4
    model = clipped_model(b, multiplicity)
    x, y = rows(b * max(1, multiplicity))
    seen = cotangents_seen_by_diagnostics(model, x, y)
    expected, unclipped = clipped_loss_gradients(model, x, y)
    assert np.mean(unclipped > CLIP) >= 0.5  # the clipping is active on half the rows
    np.testing.assert_allclose(seen, expected, rtol=1e-4, atol=1e-7)
    assert seen.max() == pytest.approx(CLIP, rel=1e-4)  # not C / m
    # The gradient-to-bound ratios are then measured against the per-example bound.
    stats = {s.name: s for s in gradient_statistics(model, x, y)}
    assert max(s.max_ratio for s in stats.values()) <= 1 + 1e-5


def test_a_clip_layer_shared_by_two_models_keeps_each_models_normaliser():
    """The normaliser is passed by the model at call time: building a second model with
    another batch size around the same clip layer does not change the first (it used to
    set ``layer.batch_normalizer``)."""
    clip = L.DP_ClipGradient(CLIP)
    first = clipped_model(4, clip=clip)
    second = clipped_model(8, clip=clip)
    x, y = rows(4)
    expected, _ = clipped_loss_gradients(first, x, y)
    np.testing.assert_allclose(
        cotangents_seen_by_diagnostics(first, x, y), expected, rtol=1e-4, atol=1e-7
    )
    x8, y8 = rows(8, seed=1)
    expected8, _ = clipped_loss_gradients(second, x8, y8)
    np.testing.assert_allclose(
        cotangents_seen_by_diagnostics(second, x8, y8), expected8, rtol=1e-4, atol=1e-7
    )
    assert first.loss_normalizer == 4 and second.loss_normalizer == 8
    assert not hasattr(clip, "batch_normalizer")
