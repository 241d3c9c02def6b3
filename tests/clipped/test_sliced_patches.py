"""The Conv2D ghost rule's patches from strided slices (issue 39) are TensorFlow's
``extract_patches``, value for value, for every padding, stride, dilation and kernel shape
(odd, even, rectangular, larger than the input), and the per-example norms built on them
match a loop of one ``GradientTape`` per row."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipped.per_example.convolution import sliced_patches

CASES = [
    # (input H, W, c), kernel, strides, dilation
    ((7, 9, 3), (3, 3), (1, 1), (1, 1)),
    ((7, 9, 3), (2, 4), (1, 1), (1, 1)),
    ((8, 8, 2), (3, 3), (2, 2), (1, 1)),
    ((9, 7, 2), (3, 2), (2, 3), (1, 1)),
    ((10, 11, 1), (3, 3), (1, 1), (2, 3)),
    ((6, 6, 4), (1, 1), (1, 1), (1, 1)),
    ((5, 5, 2), (5, 5), (1, 1), (1, 1)),
    ((4, 5, 2), (6, 3), (1, 1), (1, 1)),  # taller than the input: "same" only
    ((12, 13, 3), (4, 3), (3, 2), (1, 2)),
]


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize(("shape", "kernel", "strides", "dilation"), CASES)
def test_sliced_patches_are_extract_patches(shape, kernel, strides, dilation, padding):
    a = tf.constant(np.random.default_rng(0).normal(size=(3, *shape)).astype("float32"))
    try:
        expected = tf.image.extract_patches(
            a,
            sizes=[1, *kernel, 1],
            strides=[1, *strides, 1],
            rates=[1, *dilation, 1],
            padding=padding.upper(),
        )
    except tf.errors.InvalidArgumentError:  # a kernel larger than a "valid" input
        assert sliced_patches(a, kernel, strides, dilation, padding) is None
        return
    got = sliced_patches(a, kernel, strides, dilation, padding)
    if expected.shape[1] == 0 or expected.shape[2] == 0:
        assert got is None  # no output position: TensorFlow's kernel takes the case
        return
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_unknown_spatial_size_falls_back():
    seen = []

    @tf.function(input_signature=[tf.TensorSpec([None, None, None, 3])])
    def trace(a):
        seen.append(sliced_patches(a, (3, 3), (1, 1), (1, 1), "same"))
        return a

    trace.get_concrete_function()
    assert seen == [None]


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize(
    ("kernel", "strides", "dilation"),
    [((3, 3), (1, 1), (1, 1)), ((2, 3), (2, 1), (1, 1)), ((3, 2), (1, 1), (2, 1))],
)
def test_single_channel_kernel_rows_are_the_rows_gradients(kernel, strides, dilation, padding):
    """One-channel inputs take the stacked patches: each row's kernel gradient, against
    one GradientTape per row through the layer itself."""
    import keras

    from lipdp.clipped.per_example.convolution import Conv2DRule, single_channel_patches

    layer = keras.layers.Conv2D(
        5, kernel, strides=strides, dilation_rate=dilation, padding=padding, use_bias=False
    )
    rng = np.random.default_rng(1)
    a = tf.constant(rng.normal(size=(4, 9, 8, 1)).astype("float32"))
    z = layer(a)
    g = tf.constant(rng.normal(size=z.shape).astype("float32"))
    assert single_channel_patches(layer, a) is not None
    got = Conv2DRule().kernel_rows(layer, a, g)
    for i in range(4):
        with tf.GradientTape() as tape:
            out = layer(a[i : i + 1])
        expected = tape.gradient(out, layer.kernel, output_gradients=g[i : i + 1])
        np.testing.assert_allclose(got[i].numpy(), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize(("shape", "kernel", "strides", "dilation"), CASES)
def test_offset_kernel_rows_are_the_rows_gradients(shape, kernel, strides, dilation, padding):
    """Several channels: each row's kernel gradient from one product per kernel offset
    (issue 39: no patch matrix), against one GradientTape per row through the layer
    itself; ``None`` only where the Grams are cheaper or the layer has no output."""
    import keras

    from lipdp.clipped.per_example.convolution import Conv2DRule, offset_kernel_rows
    from lipdp.clipped.per_example.dense import materialise

    if max(strides) > 1 and max(dilation) > 1:
        pytest.skip("Keras' Conv2D takes no strides > 1 with a dilation > 1")
    layer = keras.layers.Conv2D(
        4, kernel, strides=strides, dilation_rate=dilation, padding=padding, use_bias=False
    )
    rng = np.random.default_rng(2)
    a = tf.constant(rng.normal(size=(3, *shape)).astype("float32"))
    try:
        z = layer(a)
    except (ValueError, tf.errors.InvalidArgumentError):  # a kernel larger than the input
        return
    if 0 in z.shape:
        return
    g = tf.constant(rng.normal(size=z.shape).astype("float32"))
    got = offset_kernel_rows(layer, a, g)
    positions, d = z.shape[1] * z.shape[2], kernel[0] * kernel[1] * shape[2]
    assert (got is None) == (not materialise(positions, d, 4))
    if got is None:
        return
    assert Conv2DRule().kernel_rows(layer, a, g) is not None
    for i in range(3):
        with tf.GradientTape() as tape:
            out = layer(a[i : i + 1])
        expected = tape.gradient(out, layer.kernel, output_gradients=g[i : i + 1])
        np.testing.assert_allclose(got[i].numpy(), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_micro_batched_cnn_step_takes_the_offsets_and_releases_what_the_whole_batch_does(
    monkeypatch,
):
    """The offsets run only in the step of a model given ``physical_batch_size`` (speed
    where memory was not asked for): that step takes them, the whole-batch step does not,
    and the two release the same gradient (1e-5 relative, noise-free, 24 rows in
    micro-batches of 8)."""
    import dataclasses

    import keras

    from lipdp import make_private
    from lipdp.clipped.per_example import convolution

    calls = []
    original = convolution.offset_kernel_rows

    def counted(*args):
        result = original(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(convolution, "offset_kernel_rows", counted)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 6, 6, 3)).astype("float32")
    y = np.eye(4, dtype="float32")[rng.integers(0, 4, 24)]
    released = {}
    for physical in (None, 8):
        keras.utils.set_random_seed(1)
        layers = [
            keras.Input((6, 6, 3)),
            keras.layers.Conv2D(5, 3, padding="same", activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(4),
        ]
        model = make_private(
            layers, epsilon=3.0, delta=1e-5, epochs=1, batch_size=24, dataset_size=240,
            method="clipped", physical_batch_size=physical,
        )  # fmt: skip
        model.dp_parameters = dataclasses.replace(
            model.dp_parameters, noise_multiplier=0.0, non_private=True
        )
        model.compile(
            optimizer=keras.optimizers.SGD(1.0),
            loss=keras.losses.CategoricalCrossentropy(from_logits=True),
        )
        before = [np.asarray(v).copy() for v in model.trainable_variables]
        taken = len(calls)
        model.train_on_batch(x, y)
        released[physical] = np.concatenate(
            [(b - np.asarray(v)).ravel() for b, v in zip(before, model.trainable_variables)]
        )
        assert any(calls[taken:]) == (physical is not None)
    gap = np.linalg.norm(released[None] - released[8]) / np.linalg.norm(released[None])
    assert np.linalg.norm(released[None]) > 1e-3 and gap <= 1e-5
