"""lipdp.clipless.tightness: measured norms against the declared bounds, checked by hand."""

import json
import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.clipless.tightness import TightnessReport, TightnessRow, tightness_report
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.recipes import zoo
from tests.cases import NB_CLASSES, VEC, ZOO_CASES, build

#: The architectures whose bounds must hold on random and on adversarial inputs.
MODELS = {
    "dense": lambda: build(
        [L.DP_QuickSpectralDense(8), L.DP_GroupSort(2), L.DP_QuickSpectralDense(NB_CLASSES)], VEC
    ),
    "pooled_cnn": ZOO_CASES["Zoo:pooled_cnn"],
    "tabular_mlp": ZOO_CASES["Zoo:tabular_mlp"],
    "resnet": ZOO_CASES["Zoo:resnet(1-lip-add)"],
}


def _upper_bound(model) -> float:
    return float(model.dp_layers[0].upper_bound)


def _random_inputs(model, rows, seed=0, shape=None):
    """Gaussian rows of norm about twice the input bound: most are clipped."""
    shape = shape or model.dataset_metadata.input_shape
    rng = np.random.default_rng(seed)
    scale = 2.0 * _upper_bound(model) / math.sqrt(np.prod(shape))
    return (scale * rng.normal(size=(rows, *shape))).astype("float32")


def _worst_case(model, x):
    """Rows of norm exactly the bound, each labelled with its smallest logit."""
    flat = x.reshape(len(x), -1)
    x = (_upper_bound(model) * flat / np.linalg.norm(flat, axis=1, keepdims=True)).reshape(x.shape)
    logits = model(x, training=False).numpy()
    return x.astype("float32"), np.eye(NB_CLASSES, dtype="float32")[logits.argmin(axis=1)]


# ------------------------------------------------------------- an independent computation
def _row_loop(model, x, y):
    """Per-example norms by ``tape.gradient`` of one row's loss, in a Python loop over the
    rows and over the layers (no code of the module under test): ``{"gradient": {key:
    norms}, "input": [per layer: [per path: norms]], "cotangent": [...]}``."""
    n = float(model.loss_normalizer or 1)
    entries = model.bounds().variables
    gradients = {e.key: [] for e in entries}
    count = len(model.dp_layers)
    inputs, cotangents = [[] for _ in range(count)], [[] for _ in range(count)]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            h, outputs = tf.constant(x[i : i + 1]), []
            for k, layer in enumerate(model.dp_layers):
                inputs[k].append([float(tf.norm(t)) for t in tf.nest.flatten(h)])
                kwargs = {"loss_normalizer": n} if layer.uses_loss_normalizer else {}
                h = tf.nest.map_structure(tf.identity, layer(h, training=True, **kwargs))
                tape.watch(tf.nest.flatten(h))
                outputs.append(h)
            loss = model.loss.call(tf.constant(y[i : i + 1]), h)[0] / n
        grads, cots = tape.gradient(loss, ([e.variable for e in entries], outputs))
        for e, g in zip(entries, grads):
            gradients[e.key].append(n * float(tf.norm(g)))
        for k, c in enumerate(cots):
            cotangents[k].append([n * float(tf.norm(t)) for t in tf.nest.flatten(c)])
    return {
        "gradient": {k: np.array(v) for k, v in gradients.items()},
        "input": [[np.array(p) for p in zip(*rows)] for rows in inputs],
        "cotangent": [[np.array(p) for p in zip(*rows)] for rows in cotangents],
    }


def _expected_rows(model, reference):
    """``{(quantity, name): per-example norms}`` named as the report names its rows."""
    bounds = model.bounds()
    out = {("gradient", key): norms for key, norms in reference["gradient"].items()}
    for quantity, declared in (
        ("input", bounds.input_bounds),
        ("cotangent", bounds.output_cotangent_bounds),
    ):
        for layer, bound, paths in zip(model.dp_layers, declared, reference[quantity]):
            if bound is None:
                continue
            if isinstance(bound, tuple):
                out[(quantity, f"{layer.name} [skip]")] = paths[0]
                out[(quantity, f"{layer.name} [branch]")] = paths[1]
            else:
                out[(quantity, layer.name)] = paths[0]
    return out


def _clipped(body, with_metadata):
    """A network ending with a bias and a gradient clip active on most rows (so that the
    loss normaliser matters), with or without metadata."""
    shape = (4, 4, 1)
    stack = [
        L.DP_BoundedInput(input_shape=shape, upper_bound=3.0),
        *body(shape),
        L.DP_AddBias(0.5),
        L.DP_ClipGradient(0.2),
    ]
    if with_metadata:
        model, _, _ = build(stack[1:], shape)
        return model
    model = DP_Sequential(stack, dp_parameters=DPParameters("global", 1.0, 1e-5))
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(tau=16.0), optimizer="sgd")
    return model


def _resnet(shape):
    """The zoo's residual network without its bounded input (pairs of bounds)."""
    return zoo.resnet(input_shape=shape, upper_bound=3.0, nb_classes=NB_CLASSES, blocks=1, width=2)[
        1:
    ]


def _dense(shape):
    return [L.DP_Flatten(), L.DP_QuickSpectralDense(NB_CLASSES)]


@pytest.mark.parametrize(
    "body, with_metadata", [(_resnet, True), (_dense, False)], ids=["resnet", "no-metadata"]
)
def test_per_example_norms_match_a_loop_over_rows(body, with_metadata):
    """Every row of the report (max, mean, median, argmax, bound) against per-row
    ``tape.gradient`` through the layers one by one, in chunks of 3 rows (the last one
    short); without metadata (each row alone: the clip layer divides by 1 row), one chunk
    gives the same numbers."""
    model = _clipped(body, with_metadata)
    x = _random_inputs(model, 7, shape=(4, 4, 1))
    y = np.eye(NB_CLASSES, dtype="float32")[np.arange(7) % NB_CLASSES]
    report = tightness_report(model, x, y, batch_size=3)
    assert report.loss_normalizer == (model.loss_normalizer or 1)
    expected = _expected_rows(model, _row_loop(model, x, y))
    assert {(r.quantity, r.name) for r in report.rows} == set(expected)
    declared = {e.key: float(e.bound) for e in model.bounds().variables}
    for row in report.rows:
        norms = expected[(row.quantity, row.name)]
        assert row.max_norm == pytest.approx(norms.max(), rel=1e-5, abs=1e-7), row
        assert row.mean_norm == pytest.approx(norms.mean(), rel=1e-5, abs=1e-7), row
        assert row.median_norm == pytest.approx(np.median(norms), rel=1e-5, abs=1e-7), row
        assert norms[row.argmax] == pytest.approx(norms.max(), rel=1e-5), row
        if row.quantity == "gradient":
            assert row.bound == pytest.approx(declared[row.name])
    # The clip is active: the logits' cotangent is clipped at 0.2 upstream of the clip layer.
    assert report.row(model.dp_layers[-1].name, "cotangent").max_norm > 0.2
    assert report.row(model.dp_layers[-2].name, "cotangent").max_norm <= 0.2 * (1 + 1e-6)
    if with_metadata:
        assert any(r.name.endswith(" [branch]") for r in report.select("input"))
        return
    one_chunk = tightness_report(model, x, y)
    for a, b in zip(report.rows, one_chunk.rows):
        assert a.max_norm == pytest.approx(b.max_norm, rel=1e-6)
        assert a.mean_norm == pytest.approx(b.mean_norm, rel=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_bounds_hold_on_random_and_worst_case_inputs(name):
    model, _, _ = MODELS[name]()
    x = _random_inputs(model, 16)
    y = np.eye(NB_CLASSES, dtype="float32")[np.arange(16) % NB_CLASSES]
    x_worst, y_worst = _worst_case(model, _random_inputs(model, 16, seed=1))
    # One report on both batches (one trace): rows 16 and on are the worst cases.
    report = tightness_report(model, np.concatenate([x, x_worst]), np.concatenate([y, y_worst]))
    assert report.examples == 32
    assert report.violations() == (), report.format()
    assert all(r.max_ratio <= 1 + ROUNDOFF_SLACK for r in report.rows)
    gradients = report.select("gradient")
    assert [r.name for r in gradients] == [e.key for e in model.bounds().variables]
    assert all(r.max_norm > 0 for r in gradients)
    # Inputs of norm exactly the bound reach the bound of the first layer after clipping.
    first = report.select("input")[0]
    assert first.max_ratio == pytest.approx(1.0, rel=1e-5)


def test_one_dense_layer_reaches_its_bound_where_the_bound_is_exact():
    """Flatten -> dense, one example of norm exactly B = 3 along the first column ``w`` of
    the orthogonal kernel ``W`` (orthonormal columns), labelled with its smallest logit.

    Logits ``z = W^T x = B e_0``; the loss gradient w.r.t. the logits is ``p - y`` with
    ``p = softmax(tau z)`` (:class:`DP_TauCategoricalCrossentropy`); the kernel's gradient
    is ``x (p - y)^T``, of Frobenius norm ``||x|| ||p - y||``. With ``tau = 100``, ``p`` is
    ``e_0`` to within ``e^-300`` and ``y = e_j``, ``j != 0``: ``||p - y|| = sqrt(2)``, the
    loss constant ``L``. The declared bound is ``X * G = B * L``: ratio 1, as are the input
    ratio of the dense layer and the cotangent ratio at the logits."""
    b, tau = 3.0, 100.0
    model, _, _ = build(
        [L.DP_Flatten(), L.DP_QuickSpectralDense(NB_CLASSES, name="dense")],
        (4, 4, 1),
        loss=losses.DP_TauCategoricalCrossentropy(tau=tau),
        upper_bound=b,
    )
    kernel = model.dp_layers[-1].kernel.numpy().astype(np.float64)
    np.testing.assert_allclose(kernel.T @ kernel, np.eye(NB_CLASSES), atol=1e-5)
    x = (b * kernel[:, 0] / np.linalg.norm(kernel[:, 0])).reshape(1, 4, 4, 1)
    z = kernel.T @ x.reshape(-1)
    label = int(np.argmin(z))
    assert label != 0
    y = np.eye(NB_CLASSES, dtype="float32")[[label]]
    p = np.exp(tau * (z - z.max())) / np.exp(tau * (z - z.max())).sum()
    logit_gradient = np.linalg.norm(p - y[0])
    expected = np.linalg.norm(x) * logit_gradient  # ||x g^T|| = ||x|| ||g||
    report = tightness_report(model, x.astype("float32"), y)
    row = report.row("dense/kernel")
    assert row.bound == pytest.approx(b * math.sqrt(2.0))
    assert row.max_norm == pytest.approx(expected, rel=1e-5)
    assert row.max_ratio == pytest.approx(expected / (b * math.sqrt(2.0)), rel=1e-5)
    assert row.max_ratio == pytest.approx(1.0, rel=1e-5)
    assert row.mean_ratio == row.max_ratio  # one example
    assert report.row("dense", "input").max_ratio == pytest.approx(1.0, rel=1e-5)
    assert report.row("dense", "cotangent").max_norm == pytest.approx(logit_gradient, rel=1e-5)
    assert report.violations() == ()


def test_the_model_is_left_unchanged():
    """Every variable (kernels, power-iteration vectors, biases, the clip value) and the
    optimizer's step count are the same after the report."""
    model = _clipped(_dense, with_metadata=True)
    x = _random_inputs(model, 5, shape=(4, 4, 1))
    y = np.eye(NB_CLASSES, dtype="float32")[np.arange(5)]
    before = [v.numpy().copy() for v in model.variables]
    assert len(before) > len(model.trainable_variables)  # non-trainable state is checked too
    iterations = int(model.optimizer.iterations.numpy())
    tightness_report(model, x, y)
    for old, v in zip(before, model.variables):
        np.testing.assert_array_equal(old, v.numpy())
    assert int(model.optimizer.iterations.numpy()) == iterations


def test_report_api_format_dict_and_violations():
    model, x, y = MODELS["dense"]()
    report = tightness_report(model, x, y)
    text = report.format()
    assert "max/bound" in text and "mean/bound" in text and "VIOLATED" not in text
    for row in report.rows:
        assert row.name in text
    data = json.loads(json.dumps(report.as_dict()))
    assert data["examples"] == len(x) and data["loss_normalizer"] == model.loss_normalizer
    assert [r["name"] for r in data["rows"]] == [r.name for r in report.rows]
    assert data["rows"][0]["max_ratio"] == pytest.approx(report.rows[0].max_ratio)
    with pytest.raises(KeyError, match="no gradient row named 'nothing'"):
        report.row("nothing")
    # A violation: a row above its bound by more than the tolerance.
    over = TightnessRow("gradient", "d/kernel", "d", "DP_QuickSpectralDense", 1.0, 1.01, 0.5,
                        0.5, 3)  # fmt: skip
    edge = TightnessRow("input", "d", "d", "DP_QuickSpectralDense", 1.0, 1.0 + 1e-6, 1, 1, 0)
    bad = TightnessReport(rows=(over, edge), examples=4, loss_normalizer=4.0)
    assert bad.violations() == (over,)
    assert bad.violations(tolerance=0.0) == (over, edge)
    assert "VIOLATED" in bad.format()
    assert over.max_ratio == pytest.approx(1.01) and over.mean_ratio == pytest.approx(0.5)


def test_bad_input_is_refused_in_one_line():
    model, x, y = MODELS["dense"]()
    cases = [
        (lambda: tightness_report(model, x, y[:-1]), "one label row per example"),
        (lambda: tightness_report(model, x[:0], y[:0]), "at least one example"),
        (lambda: tightness_report(model, x, y, batch_size=0), "batch_size"),
        (
            lambda: tightness_report(tf.keras.Sequential([tf.keras.layers.Dense(2)]), x, y),
            "needs a clipless DP_Model or DP_Sequential",
        ),
    ]
    uncompiled = DP_Sequential(
        [L.DP_BoundedInput(input_shape=VEC, upper_bound=1.0), L.DP_QuickSpectralDense(2)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
    )
    cases.append((lambda: tightness_report(uncompiled, x, y), "Compile the model"))
    for call, match in cases:
        with pytest.raises(ValueError, match=match) as error:
            call()
        assert "\n" not in str(error.value)
