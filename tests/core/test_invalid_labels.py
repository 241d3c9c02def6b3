"""Rule S9 for class labels: a record whose class-index label is out of range (``K`` or
``-1`` with ``K`` classes, ``2.5``) counts zero in the step, like a record with a NaN,
instead of making the whole step fail (TensorFlow's sparse cross-entropy raises on it),
which would reveal that it was sampled. The training logs count such rows
(``invalid_labels``); ``fit`` on arrays refuses them, naming the rows.

The released-gradient tests are the remove-one check of ``tests/remove_one.py`` with an
exact target: one real noisy step on a batch with such rows releases what the same step
(identical noise) releases on the batch without them.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.clipped.model import DPSGD_Sequential
from lipdp.core.adversarial import PGD
from lipdp.core.records import labels_in_range, sparse_labels
from lipdp.foundation.metadata import DatasetMetadata
from tests.marks import thorough
from tests.remove_one import released_gradient

D, K, B = 5, 3, 8
#: Rows of the batch whose labels are made invalid (values in BAD_LABELS).
BAD_ROWS = [1, 4, 6]
BAD_LABELS = [K, -1, 2.5]


# ----------------------------------------------------------------------- the row test
def rows_usable(labels, predictions_shape, ignore_class=None):
    return labels_in_range(labels, tf.zeros(predictions_shape), ignore_class).numpy().tolist()


def test_labels_in_range_from_shapes_and_values():
    # Class indices (rank one less, or trailing 1): whole numbers in [0, K).
    assert rows_usable(tf.constant([0, 2, 3, -1]), (1, 3)) == [True, True, False, False]
    assert rows_usable(tf.constant([[0], [2], [3], [-1]]), (1, 3)) == [True, True, False, False]
    floats = tf.constant([0.0, 2.0, 2.5, np.nan, np.inf, -0.5, 1.0])
    assert rows_usable(floats, (1, 3)) == [True, True, False, False, False, False, True]
    assert rows_usable(tf.constant([255, 0], tf.uint8), (1, 300)) == [True, True]
    # A sequence of indices per example: every entry must be in range.
    sequences = tf.constant([[0, 1, 2], [0, 3, 1]])
    assert rows_usable(sequences, (1, 3, K)) == [True, False]
    assert rows_usable(tf.constant([-1, -2, 1]), (1, 3), ignore_class=-1) == [True, False, True]
    # Not class indices: one-hot (or any) labels of the predictions' shape, the values of
    # a single output (binary or regression targets, (b,) for (b, 1)), booleans.
    assert rows_usable(tf.constant([[7.0, -1.0, 0.0]]), (1, 3)) == [True]
    assert rows_usable(tf.constant([0.3, 5.0, -2.0]), (1, 1)) == [True, True, True]
    assert rows_usable(tf.constant([[5.0]]), (1, 1)) == [True]
    assert not sparse_labels(tf.constant([True]), tf.zeros((1, 3)))


def test_labels_in_range_reads_the_classes_at_run_time():
    """Predictions whose last dimension is unknown when traced: K is read in-graph (K = 1:
    targets, never indices)."""

    @tf.function(input_signature=[tf.TensorSpec([None]), tf.TensorSpec([None, None])])
    def usable(labels, predictions):
        return labels_in_range(labels, predictions)

    labels = tf.constant([0.0, 1.0, 2.0, 3.0])
    assert usable(labels, tf.zeros((1, 3))).numpy().tolist() == [True, True, True, False]
    assert usable(labels, tf.zeros((1, 1))).numpy().tolist() == [True] * 4


# --------------------------------------------------------------------------- models
class SparseTauCrossentropy(losses.DP_Loss):
    """A user's DP loss on class indices: ``CE(onehot(y), softmax(tau z)) / tau``, whose
    gradient ``softmax(tau z) - onehot(y)`` has norm <= sqrt(2)."""

    def __init__(self, tau=4.0, **kwargs):
        self.tau = tau
        super().__init__(**kwargs)

    def per_example_loss(self, y_true, y_pred):
        labels = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
        logits = self.tau * y_pred
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits) / self.tau

    def get_L(self):
        return math.sqrt(2.0)


class LipschitzSparseCrossentropy(tf.keras.losses.SparseCategoricalCrossentropy):
    """Keras' sparse cross-entropy on logits with its Lipschitz constant stated (the
    gradient wrt the logits, ``softmax(z) - onehot(y)``, has norm <= sqrt(2))."""

    def __init__(self, **kwargs):
        super().__init__(from_logits=True, **kwargs)

    def get_L(self):
        return math.sqrt(2.0)


def metadata(sampling="poisson", n=64):
    return DatasetMetadata(
        input_shape=(D,), nb_classes=K, nb_samples_train=n, batch_size=B, sampling=sampling
    )


def clipless(loss, sampling="poisson", sigma=1.0):
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0),
            L.DP_QuickSpectralDense(6),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(K),
        ],
        dp_parameters=DPParameters("global", sigma, 1e-5),
        dataset_metadata=metadata(sampling),
    )
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1), metrics=["accuracy"])
    return model


def clipped(loss=None, sampling="poisson", method="ghost", sigma=1.0):
    model = DPSGD_Sequential(
        [
            tf.keras.layers.Dense(6, activation="tanh", input_shape=(D,)),
            tf.keras.layers.Dense(K),
        ],
        dp_parameters=DPParameters("global", sigma, 1e-5),
        dataset_metadata=metadata(sampling),
        gradient_method=method,
    )
    loss = loss or tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1), metrics=["accuracy"])
    return model


def batch(rng, n=B, column=False, dtype="int32"):
    x = rng.normal(size=(n, D)).astype("float32")
    y = rng.integers(0, K, size=n).astype(dtype)
    return x, (y[:, None] if column else y)


def with_bad_labels(y, labels=BAD_LABELS):
    bad = y.astype("float32") if any(v != int(v) for v in labels) else y.copy()
    for row, label in zip(BAD_ROWS, labels):
        bad[row] = label
    return bad


def assert_released_as_without_the_bad_rows(model, x, y_bad, labels=BAD_LABELS):
    """The step on the batch with bad labels runs and releases what the step on the batch
    without those rows releases (identical noise); giving the same rows class 0 instead
    releases something else (the rows would have counted)."""
    keep = np.setdiff1d(np.arange(len(x)), BAD_ROWS)
    released = released_gradient(model, x, y_bad)
    without = released_gradient(model, x[keep], y_bad[keep])
    for a, b in zip(released, without):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    relabelled = y_bad.copy()
    relabelled[BAD_ROWS] = 0
    counted = released_gradient(model, x, relabelled)
    assert max(np.abs(a - b).max() for a, b in zip(counted, released)) > 1e-4


# ------------------------------------------------------------------- the released step
#: Adversarial training (its attack ascends each row's own loss): no random start, so
#: that the kept rows' attacks are the same with and without the bad rows.
ATTACK = PGD(0.2, steps=2, random_start=False, mix=0.5)


@pytest.mark.parametrize(
    "method, column, dtype, adversarial",
    [
        ("ghost", False, "int32", None),
        pytest.param("ghost", True, "float32", None, marks=thorough),
        ("jacobian", False, "float32", None),
        pytest.param("ghost", False, "float32", ATTACK, marks=thorough),  # 11 s
    ],
    ids=["ghost-int", "ghost-float-column", "jacobian-float", "ghost-adversarial"],
)
def test_clipped_step_releases_the_gradient_without_out_of_range_rows(
    method, column, dtype, adversarial, rng
):
    x, y = batch(rng, column=column, dtype=dtype)
    labels = BAD_LABELS if dtype == "float32" else [K, -1, K + 7]
    model = clipped(method=method)
    model.adversarial = adversarial
    assert_released_as_without_the_bad_rows(model, x, with_bad_labels(y, labels), labels)


@pytest.mark.parametrize(
    "loss, adversarial",
    [
        pytest.param(SparseTauCrossentropy(), None, marks=pytest.mark.slow),  # 9 s
        (LipschitzSparseCrossentropy(), None),
        pytest.param(LipschitzSparseCrossentropy(), ATTACK, marks=pytest.mark.slow),  # 13 s
    ],
    ids=["dp_loss_subclass", "keras_sparse_crossentropy", "adversarial"],
)
def test_clipless_step_releases_the_gradient_without_out_of_range_rows(loss, adversarial, rng):
    """The clipless family accepts any loss with get_L(): lipdp's own losses take labels of
    the predictions' shape (class indices are refused when the step is traced), a user's
    loss may take indices, through DP_Loss or as a Keras loss."""
    x, y = batch(rng, dtype="float32")
    model = clipless(loss)
    model.adversarial = adversarial
    assert_released_as_without_the_bad_rows(model, x, with_bad_labels(y))


def test_lipdp_losses_refuse_class_indices_when_traced(rng):
    model = clipless(losses.DP_TauCategoricalCrossentropy(4.0))
    x, y = batch(rng)
    with pytest.raises(ValueError, match="y_true and y_pred must have the same shape"):
        model.train_on_batch(x, y)


# ------------------------------------------------------------------------ the logs
@pytest.mark.parametrize("family", ["clipless", pytest.param("clipped", marks=thorough)])
def test_pipelines_count_invalid_labels_once_per_row(family, rng):
    """Three rows with labels out of range, one with a NaN input and a bad label (counted
    once, as non-finite), per epoch; training keeps finite weights."""
    if family == "clipless":
        model = clipless(LipschitzSparseCrossentropy(), sampling="shuffle")
    else:
        model = clipped(sampling="shuffle")
    x, y = batch(rng, n=64, dtype="float32")
    y[[3, 20, 41]] = [K, -1, 0.5]
    x[50, 0], y[50] = np.nan, K
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    history = model.fit(data, epochs=2, verbose=0)
    assert history.history["invalid_labels"] == [3.0, 3.0]
    assert history.history["non_finite_examples"] == [1.0, 1.0]
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
    assert all(math.isfinite(value) for value in history.history["loss"])


# ---------------------------------------------------------------------- fit on arrays
@pytest.mark.parametrize("family", ["clipless", "clipped"])
def test_fit_on_arrays_refuses_out_of_range_labels_naming_the_rows(family, rng):
    def model_for(loss=None):
        if family == "clipless":
            return clipless(loss or LipschitzSparseCrossentropy(), sampling="shuffle")
        return clipped(loss, sampling="shuffle")

    x, y = batch(rng, n=64)
    y[5], y[40] = K, -1
    with pytest.raises(
        ValueError,
        match=r"^y has 2 example\(s\) whose class label is not a whole number in \[0, 3\) "
        r"\(rows 5, 40\): the model has 3 outputs\. Remove or repair these rows before fit\.$",
    ):
        model_for().fit(x, y, batch_size=B, epochs=1, verbose=0)
    x, y = batch(rng, n=64, column=True, dtype="float32")
    y[12] = 1.5
    with pytest.raises(ValueError, match=r"y has 1 example\(s\).*\(rows 12\)"):
        model_for().fit(x, y, batch_size=B, epochs=1, verbose=0)
    # Labels the loss itself ignores are not out of range.
    y[12] = -1
    history = model_for(LipschitzSparseCrossentropy(ignore_class=-1)).fit(
        x, y, batch_size=B, epochs=1, verbose=0
    )
    assert history.history["invalid_labels"] == [0.0]


def test_fit_on_arrays_accepts_targets_of_one_output(rng):
    """Labels of a single output are values, not class indices: never refused."""
    model = DPSGD_Sequential(
        [tf.keras.layers.Dense(1, input_shape=(D,))],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=DatasetMetadata(
            input_shape=(D,), nb_classes=1, nb_samples_train=64, batch_size=B
        ),
    )
    model.compile(loss=tf.keras.losses.MeanSquaredError(), optimizer="sgd")
    x = rng.normal(size=(64, D)).astype("float32")
    history = model.fit(x, 10.0 * rng.normal(size=64).astype("float32"), batch_size=B, verbose=0)
    assert history.history["invalid_labels"] == [0.0]


def test_targets_of_one_output_give_one_loss_per_row(rng):
    """Keras' MSE on predictions (rows, 1) and targets (rows,) averages over the batch
    (it squeezes the predictions): the model's per-row losses stay per row."""
    model = DPSGD_Sequential(
        [tf.keras.layers.Dense(1, input_shape=(D,))],
        dp_parameters=DPParameters("global", 1.0, 1e-5),
        dataset_metadata=DatasetMetadata(
            input_shape=(D,), nb_classes=1, nb_samples_train=64, batch_size=B
        ),
    )
    model.compile(loss=tf.keras.losses.MeanSquaredError(), optimizer="sgd")
    x = rng.normal(size=(B, D)).astype("float32")
    y = rng.normal(size=B).astype("float32")
    predictions = model(x)
    rows = model.per_example_losses(tf.constant(y), predictions)
    np.testing.assert_allclose(rows, (predictions.numpy()[:, 0] - y) ** 2, rtol=1e-5)
