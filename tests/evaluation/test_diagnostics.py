"""lipdp.evaluation.diagnostics: per-example gradients, signal-to-noise, the audit.

The diagnostics measure in the units training uses (issue 10, drift 1).

The model divides the summed loss by its loss normaliser (``b * m`` rows with
augmentation multiplicity ``m``) and its clip layers clip every row's cotangent at ``C``
in those units. The diagnostics used ``b``: with ``m = 3`` they saw cotangents clipped at
``C / 3`` and lost a factor 3 of power to catch a violation. Here the cotangent each
diagnostic gradient carries is read off the last dense layer (``dL/dW = h c^T``, so
``||dL/dW|| / ||h|| = ||c||``) and compared with ``min(||dloss/dlogits||, C)`` computed by
autodiff, row by row.
"""

import logging
import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.audit import SensitivityViolation
from lipdp.clipless.model import DP_Sequential, DPParameters, compute_gradient_bounds
from lipdp.evaluation import diagnostics
from lipdp.evaluation.diagnostics import gradient_statistics, per_example_variable_gradients
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.evaluation_helpers import digits_cnn, vector_model

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
    grads = per_example_variable_gradients(model, x, y)
    index = [variable_key(v) for v in model.trainable_variables].index(variable_key(kernel))
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


# ------------------------------------------------------ callbacks and the audit
# ---------------------------------------------------------------------------- diagnostics
def test_per_example_gradients_match_one_example_at_a_time(digits):
    tf.keras.utils.set_random_seed(0)
    model, x, y = digits_cnn(digits)
    model.build((None, 8, 8, 1))
    grads = diagnostics.per_example_variable_gradients(model, x[:4], y[:4])
    for i in range(4):
        with tf.GradientTape() as tape:
            loss = model.loss.call(tf.constant(y[i : i + 1]), model(x[i : i + 1], training=True))
        for g, ref in zip(grads, tape.gradient(loss, model.trainable_variables)):
            np.testing.assert_allclose(g[i].numpy(), ref.numpy(), rtol=1e-4, atol=1e-6)


def test_signal_to_noise_callbacks(digits, tmp_path):
    tf.keras.utils.set_random_seed(0)
    model, x, y = digits_cnn(digits, sigma=2.0)
    logged = []
    average = diagnostics.SignaltoNoiseAverage((x[:32], y[:32]), log_fn=logged.append)
    histogram = diagnostics.SignaltoNoiseHistogram((x[:32], y[:32]))
    history = model.fit(x, y, batch_size=512, epochs=2, verbose=0, callbacks=[average, histogram])
    for key in ("gradient_to_bound_mean", "gradient_to_bound_max", "signal_to_noise"):
        assert len(history.history[key]) == 2
    assert 0 < max(history.history["gradient_to_bound_max"]) <= 1 + 1e-5
    stats = average.history[-1]
    deltas = compute_gradient_bounds(model)
    total = math.sqrt(sum(float(d) ** 2 for d in deltas.values()))
    for s in stats:
        assert s.name in deltas
        assert s.noise_std == pytest.approx(2.0 * total)
        assert s.expected_noise_norm == pytest.approx(2.0 * total * math.sqrt(s.dim))
        assert s.signal_to_noise == pytest.approx(s.mean_gradient_norm / s.expected_noise_norm)
        assert len(s.ratios) == 32 and 0 < s.max_ratio <= 1 + 1e-5
    assert f"{stats[0].name}/signal_to_noise" in logged[-1]
    for name, figure in [("avg", average.plot()), ("hist", histogram.plot())]:
        figure.savefig(tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_per_layer_noise_in_signal_to_noise():
    model = vector_model([L.DP_QuickSpectralDense(5, nm_coef=2.0)])
    model.dp_parameters = DPParameters("per-layer", 1.5, 1e-5)
    x = np.ones((8, 6), "float32")
    y = np.eye(5, dtype="float32")[np.arange(8) % 5]
    (stat,) = diagnostics.gradient_statistics(model, x, y)
    (delta,) = compute_gradient_bounds(model).values()
    assert stat.noise_std == pytest.approx(1.5 * 2.0 * float(delta))


def test_sensitivity_audit_passes_on_shipped_layers(digits):
    tf.keras.utils.set_random_seed(0)
    model, x, y = digits_cnn(digits)
    audit = diagnostics.SensitivityAudit((x[:32], y[:32]), raise_on_violation=True)
    history = model.fit(x, y, batch_size=512, epochs=2, verbose=0, callbacks=[audit])
    assert history.history["audit_violations"] == [0, 0]
    report = audit.reports[-1]
    assert report.ok and 0 < report.max_gradient_ratio <= 1
    assert len(report.operator_norms) == 2 and report.max_operator_norm_ratio <= 1 + 1e-5


class HalfBoundDense(L.DP_QuickSpectralDense):
    """Deliberately broken: declares half of the true parameter bound."""

    def backpropagate_params(self, input_bound, gradient_bound):
        return 0.5 * super().backpropagate_params(input_bound, gradient_bound)


def _tight_batch(model, n=8, dim=6, upper_bound=3.0):
    """Inputs beyond the bound (clipped to norm exactly B) labelled with their least
    likely class: ||dL/dW|| = B ||softmax - y|| >= B sqrt(4/5), i.e. > 0.63 x the true
    bound B sqrt(2), > 1.26 x the broken one."""
    x = np.random.default_rng(0).normal(size=(n, dim)).astype("float32")
    x *= 2 * upper_bound / np.linalg.norm(x, axis=1, keepdims=True)
    y = np.eye(5, dtype="float32")[np.argmin(model(x).numpy(), axis=1)]
    return x, y


def test_sensitivity_audit_catches_a_broken_bound(caplog):
    model = vector_model([HalfBoundDense(5)])
    x, y = _tight_batch(model)
    audit = diagnostics.SensitivityAudit((x, y))
    with caplog.at_level(logging.WARNING, logger="lipdp.evaluation.diagnostics"):
        history = model.fit(
            np.tile(x, (4, 1)), np.tile(y, (4, 1)), batch_size=8, verbose=0, callbacks=[audit]
        )
    assert history.history["audit_violations"] == [1]
    report = audit.reports[0]
    (name,) = [n for n, r in report.gradient_ratios.items() if r > 1]
    assert name.startswith("half_bound_dense")
    assert report.max_gradient_ratio > 1.2
    assert "violation" in caplog.text
    strict = diagnostics.SensitivityAudit((x, y), raise_on_violation=True)
    with pytest.raises(SensitivityViolation, match="half_bound_dense"):
        model.fit(
            np.tile(x, (4, 1)), np.tile(y, (4, 1)), batch_size=8, verbose=0, callbacks=[strict]
        )
    # the correct layer on the same tight batch: no violation
    sound = vector_model([L.DP_QuickSpectralDense(5)])
    x, y = _tight_batch(sound)
    audit = diagnostics.SensitivityAudit((x, y), raise_on_violation=True)
    audit.set_model(sound)
    report = audit.run()
    assert report.ok and 0.6 < report.max_gradient_ratio <= 1 + 1e-5


def test_sensitivity_audit_catches_a_kernel_outside_its_constraint(digits):
    tf.keras.utils.set_random_seed(0)
    model, x, y = digits_cnn(digits)
    model.build((None, 8, 8, 1))
    dense = model.dp_layers[-1]
    dense.kernel.assign(2.0 * dense.kernel)  # bypasses the projection
    audit = diagnostics.SensitivityAudit((x[:16], y[:16]))
    audit.set_model(model)
    logs = {}
    audit.on_epoch_end(0, logs)
    assert logs["audit_violations"] >= 1
    assert logs["audit_operator_norm_ratio"] == pytest.approx(2.0, rel=1e-4)
    strict = diagnostics.SensitivityAudit((x[:16], y[:16]), raise_on_violation=True)
    strict.set_model(model)
    with pytest.raises(SensitivityViolation) as error:
        strict.on_epoch_end(0, {})
    assert [r.name for r in error.value.records] == [dense.name]
