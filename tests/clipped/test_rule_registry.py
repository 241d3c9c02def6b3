"""lipdp.clipped.per_example.registry: a ghost rule registered from outside the package, for
a layer defined here, is used by the engine (not the fallback) and gives the naive loop's
per-example norms and clipped sums, in float64, at every scale; bad registrations fail in
one line; every test leaves the registry as it found it."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential, SharpnessAscent
from lipdp.clipped.per_example import (
    GhostRule,
    ghost_rule,
    per_example_gradients,
    register_ghost_rule,
    registered_ghost_rule,
    registered_rules,
    unregister_ghost_rule,
)
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.clipped.test_per_example import _naive_bam_sum

L = tf.keras.layers
BATCH, CLASSES = 6, 3
SHAPES = {"rows": (4,), "sequences": (3, 4)}


class XW(L.Layer):
    """``x @ W`` over the last axis: no bias, no activation, the kernel named ``w``."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(name="w", shape=(input_shape[-1], self.units))

    def call(self, x):
        return tf.tensordot(x, self.w, [[x.shape.rank - 1], [0]])

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _positions(t):
    """``(b, T, width)``: every axis but the first and the last as positions."""
    return tf.reshape(t, [tf.shape(t)[0], -1, t.shape[-1]])


class XWRule(GhostRule):
    """``Z_i = A_i W``: ``grad_W,i = A_i^T G_i``, ``||grad_W,i||^2 = <A_i A_i^T, G_i G_i^T>``
    and, at ``W + grad_W,i``, ``A'_i`` gives ``(A'_i A_i^T) G_i`` more. Counts its calls."""

    name = "xw"

    def __init__(self):
        self.calls = collections.Counter()

    def kernel(self, layer):
        return layer.w

    def linear(self, layer, a):
        self.calls["linear"] += 1
        z = tf.tensordot(a, layer.w, [[a.shape.rank - 1], [0]])
        z.set_shape(a.shape[:-1].concatenate([layer.units]))
        return z

    def kernel_sq_norms(self, layer, a, g):
        self.calls["kernel_sq_norms"] += 1
        a, g = _positions(tf.cast(a, tf.float64)), _positions(tf.cast(g, tf.float64))
        grams = tf.einsum("btd,bsd->bts", a, a) * tf.einsum("btp,bsp->bts", g, g)
        return tf.reduce_sum(grams, axis=[1, 2])

    def shift(self, layer, a_new, a, g, kernel_rows):
        self.calls["shift"] += 1
        inner = tf.einsum("btd,bsd->bts", _positions(a_new), _positions(a))
        return tf.reshape(tf.einsum("bts,bsp->btp", inner, _positions(g)), tf.shape(g))


@pytest.fixture
def rule():
    """XWRule registered for XW within the test; the registry is checked to be as before."""
    before = registered_rules()
    with registered_ghost_rule(XW, XWRule()) as registration:
        yield registration.rule
    assert registered_rules() == before
    assert ghost_rule(XW(2)) == "vectorized"


def _model(layers, clipping=Clipping("flat", 1.0), ascent=None):
    model = DPSGD_Sequential(
        layers,
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=clipping,
        dataset_metadata=DatasetMetadata(
            input_shape=(1,), nb_classes=CLASSES, nb_samples_train=60, batch_size=BATCH
        ),
        ascent=ascent,
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    return model


def _net(shape):
    tf.keras.utils.set_random_seed(5)
    return [XW(5, input_shape=shape), L.Flatten(), L.Dense(CLASSES)]


def _float64_twin(model, shape):
    """The model's layers rebuilt in float64 with the same weights (a plain Sequential)."""
    twins = []
    for layer in model.layers_forward_order():
        config = {**layer.get_config(), "dtype": "float64"}
        config.pop("batch_input_shape", None)
        twins.append(type(layer).from_config(config))
    twin = tf.keras.Sequential(twins)
    twin.build((None, *shape))
    for layer, copy in zip(model.layers_forward_order(), twin.layers):
        copy.set_weights([w.astype("float64") for w in layer.get_weights()])
    return twin


def _naive_rows(twin, x, loss):
    """One float64 tape per row: ``[[the row's gradient of each variable of layer l] for
    l]``, for ``loss(i, output of row i)``."""
    layers = [layer for layer in twin.layers if layer.trainable_variables]
    result = []
    for i, xi in enumerate(x.astype("float64")):
        with tf.GradientTape() as tape:
            value = loss(i, twin(xi[None]))
        grads = tape.gradient(value, [layer.trainable_variables for layer in layers])
        result.append([[tf.convert_to_tensor(g).numpy() for g in layer] for layer in grads])
    return result


def _check_clipped_sums(facts, rows, radius):
    """Flat clipping at ``radius`` from the engine's norms: its clipped sums equal
    ``sum_i min(1, R / ||g_i||) g_i`` of the naive rows (relative 1e-5 in norm)."""
    norms = np.sqrt(np.sum(np.stack([sq.numpy() for sq in facts.sq_norms], axis=1), axis=1))
    c = tf.constant(np.minimum(1.0, radius / norms))
    sums = facts.clipped_sums([c] * len(facts.layers), tf.ones_like(c, tf.bool))
    reference = np.sqrt([sum(np.sum(t**2) for layer in row for t in layer) for row in rows])
    factors = np.minimum(1.0, radius / reference)
    variables = [v for layer in facts.layers for v in layer.trainable_variables]
    flat = [[t for layer in row for t in layer] for row in rows]
    for j, v in enumerate(variables):
        expected = sum(f * row[j] for f, row in zip(factors, flat))
        error = np.linalg.norm(sums[variable_key(v)].numpy() - expected)
        assert error <= 1e-5 * np.linalg.norm(expected), v.name


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_the_engine_uses_the_registered_rule_and_matches_the_naive_loop(shape, rule, rng):
    """The toy layer goes through its rule (its norms, no per-row gradients: not the
    fallback); its norms, the Dense's and the clipped sums equal a float64 loop."""
    model = _model(_net(shape))
    x = rng.normal(size=(BATCH, *shape)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, BATCH)]
    facts = per_example_gradients(
        model, tf.constant(x), lambda y_pred: model.per_example_losses(y, y_pred)
    )
    assert [r.rule for r in facts.records] == ["xw", "dense"]
    assert facts.records[0].ghost is rule and facts.records[0].per_row is None
    assert rule.calls["linear"] >= 1 and rule.calls["kernel_sq_norms"] == 1

    def loss(i, logits):
        return tf.nn.softmax_cross_entropy_with_logits(y[i : i + 1].astype("float64"), logits)

    rows = _naive_rows(_float64_twin(model, shape), x, loss)
    expected = np.array([[sum(np.sum(t**2) for t in layer) for layer in row] for row in rows])
    np.testing.assert_allclose(np.stack(facts.sq_norms, axis=1), expected, rtol=1e-5)
    # half the rows clipped
    _check_clipped_sums(facts, rows, radius=float(np.median(np.sqrt(expected.sum(axis=1)))))


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_the_registered_rule_is_exact_for_rows_of_norm_1e_minus_20_to_1e20(shape, rule, rng):
    """Inputs and output cotangents of row norms 1e-20, 1 and 1e20 (every pair): squared
    gradient norms from 1e-80 to 1e80, far outside float32, equal the float64 loop's; the
    clipped sums at R = 1 too."""
    model = _model([XW(3, input_shape=shape)])
    pairs = [(p, q) for p in (-20, 0, 20) for q in (-20, 0, 20)]
    x = rng.normal(size=(len(pairs), *shape))
    g = rng.normal(size=(len(pairs), *shape[:-1], 3))
    for i, (p, q) in enumerate(pairs):
        x[i] *= 10.0**p / np.linalg.norm(x[i])
        g[i] *= 10.0**q / np.linalg.norm(g[i])
    x, g = x.astype("float32"), g.astype("float32")
    cotangents = tf.constant(g)

    def linear_loss(y_pred):  # per-row <z_i, G_i>: its gradient w.r.t. z is G
        return tf.reduce_sum(_positions(y_pred * cotangents), axis=[1, 2])

    facts = per_example_gradients(model, tf.constant(x), linear_loss)
    assert [r.rule for r in facts.records] == ["xw"]
    twin = _float64_twin(model, shape)
    rows = _naive_rows(twin, x, lambda i, z: tf.reduce_sum(z * g[i].astype("float64")))
    expected = np.array([np.sum(row[0][0] ** 2) for row in rows])
    assert expected.min() < 1e-70 and expected.max() > 1e70
    np.testing.assert_allclose(facts.sq_norms[0].numpy(), expected, rtol=1e-5)
    _check_clipped_sums(facts, rows, radius=1.0)


def test_bam_moves_the_toy_layer_by_its_rules_shift(rule, rng):
    """BAM's per-example ascent through the rule's shift: the naive loop's clipped sum."""
    shape = SHAPES["sequences"]
    model = _model(_net(shape), Clipping("flat", 0.5), ascent=SharpnessAscent("bam", 0.3))
    x = rng.normal(size=(BATCH, *shape)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, BATCH)]
    summed, _, _ = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    assert rule.calls["shift"] >= 1
    for ours, expected in zip(summed, _naive_bam_sum(model, x, y, 0.3, 0.5)):
        np.testing.assert_allclose(ours.numpy(), expected, rtol=5e-4, atol=3e-6)


# ------------------------------------------------------------------ lookup by class
class _XWSubclass(XW):
    """Keeps XW's call."""


class _XWOwnCall(XW):
    def call(self, x):
        return 2.0 * super().call(x)


def test_subclasses_get_a_rule_only_if_registered_so_and_keeping_its_call():
    with registered_ghost_rule(XW, XWRule()):
        assert ghost_rule(XW(2)) == "xw"
        assert ghost_rule(_XWSubclass(2)) == "vectorized"  # exact class by default
    with registered_ghost_rule(XW, XWRule(), subclasses=True):
        assert ghost_rule(_XWSubclass(2)) == "xw"
        assert ghost_rule(_XWOwnCall(2)) == "vectorized"  # a call the rule has not seen
        with registered_ghost_rule(_XWSubclass, XWRule()) as nearest:
            assert nearest.name == "xw"
            assert ghost_rule(_XWSubclass(2)) == "xw"
        with registered_ghost_rule(_XWOwnCall, XWRule()):
            assert ghost_rule(_XWOwnCall(2)) == "xw"  # its own registration
    assert ghost_rule(L.Dense(2)) == "dense"
    assert ghost_rule(type("DenseSubclass", (L.Dense,), {})(2)) == "vectorized"


def test_registered_ghost_rule_restores_a_replaced_built_in_rule():
    before = registered_rules()

    class Renamed(XWRule):
        name = "renamed"

    with registered_ghost_rule(L.Dense, Renamed()):
        assert ghost_rule(L.Dense(2)) == "renamed"
    assert registered_rules() == before and ghost_rule(L.Dense(2)) == "dense"


# --------------------------------------------------------------------------- errors
class _NoShift(GhostRule):
    def linear(self, layer, a):
        return a

    def kernel_sq_norms(self, layer, a, g):
        return tf.zeros([tf.shape(a)[0]], tf.float64)


def _one_line(error):
    message = str(error.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("target", [int, XW(2), "Dense"], ids=["int", "instance", "name"])
def test_registering_for_a_non_layer_class_fails_in_one_line(target):
    with pytest.raises(TypeError, match="Keras layer class") as error:
        register_ghost_rule(target, XWRule())
    _one_line(error)


@pytest.mark.parametrize(
    ("bad_rule", "message"),
    [
        (_NoShift(), "lacks shift"),
        (GhostRule(), "lacks linear, kernel_sq_norms, shift"),
        (XWRule, "instance of a GhostRule subclass"),
        (object(), "instance of a GhostRule subclass"),
    ],
    ids=["no-shift", "no-pieces", "a-class", "not-a-rule"],
)
def test_registering_a_rule_missing_a_piece_fails_in_one_line(bad_rule, message):
    before = registered_rules()
    with pytest.raises(TypeError, match=message) as error:
        register_ghost_rule(XW, bad_rule)
    _one_line(error)
    assert registered_rules() == before


def test_a_second_rule_for_a_class_and_unregistering_an_absent_one_fail():
    with pytest.raises(ValueError, match="already has ghost rule 'dense'") as error:
        register_ghost_rule(L.Dense, XWRule())
    _one_line(error)
    with pytest.raises(KeyError, match="No ghost rule"):
        unregister_ghost_rule(XW)


def test_register_and_unregister_by_hand():
    before = registered_rules()
    register_ghost_rule(XW, XWRule())
    try:
        assert ghost_rule(XW(2)) == "xw"
    finally:
        assert unregister_ghost_rule(XW).name == "xw"
    assert registered_rules() == before


class XWPlusB(XW):
    """XW with a trainable offset the rule below does not cover. (No leading underscore:
    Keras 3 refuses the default name ``_xw_plus_b`` as a root name scope.)"""

    def build(self, input_shape):
        super().build(input_shape)
        self.b = self.add_weight(name="b", shape=(self.units,), initializer="zeros")

    def call(self, x):
        return super().call(x) + self.b


class _Float32Norms(XWRule):
    def kernel_sq_norms(self, layer, a, g):
        return tf.cast(super().kernel_sq_norms(layer, a, g), tf.float32)


@pytest.mark.parametrize(
    ("layer_class", "bad_rule", "error", "message"),
    [
        (XWPlusB, XWRule(), ValueError, r"covers \['.*w(:0)?'\] of layer .* which trains"),
        (XW, _Float32Norms(), TypeError, "float32 squared norms .* must be float64"),
    ],
    ids=["a-variable-left-out", "float32-norms"],
)
def test_a_rule_that_would_miss_part_of_a_norm_is_refused(layer_class, bad_rule, error, message):
    model = _model([layer_class(2, input_shape=(3,))])
    x = tf.ones((BATCH, 3))
    with registered_ghost_rule(layer_class, bad_rule):
        with pytest.raises(error, match=message) as raised:
            per_example_gradients(model, x, lambda y_pred: tf.reduce_sum(y_pred, axis=1))
    _one_line(raised)
