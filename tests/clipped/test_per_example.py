"""lipdp.clipped.per_example: ghost norms and clipped sums equal a naive loop of one GradientTape
per row, for every layer kind the ghost method handles and for the vectorised fallback."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.clipped.per_example import ghost_rule, per_example_gradients, weighted_layers
from lipdp.foundation import compat
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.marks import representatives, thorough
from tests.remove_one import TOLERANCE, remove_one_ratios

L = tf.keras.layers
BATCH, CLASSES = 6, 4


def _conv_net(padding="same", strides=1, dilation=1, kernel=3, filters=5, bias=True):
    return [
        L.Conv2D(
            filters,
            kernel,
            strides=strides,
            dilation_rate=dilation,
            padding=padding,
            use_bias=bias,
            activation="relu",
            input_shape=(9, 9, 2),
        ),
        L.Conv2D(3, 2, padding="valid", activation="tanh"),
        L.Flatten(),
        L.Dense(CLASSES),
    ]


# name -> (layers builder, input shape or "ids", expected ghost rules of the weighted layers)
NETS = {
    "dense": (
        lambda: [L.Dense(7, activation="tanh", input_shape=(5,)), L.Dense(CLASSES)],
        (5,),
        ["dense", "dense"],
    ),
    "dense-sequence-ghost": (  # T (d + p) = 39 < d p = 40
        lambda: [L.Dense(8, activation="relu", input_shape=(3, 5)), L.Flatten(), L.Dense(CLASSES)],
        (3, 5),
        ["dense", "dense"],
    ),
    "dense-sequence-materialised": (  # T (d + p) = 60 > d p = 6
        lambda: [L.Dense(3, input_shape=(12, 2)), L.Flatten(), L.Dense(CLASSES, use_bias=False)],
        (12, 2),
        ["dense", "dense"],
    ),
    "conv-same": (lambda: _conv_net(), (9, 9, 2), ["conv2d", "conv2d", "dense"]),
    "conv-valid-stride2-even": (
        lambda: _conv_net("valid", strides=2, kernel=4, bias=False),
        (9, 9, 2),
        ["conv2d", "conv2d", "dense"],
    ),
    "conv-same-stride2-even": (
        lambda: _conv_net("same", strides=2, kernel=2),
        (9, 9, 2),
        ["conv2d", "conv2d", "dense"],
    ),
    "conv-dilated-materialised": (  # few filters x small kernel: materialised branch
        lambda: _conv_net("same", dilation=2, kernel=2, filters=1),
        (9, 9, 2),
        ["conv2d", "conv2d", "dense"],
    ),
    "conv-gram": (  # T (d + p) < d p: the Gram branch
        lambda: [
            L.Conv2D(16, 3, padding="valid", activation="relu", input_shape=(4, 4, 8)),
            L.Conv2D(12, 2, padding="valid"),
            L.Flatten(),
            L.Dense(CLASSES),
        ],
        (4, 4, 8),
        ["conv2d", "conv2d", "dense"],
    ),
    "embedding": (
        lambda: [
            L.Embedding(6, 3, input_shape=(7,)),
            L.Flatten(),
            L.Dense(CLASSES),
        ],
        "ids",
        ["embedding", "dense"],
    ),
    "fallback-normalisations": (
        lambda: [
            L.Conv2D(4, 3, padding="same", input_shape=(9, 9, 2)),
            L.GroupNormalization(groups=2),
            L.DepthwiseConv2D(3, activation="relu"),
            L.Flatten(),
            L.LayerNormalization(),
            L.Dense(CLASSES),
        ],
        (9, 9, 2),
        ["conv2d", "vectorized", "vectorized", "vectorized", "dense"],
    ),
    "fallback-grouped-conv-row-loop": (  # per-row gradients by a loop, not pfor
        lambda: [
            L.Conv2D(4, 3, groups=2, padding="same", activation="tanh", input_shape=(9, 9, 2)),
            L.Flatten(),
            L.Dense(CLASSES),
        ],
        (9, 9, 2),
        ["vectorized", "dense"],
    ),
    "nested-dense-after-masked-embedding": (
        lambda: [
            L.Embedding(6, 3, mask_zero=True, input_shape=(7,)),
            tf.keras.Sequential([L.Dense(4, activation="tanh")]),
            L.Dense(5, activation="tanh"),  # a ghost rule: the mask must pass through
            L.GlobalAveragePooling1D(),
            L.Dense(CLASSES),
        ],
        "ids",
        ["vectorized", "dense", "dense", "dense"],
    ),
}


def _block(filters, name, trainable=True):
    """A convolutional block as a pretrained backbone has it (GroupNormalization)."""
    block = tf.keras.Sequential(
        [L.Conv2D(filters, 3, padding="same"), L.GroupNormalization(2), L.ReLU()], name=name
    )
    block.trainable = trainable
    return block


class _TiedProjection(L.Layer):
    """Projects back with the kernel of ``dense``, read through a closure (untracked)."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self._read_kernel = lambda: dense.kernel

    def call(self, inputs):
        return tf.matmul(inputs, self._read_kernel(), transpose_b=True)


class _Scaled(L.Layer):
    """Multiplies by a factor given in the call: an argument a layer-by-layer run of the
    graph would drop. (Not ``Dropout(...)(h, training=False)``: Keras 3's functional
    models override such a ``training`` with the outer call's.)"""

    def call(self, inputs, factor=1.0):
        return inputs * factor


def _tied_backbone():
    dense = L.Dense(3, activation="tanh")
    return tf.keras.Sequential([dense, _TiedProjection(dense), L.Dense(4)], name="tied")


def _functional(shape, body, name):
    inputs = tf.keras.Input(shape)
    return tf.keras.Model(inputs, body(inputs), name=name)


# Nested models (issue 26): a backbone nested in the model. A chain (Sequential, or a
# functional model whose layers form one chain, at any depth) is run layer by layer, each
# layer with its own rule; anything else is one fallback layer. Same tuple as NETS.
NESTED = {
    "nested-sequential-cnn-frozen-block": (
        lambda: [
            L.InputLayer(input_shape=(9, 9, 2)),
            tf.keras.Sequential(
                [
                    _block(4, "block1", trainable=False),  # frozen: run as is
                    _block(4, "block2"),
                    L.MaxPooling2D(),
                    L.Flatten(),
                    L.Dense(6, activation="relu"),
                ],
                name="backbone",
            ),
            L.Dense(CLASSES),
        ],
        (9, 9, 2),
        ["conv2d", "vectorized", "dense", "dense"],
    ),
    "nested-functional-chain": (
        lambda: [
            L.InputLayer(input_shape=(9, 9, 2)),
            _functional(
                (9, 9, 2),
                lambda i: L.Dense(6, activation="tanh")(
                    L.Flatten()(L.GroupNormalization(3)(L.Conv2D(3, 3)(L.Rescaling(0.5)(i))))
                ),
                name="backbone",
            ),
            L.Dense(CLASSES),
        ],
        (9, 9, 2),
        ["conv2d", "vectorized", "dense", "dense"],
    ),
    "nested-two-levels-and-functional-of-sequential": (
        lambda: [
            L.InputLayer(input_shape=(5,)),
            tf.keras.Sequential(
                [
                    L.Dense(6, activation="tanh"),
                    tf.keras.Sequential([L.Dense(5, activation="relu"), L.LayerNormalization()]),
                ],
                name="backbone",
            ),
            _functional(
                (5,), lambda i: tf.keras.Sequential([L.Dense(4, activation="tanh")])(i), "neck"
            ),
            L.Dense(CLASSES),
        ],
        (5,),
        ["dense", "dense", "vectorized", "dense", "dense"],
    ),
    "nested-masked-recurrent": (  # the mask reaches the fallback's rows
        lambda: [
            L.InputLayer(input_shape=(7,), dtype="int32"),
            tf.keras.Sequential(
                [L.Embedding(6, 3, mask_zero=True), L.SimpleRNN(4)],
                name="backbone",
            ),
            L.Dense(CLASSES),
        ],
        "ids",
        ["vectorized", "vectorized", "dense"],
    ),
    "nested-branch-stays-on-the-fallback": (
        lambda: [
            L.InputLayer(input_shape=(5,)),
            _functional(
                (5,),
                lambda i: L.Dense(4)(L.Add()([i, L.Dense(5, activation="tanh")(i)])),
                name="residual",
            ),
            L.Dense(CLASSES),
        ],
        (5,),
        ["vectorized", "dense"],
    ),
    "nested-tie-inside-runs-whole": (  # a layer reads its sibling's kernel
        lambda: [L.InputLayer(input_shape=(5,)), _tied_backbone(), L.Dense(CLASSES)],
        (5,),
        ["vectorized", "dense"],
    ),
    "nested-call-argument-stays-on-the-fallback": (  # a layer called with an argument
        lambda: [
            L.InputLayer(input_shape=(5,)),
            _functional(
                (5,),
                lambda i: L.Dense(4)(_Scaled(name="scaled")(L.Dense(5)(i), factor=3.0)),
                name="backbone",
            ),
            L.Dense(CLASSES),
        ],
        (5,),
        ["vectorized", "dense"],
    ),
}
NETS.update(NESTED)


def _model(name, clipping=Clipping("flat", 1.0), method="ghost", strategy="global", **sampling):
    build, _, _ = NETS[name]
    meta = DatasetMetadata(
        input_shape=(1,), nb_classes=CLASSES, nb_samples_train=60, batch_size=BATCH, **sampling
    )
    model = DPSGD_Sequential(
        build(),
        dp_parameters=DPParameters(strategy, 1.0, 1e-5),
        clipping=clipping,
        dataset_metadata=meta,
        gradient_method=method,
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    return model


def _data(name, rng, rows=BATCH):
    shape = NETS[name][1]
    if shape == "ids":
        x = rng.integers(0, 6, size=(rows, 7)).astype("int32")
        x[:, :3] = x[:, :1]  # repeated ids: the embedding's rows add up
    else:
        x = (2 * rng.normal(size=(rows, *shape))).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, rows)]
    return x, y


def _naive_gradients(model, x, y):
    """One tape per row: ``[[grad of each variable of layer l] for l]`` per row."""
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    result = []
    for xi, yi in zip(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model(xi[None], training=True))
        variables = [v for layer in model.weighted_layers() for v in layer.trainable_variables]
        flat = tape.gradient(loss, variables, unconnected_gradients="zero")
        grouped, start = [], 0
        for layer in model.weighted_layers():
            count = len(layer.trainable_variables)
            grouped.append(
                [
                    tf.convert_to_tensor(g).numpy().astype("float64")
                    for g in flat[start : start + count]
                ]
            )
            start += count
        result.append(grouped)
    return result


def _losses(model, y):
    return lambda y_pred: model.per_example_losses(y, y_pred)


@pytest.mark.parametrize(
    "name",
    representatives(NETS, default=set(NETS) - {"nested-masked-recurrent"}),  # 10 s
)
def test_ghost_rules_and_norms_equal_the_naive_loop(name, rng):
    """Per weighted layer of the model (a nested backbone is one: its layers' squared norms
    summed), ghost and Jacobian norms equal the naive loop's; the ghost method's records
    show the rule each layer got (nested chains expanded)."""
    model = _model(name)
    x, y = _data(name, rng)
    naive = _naive_gradients(model, x, y)
    expected = np.array([[sum(np.sum(g**2) for g in layer) for layer in row] for row in naive])
    for method in ("ghost", "jacobian"):
        facts = per_example_gradients(model, tf.constant(x), _losses(model, y), method)
        ours = np.stack([sq.numpy() for sq in facts.sq_norms], axis=1)
        np.testing.assert_allclose(ours, expected, rtol=2e-4, atol=1e-7, err_msg=method)
        if method == "ghost":
            assert [r.rule for r in facts.records] == NETS[name][2]
            assert [r.rule for r in facts.records] == [ghost_rule(r.layer) for r in facts.records]
            assert facts.layers == model.weighted_layers()


@pytest.mark.skipif(not compat.keras_3(), reason="Keras 2's Dense has no LoRA")
def test_a_lora_dense_takes_the_fallback_with_the_naive_norms(rng):
    """Keras 3's LoRA computes a Dense kernel from the frozen one and two trainable
    factors: the Dense rule (the kernel as the variable it differentiates) does not apply;
    the fallback gives the naive loop's norms and clipped sum."""
    model = _model("dense")
    lora = model.layers_forward_order()[0]
    lora.enable_lora(2)
    lora.lora_kernel_b.assign(rng.normal(size=lora.lora_kernel_b.shape))  # else zeros
    x, y = _data("dense", rng)
    naive = _naive_gradients(model, x, y)
    expected = np.array([[sum(np.sum(g**2) for g in layer) for layer in row] for row in naive])
    facts = per_example_gradients(model, tf.constant(x), _losses(model, y), "ghost")
    assert [r.rule for r in facts.records] == ["vectorized", "dense"]
    ours = np.stack([sq.numpy() for sq in facts.sq_norms], axis=1)
    np.testing.assert_allclose(ours, expected, rtol=2e-4, atol=1e-7)
    summed, _, _ = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    factors = [min(1.0, 1.0 / np.sqrt(total)) for total in expected.sum(axis=1)]
    flat = [[g for layer in row for g in layer] for row in naive]
    for j, ours_j in enumerate(summed):
        reference = sum(f * row[j] for f, row in zip(factors, flat))
        np.testing.assert_allclose(ours_j.numpy(), reference, rtol=3e-4, atol=2e-6)


def _clipped_sum_cases():
    """(net, method, clipping): the ghost rules under three clipping modes; the nested
    models (a fallback layer's clipped sum is covered by the first) with both methods under
    flat and per-layer clipping (one radius per layer of the model: a backbone is one)."""
    flat, per_layer = Clipping("flat", 0.3), Clipping("per-layer", 0.3)
    ghost_nets = ["conv-same", "conv-gram", "embedding", "fallback-normalisations"]
    nested = [
        "nested-sequential-cnn-frozen-block",
        "nested-functional-chain",
        "nested-two-levels-and-functional-of-sequential",
        "nested-branch-stays-on-the-fallback",
    ]
    cases = [
        (name, "ghost", clipping)
        for name in ghost_nets
        for clipping in (flat, per_layer, Clipping("automatic", 0.3))
    ]
    cases += [
        (name, method, clipping)
        for name in nested
        for method in ("ghost", "jacobian")
        for clipping in (flat, per_layer)
    ]
    return [
        pytest.param(
            *case,
            id=f"{case[0]}-{case[1]}-{case[2].mode}",
            marks=[] if _clipped_sum_in_default_run(*case) else [thorough],
        )
        for case in cases
    ]


def _clipped_sum_in_default_run(name, method, clipping):
    """Default run: every ghost rule and nested model under flat clipping with ghost norms,
    the three modes on one convolution, per-layer clipping and the Jacobian method on the
    CNN backbone; the other combinations in the thorough tier (1-2 s each)."""
    if name == "conv-same" or (method, clipping.mode) == ("ghost", "flat"):
        return True
    return name == "nested-sequential-cnn-frozen-block" and method == "jacobian"


@pytest.mark.parametrize(("name", "method", "clipping"), _clipped_sum_cases())
def test_clipped_sums_equal_the_naive_loop(name, method, clipping, rng):
    """Flat, per-layer (one radius per layer of the model: a nested backbone is one) and
    automatic clipping: the clipped sum equals the naive loop's."""
    model = _model(name, clipping, method)
    x, y = _data(name, rng)
    naive = _naive_gradients(model, x, y)
    layers = model.weighted_layers()
    radii = clipping.layer_radii(len(layers)) if clipping.mode == "per-layer" else None
    variables = [v for layer in layers for v in layer.trainable_variables]
    expected = [np.zeros(v.shape) for v in variables]
    for row in naive:
        norms = [np.sqrt(sum(np.sum(g**2) for g in layer)) for layer in row]
        total = np.sqrt(sum(n**2 for n in norms))
        flat = [g for layer in row for g in layer]
        if radii is None:
            r = clipping.clip_norm
            factor = min(1.0, r / total) if clipping.mode == "flat" else r / (total + 0.01)
            factors = [factor] * len(flat)
        else:
            factors = [min(1.0, r / n) for n, r, layer in zip(norms, radii, row) for _ in layer]
        expected = [e + f * g for e, f, g in zip(expected, factors, flat)]
    summed, _, _ = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    ours = {variable_key(v): s.numpy() for v, s in zip(model.trainable_variables, summed)}
    for v, e in zip(variables, expected):
        np.testing.assert_allclose(ours[variable_key(v)], e, rtol=3e-4, atol=2e-6, err_msg=v.name)


def _remove_one_cases():
    """(net, clipping, noise strategy): per-layer on the chains (one radius per layer of the
    model), flat on the CNN backbone; the rest under ``make test-slow`` (2-5 s each)."""
    flat, per_layer = (Clipping("flat", 1e-3), "global"), (Clipping("per-layer", 1e-3), "per-layer")
    cases = []
    for name in [
        "nested-sequential-cnn-frozen-block",
        "nested-functional-chain",
        "nested-two-levels-and-functional-of-sequential",
        "nested-branch-stays-on-the-fallback",
    ]:
        for mode, (clipping, strategy) in {"flat": flat, "per-layer": per_layer}.items():
            # Default run: the CNN with a frozen block (flat) and the functional chain
            # (per-layer); the other combinations run in make test-slow.
            slow = "branch" in name or (name, mode) not in {
                ("nested-sequential-cnn-frozen-block", "flat"),
                ("nested-functional-chain", "per-layer"),
            }
            marks = [pytest.mark.slow] if slow else []
            cases.append(pytest.param(name, clipping, strategy, marks=marks, id=f"{name}-{mode}"))
    return cases


@pytest.mark.parametrize(("name", "clipping", "strategy"), _remove_one_cases())
def test_remove_one_on_nested_models_stays_within_the_sensitivity(name, clipping, strategy, rng):
    """The attacker's check, one real step: with a clip norm below every row's gradient
    norm, removing a row changes the released gradient by exactly its clipped
    contribution, ``R`` (flat) or ``R_l`` per layer of the model (per-layer noise: a
    nested backbone is one mechanism), never more."""
    model = _model(name, clipping, strategy=strategy, sampling="poisson")
    x, y = _data(name, rng)
    ratios = remove_one_ratios(model, x, y, rows=[0])
    assert ratios.shape == (1, 1 if strategy == "global" else len(model.weighted_layers()))
    assert 0.99 < ratios.max() <= 1 + TOLERANCE


def test_rows_with_non_finite_values_contribute_nothing(rng):
    """A row whose activations overflow to inf (through a ReLU to the logits: its loss
    and cotangents are NaN) has NaN norms: it is dropped, and the layer-local second pass
    does not turn 0 x inf into NaN for the others. (Through a saturating tanh the row's
    float32 gradient stays finite and it is clipped like any other:
    tests/clipped/test_extreme_records.py.)"""
    name = "dense-sequence-ghost"
    model = _model(name)
    x, y = _data(name, rng)
    x[2] = 3e38  # finite input, infinite activations
    summed, _, finite = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    assert all(np.all(np.isfinite(s.numpy())) for s in summed)
    keep = np.ones(BATCH, bool)
    keep[2] = False
    reference, _, _ = model.clipped_gradient_sum(tf.constant(x[keep]), tf.constant(y[keep]))
    for a, b in zip(summed, reference):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


def test_shared_variables_are_refused():
    dense = L.Dense(3)
    dense.build((None, 3))
    wrapper = tf.keras.Sequential([dense])
    wrapper.build((None, 3))
    with pytest.raises(ValueError, match="shared"):
        weighted_layers([dense, wrapper])


def _naive_bam_sum(model, x, y, radius, clip_norm):
    """BAM by definition, one row at a time: gradient g_i at theta, weights set to
    theta + radius g_i / ||g_i||, gradient there, flat-clipped, summed."""
    loss_fn = tf.keras.losses.CategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    start = [v.numpy() for v in variables]

    def gradient(xi, yi):
        with tf.GradientTape() as tape:
            loss = loss_fn(yi[None], model(xi[None], training=True))
        grads = tape.gradient(loss, variables, unconnected_gradients="zero")
        return [tf.convert_to_tensor(g).numpy().astype("float64") for g in grads]

    total = [np.zeros(v.shape) for v in variables]
    for xi, yi in zip(x, y):
        grads = gradient(xi, yi)
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        for v, w, g in zip(variables, start, grads):
            v.assign(w + radius * g / norm)
        shifted = gradient(xi, yi)
        for v, w in zip(variables, start):
            v.assign(w)
        factor = min(1.0, clip_norm / np.sqrt(sum(np.sum(g**2) for g in shifted)))
        total = [t + factor * g for t, g in zip(total, shifted)]
    return total


@pytest.mark.parametrize(
    "name",
    [
        # Default run: one net per branch of the ascent (dense, both convolution branches,
        # embedding, the row loop, a nested chain); the others in the thorough tier.
        "dense",
        pytest.param("dense-sequence-ghost", marks=thorough),
        pytest.param("dense-sequence-materialised", marks=thorough),
        pytest.param("conv-same", marks=thorough),
        "conv-gram",
        "embedding",
        pytest.param("fallback-normalisations", marks=pytest.mark.slow),  # 7 s
        "fallback-grouped-conv-row-loop",
        pytest.param("nested-dense-after-masked-embedding", marks=thorough),
        *[
            pytest.param(name, marks=pytest.mark.slow)
            if "recurrent" in name  # 10 s
            else name
            if name == "nested-functional-chain"
            else pytest.param(name, marks=thorough)
            for name in NESTED
        ],
    ],
)
def test_bam_ascent_is_per_example(name, rng):
    """BAM's clipped sum equals the slow loop that moves the weights to each row's own
    ascent point, for every ghost rule (both branches) and for the fallback layers."""
    from lipdp.clipped.model import SharpnessAscent

    radius, clip = 0.3, 0.5
    model = _model(name, Clipping("flat", clip))
    bam = DPSGD_Sequential(
        NETS[name][0](),
        dp_parameters=model.dp_parameters,
        clipping=Clipping("flat", clip),
        dataset_metadata=model.dataset_metadata,
        ascent=SharpnessAscent("bam", radius),
    )
    bam.compile(loss=model.loss, optimizer="sgd")
    x, y = _data(name, rng)
    expected = _naive_bam_sum(bam, x, y, radius, clip)
    plain, _, _ = model.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    summed, _, _ = bam.clipped_gradient_sum(tf.constant(x), tf.constant(y))
    for ours, reference in zip(summed, expected):
        np.testing.assert_allclose(ours.numpy(), reference, rtol=5e-4, atol=3e-6)
    moved = max(np.max(np.abs(a.numpy() - b.numpy())) for a, b in zip(plain, summed))
    assert moved > 1e-4  # the ascent changes the gradients: the check is not vacuous
