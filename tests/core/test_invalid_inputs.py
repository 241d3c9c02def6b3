"""Rule S9 for token ids: a record whose input holds an id outside the range of the layer
reading it (``10`` or ``-1`` for ``Embedding(10, ...)``, ``2**31 - 1``, ``2.5``) counts
zero in the step, instead of making the whole step fail (the CPU's embedding lookup and
``CategoryEncoding`` raise on it), which would reveal that it was sampled. The training
logs count such rows (``invalid_inputs``); ``fit`` on arrays refuses them, naming the
rows. The range comes from the layers reading the model's input
(:func:`lipdp.core.records.input_id_ranges`).

The released-gradient tests are the remove-one check of ``tests/remove_one.py`` with an
exact target: one real noisy step on a batch with such rows releases what the same step
(identical noise) releases on the batch without them.
"""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless.model import DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.core.records import ids_in_range, input_id_ranges
from lipdp.foundation.metadata import DatasetMetadata
from tests.remove_one import released_gradient

K = tf.keras.layers
T, VOCABULARY, CLASSES, B = 4, 10, 3, 8
#: Rows of the batch given one id out of range (values in BAD_IDS).
BAD_ROWS = [1, 4, 6]
BAD_IDS = [VOCABULARY, -1, 2**31 - 1]


# ------------------------------------------------------------------------ the row test
def rows_usable(ids, size=VOCABULARY):
    return ids_in_range(tf.constant(ids), size).numpy().tolist()


def test_ids_in_range_are_whole_numbers_below_the_size():
    assert rows_usable([[0, 9], [10, 0], [-1, 3], [2**31 - 1, 1]]) == [True, False, False, False]
    assert rows_usable(np.array([[255], [9]], np.uint8)) == [False, True]
    assert rows_usable(np.array([[2**40], [3]], np.int64)) == [False, True]
    floats = np.array([[3.0], [2.5], [np.nan], [-0.5], [1e30], [9.0]], np.float32)
    assert rows_usable(floats) == [True, False, False, False, False, True]
    assert rows_usable(np.zeros((2, 3, 2), np.int32)) == [True, True]  # any rank
    assert rows_usable([[True], [False]], size=1) == [True, True]  # not ids


# ----------------------------------------------------------------- where ranges come from
def ranges_of(layers):
    return [None if r is None else (r.size, r.reader) for r in input_id_ranges(layers)]


def test_the_range_is_the_one_of_the_layer_reading_the_input():
    assert ranges_of([K.Embedding(10, 4), K.Flatten(), K.Dense(3)]) == [(10, "embedding")]
    assert ranges_of([K.CategoryEncoding(6, name="bag"), K.Dense(3)]) == [(6, "bag")]
    # Through layers that only move the values.
    moved = [K.Reshape((4,)), K.Embedding(7, 2, name="tokens"), K.Flatten()]
    assert ranges_of(moved) == [(7, "tokens")]
    # Floats are values; ids computed by the model (hashed) are its own.
    assert ranges_of([K.Dense(3)]) == [None]
    assert ranges_of([K.Hashing(5), K.Embedding(5, 2)]) == [None]


def test_the_range_is_found_inside_nested_models():
    inner = tf.keras.Sequential([K.Embedding(12, 2, name="emb")], name="inner")
    assert ranges_of([inner, K.Flatten()]) == [(12, "inner/emb")]
    built = tf.keras.Sequential([K.Reshape((4,)), K.Embedding(9, 2, name="emb")], name="backbone")
    built.build((None, 4, 1))
    assert ranges_of([built]) == [(9, "backbone/emb")]
    # A functional graph reading its input twice: the narrowest range.
    ids = tf.keras.Input((4,), dtype="int32")
    branches = [K.Flatten()(K.Embedding(10, 2)(ids)), K.CategoryEncoding(6, name="bag")(ids)]
    two = tf.keras.Model(ids, K.Concatenate()(branches), name="two")
    assert ranges_of([two, K.Dense(3)]) == [(6, "two/bag")]
    # Several inputs: one range each, in the flattened order of the inputs.
    tokens, values = tf.keras.Input((4,), dtype="int32"), tf.keras.Input((2,))
    joined = K.Concatenate()([K.Flatten()(K.Embedding(11, 2, name="e")(tokens)), values])
    both = tf.keras.Model([tokens, values], joined, name="both")
    assert ranges_of([both, K.Dense(3)]) == [(11, "both/e"), None]


# --------------------------------------------------------------------------- models
def metadata(sampling="poisson", n=64):
    return DatasetMetadata(
        input_shape=(T,), nb_classes=CLASSES, nb_samples_train=n, batch_size=B, sampling=sampling
    )


def id_reader(kind):
    if kind == "embedding":
        return [K.Embedding(VOCABULARY, 4, input_shape=(T,)), K.Flatten()]
    return [K.CategoryEncoding(VOCABULARY, output_mode="count", input_shape=(T,))]


def model_of(kind="embedding", method="ghost", sampling="poisson", float_ids=False):
    model = DPSGD_Sequential(
        [*id_reader(kind), K.Dense(CLASSES)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        clipping=Clipping("flat", 0.5),
        dataset_metadata=metadata(sampling),
        gradient_method=method,
        # The batch-independence probe draws float inputs from a normal law, which an
        # Embedding cannot read (lipdp.core.batch_independence._random_values).
        independence_probe=not float_ids,
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    return model


def batch(rng, n=B, dtype="int32"):
    x = rng.integers(0, VOCABULARY, (n, T)).astype(dtype)
    return x, rng.integers(0, CLASSES, n).astype("int32")


def with_bad_ids(x, ids=BAD_IDS):
    bad = x.copy()
    bad[BAD_ROWS, 1] = ids
    return bad


# ------------------------------------------------------------------- the released step
@pytest.mark.parametrize(
    "kind, method, dtype",
    [
        ("embedding", "ghost", "int32"),
        pytest.param("embedding", "jacobian", "int32", marks=pytest.mark.slow),  # 10 s
        pytest.param("embedding", "ghost", "float32", marks=pytest.mark.slow),  # 7 s
        ("category-encoding", "ghost", "int32"),
    ],
)
def test_the_step_releases_the_gradient_without_out_of_range_ids(kind, method, dtype, rng):
    """The step on a batch with bad ids runs and releases what the step on the batch
    without those rows releases (identical noise); giving the same rows id 0 instead
    releases something else (the rows would have counted)."""
    model = model_of(kind, method, float_ids=dtype == "float32")
    x, y = batch(rng, dtype=dtype)
    ids = BAD_IDS if dtype == "int32" else [VOCABULARY, -1, 2.5]
    x_bad = with_bad_ids(x, ids)
    keep = np.setdiff1d(np.arange(B), BAD_ROWS)
    released = released_gradient(model, x_bad, y)
    without = released_gradient(model, x_bad[keep], y[keep])
    for a, b in zip(released, without):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    repaired = x_bad.copy()
    repaired[BAD_ROWS, 1] = 0
    counted = released_gradient(model, repaired, y)
    assert max(np.abs(a - b).max() for a, b in zip(counted, released)) > 1e-4


# ------------------------------------------------------------------------- the logs
def test_pipelines_count_invalid_inputs_once_per_row(rng):
    """Two rows with ids out of range, one of them with a label out of range too (counted
    once, as an invalid input), one more with a bad label only, per epoch."""
    model = model_of(sampling="shuffle")
    x, y = batch(rng, n=64)
    x[[3, 20], 0] = [VOCABULARY, -5]
    y[[20, 41]] = CLASSES
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    history = model.fit(data, epochs=2, verbose=0)
    assert history.history["invalid_inputs"] == [2.0, 2.0]
    assert history.history["invalid_labels"] == [1.0, 1.0]
    assert history.history["non_finite_examples"] == [0.0, 0.0]
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def test_models_reading_no_ids_do_not_log_them(rng):
    model = DPSGD_Sequential(
        [K.Dense(CLASSES, input_shape=(T,))],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=metadata("shuffle"),
    )
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.normal(size=(64, T)).astype("float32") * 100.0  # values, never ids
    history = model.fit(x, batch(rng, n=64)[1], batch_size=B, verbose=0)
    assert "invalid_inputs" not in history.history


# ---------------------------------------------------------------------- fit on arrays
def test_fit_on_arrays_refuses_out_of_range_ids_naming_the_rows(rng):
    x, y = batch(rng, n=64)
    x[5, 2], x[40, 0] = VOCABULARY, -1
    with pytest.raises(
        ValueError,
        match=r"^x has 2 example\(s\) with a token id that is not a whole number in \[0, 10\) "
        r"\(rows 5, 40\): layer 'embedding' reads ids in that range\. Remove or repair these "
        r"rows before fit\.$",
    ):
        model_of(sampling="shuffle").fit(x, y, batch_size=B, verbose=0)
    x[5, 2], x[40, 0] = 0, 0
    history = model_of(sampling="shuffle").fit(x, y, batch_size=B, verbose=0)
    assert history.history["invalid_inputs"] == [0.0]


def test_several_inputs_are_matched_as_the_first_layer_matches_them(rng):
    """A functional first layer with inputs ``[tokens, values]`` fed a dict whose sorted
    keys put the float values first (as ``tf.nest.flatten`` would): the ids are still
    read from the tokens (by name, as Keras matches them), the float values never."""
    tokens = tf.keras.Input((T,), dtype="int32", name="z_tokens")
    values = tf.keras.Input((2,), name="a_values")
    embedded = K.Flatten()(K.Embedding(VOCABULARY, 2)(tokens))
    both = tf.keras.Model([tokens, values], K.Concatenate()([embedded, values]), name="both")
    model = DPSGD_Sequential(
        [both, K.Dense(CLASSES)],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=metadata(),
        gradient_method="jacobian",  # ghost norms run a multi-input model on one tensor
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(0.1),
    )
    ids, y = batch(rng)
    x = {"z_tokens": with_bad_ids(ids), "a_values": 50.0 * rng.normal(size=(B, 2))}
    x["a_values"] = x["a_values"].astype("float32")  # values far outside any id range
    logs = model.train_on_batch(x, y, return_dict=True)
    assert logs["invalid_inputs"] == len(BAD_ROWS)
    keep = np.setdiff1d(np.arange(B), BAD_ROWS)
    released = released_gradient(model, x, y)
    without = released_gradient(model, {k: v[keep] for k, v in x.items()}, y[keep])
    for a, b in zip(released, without):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
