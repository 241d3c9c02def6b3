"""Attention in clipped DP-SGD: exact per-example norms, and a process that survives (issue 37).

An attention layer has no ghost rule: the engine takes each row's gradient from a vectorised
map of the layer's own backward pass. Run there as a batch of one row, its projections
``(1, T, d) @ (d, p)`` became oneDNN matmuls of ``(b, 1, T, d)`` against a broadcast
``(d, p)``, which TensorFlow 2.21's oneDNN mishandles on CPU: ``MultiHeadAttention`` killed
the process (heap corruption: abort or segfault), and an attention written with
``tf.matmul`` returned squared norms 5 times too small on a batch of 4, without a word
(``lipdp.clipped.per_example.engine._row_copies``). Both layers are checked here against a
naive loop of one ``GradientTape`` per row, and ``MultiHeadAttention`` by the remove-one
attack on a real step. (On TensorFlow 2.15, without the bug, the same checks hold.)
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import lipdp
from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential, SharpnessAscent
from lipdp.clipped.per_example import per_example_gradients
from lipdp.foundation.metadata import DatasetMetadata
from tests.clipped.test_per_example import _naive_bam_sum
from tests.marks import thorough
from tests.remove_one import TOLERANCE, remove_one_ratios

L = tf.keras.layers
T, D, CLASSES, N = 5, 8, 3, 48


class MatmulAttention(L.Layer):
    """Single-head self-attention written with ``tf.matmul``, as a user would write it."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        shape = (int(input_shape[-1]), self.units)
        self.query = self.add_weight(name="query", shape=shape)
        self.key = self.add_weight(name="key", shape=shape)
        self.value = self.add_weight(name="value", shape=shape)

    def call(self, x):
        q, k, v = tf.matmul(x, self.query), tf.matmul(x, self.key), tf.matmul(x, self.value)
        scores = tf.matmul(q, k, transpose_b=True) / self.units**0.5
        return tf.matmul(tf.nn.softmax(scores), v)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _mha_block():
    """A transformer block as a functional model: self-attention, residual, layer norm."""
    inputs = tf.keras.Input((T, D))
    attended = L.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    return tf.keras.Model(inputs, L.LayerNormalization()(L.Add()([inputs, attended])))


#: name -> (the attention part of the model, batch size: the sizes at which each crashed or
#: went wrong before the fix).
NETS = {
    "multi-head-attention": (_mha_block, 6),
    "matmul-attention": (lambda: MatmulAttention(4), 4),
}


def _model(name, clip_norm=1.0, **options):
    build, batch = NETS[name]
    model = DPSGD_Sequential(
        [L.InputLayer((T, D)), build(), L.Flatten(), L.Dense(CLASSES)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", clip_norm),
        dataset_metadata=DatasetMetadata(
            input_shape=(T, D), nb_classes=CLASSES, nb_samples_train=N, batch_size=batch,
            sampling="poisson",
        ),
        **options,
    )  # fmt: skip
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    return model


def _data(name, rng):
    rows = NETS[name][1]
    x = rng.normal(size=(rows, T, D)).astype("float32")
    return x, np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, rows)]


def _naive_sq_norms(model, x, y):
    """One tape per row: ``[rows, weighted layers]`` squared norms (float64)."""
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    layers = model.weighted_layers()
    result = []
    for i in range(len(x)):
        row = []
        with tf.GradientTape(persistent=True) as tape:
            loss = loss_fn(y[i : i + 1], model(x[i : i + 1], training=True))
        for layer in layers:
            grads = tape.gradient(loss, layer.trainable_variables, unconnected_gradients="zero")
            row.append(sum(np.sum(tf.convert_to_tensor(g).numpy().astype("float64") ** 2)
                           for g in grads))  # fmt: skip
        del tape
        result.append(row)
    return np.array(result)


@pytest.mark.parametrize(
    "name, isolated",
    [
        ("multi-head-attention", False),
        ("matmul-attention", False),
        # Row isolation runs the attention as a row loop; a Jacobian's pfor over that loop
        # would rebuild the shapes oneDNN corrupts (it aborted the process): it loops too.
        ("multi-head-attention", True),
        pytest.param("matmul-attention", True, marks=thorough),
    ],
)
def test_attention_norms_equal_the_naive_loop(name, isolated, rng):
    """Both methods: the ghost method's fallback for the attention (the head has its ghost
    rule) and the Jacobian, with and without row isolation."""
    model = _model(name, row_isolation=isolated)
    x, y = _data(name, rng)
    model(x[:1])  # builds every layer
    expected = _naive_sq_norms(model, x, y)
    for method in ("ghost", "jacobian"):
        facts = per_example_gradients(
            model, tf.constant(x), lambda y_pred: model.per_example_losses(y, y_pred), method
        )
        if method == "ghost":
            assert [r.rule for r in facts.records] == ["vectorized", "dense"]
        ours = np.stack([sq.numpy() for sq in facts.sq_norms], axis=1)
        np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-12, err_msg=method)


def test_removing_one_row_of_a_transformer_block_moves_the_step_by_the_clip_norm(rng):
    """``make_private`` on the block under a head, as a user writes it; every row clipped
    (R below every row's norm): each row moves the released step by R exactly."""
    inputs = tf.keras.Input((T, D))
    outputs = L.Dense(CLASSES)(L.Flatten()(_mha_block()(inputs)))
    batch = NETS["multi-head-attention"][1]
    model = lipdp.make_private(
        tf.keras.Model(inputs, outputs), epsilon=3.0, delta=1e-5, epochs=1, batch_size=batch,
        dataset_size=N, method="clipped", clip_norm=1e-3,
    )  # fmt: skip
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    x, y = _data("multi-head-attention", rng)
    ratios = remove_one_ratios(model, x, y, rows=[0, 3])
    assert 0.99 < ratios.min() and ratios.max() <= 1 + TOLERANCE


@pytest.mark.parametrize("name", [pytest.param(name, marks=thorough) for name in NETS])
def test_bam_ascent_through_attention_is_per_example(name, rng):
    """BAM runs the attention on each row's own shifted weights (the same per-row call):
    its clipped sum equals the loop that moves the weights to each row's ascent point."""
    radius, clip = 0.3, 0.5
    model = _model(name, clip, ascent=SharpnessAscent("bam", radius))
    x, y = _data(name, rng)
    model(x[:1])
    expected = _naive_bam_sum(model, x, y, radius, clip)
    summed, _, _ = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    for ours, reference in zip(summed, expected):
        np.testing.assert_allclose(ours.numpy(), reference, rtol=5e-4, atol=3e-6)
