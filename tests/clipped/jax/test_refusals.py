"""What the JAX step cannot bound is refused in one line naming the fix."""

import importlib

import keras
import numpy as np
import pytest
from keras import ops

import lipdp
from lipdp.clipped.clipping import Clipping
from lipdp.clipped.jax.model import DPSGD_JaxModel
from lipdp.core.parameters import DPParameters
from lipdp.foundation.metadata import DatasetMetadata
from tests.clipped.jax import helpers as h
from tests.marks import representatives


def _with(*layers):
    return keras.Sequential([keras.Input((h.FEATURES,)), *layers, keras.layers.Dense(h.CLASSES)])


def test_a_trainable_batch_normalization_is_refused_and_a_frozen_one_trains():
    with pytest.raises(ValueError, match="BatchNormalization. normalises with batch statistics"):
        h.private(_with(keras.layers.BatchNormalization()))
    frozen = keras.layers.BatchNormalization()
    frozen.trainable = False
    model = h.private(_with(keras.layers.Dense(4), frozen))
    x, y = h.data(16)
    model.train_on_batch(x, y, sample_weight=np.ones(16, np.float32))
    assert int(model.noisy_steps.numpy()) == 1
    frozen.trainable = True  # unfrozen after construction: the walk runs before every fit
    with pytest.raises(ValueError, match="normalises with batch statistics in training"):
        model.train_on_batch(x, y, sample_weight=np.ones(16, np.float32))
    assert int(model.noisy_steps.numpy()) == 1


def test_a_layer_updating_state_in_training_is_refused_at_the_first_step():
    model = h.private(_with(keras.layers.Dropout(0.5)))
    x, y = h.data(16)
    with pytest.raises(ValueError, match="training call updates .*seed.*shared between rows"):
        model.train_on_batch(x, y, sample_weight=np.ones(16, np.float32))
    assert int(model.noisy_steps.numpy()) == 0


def test_regularisers_are_refused():
    with pytest.raises(ValueError, match="has a regularizer"):
        h.private(_with(keras.layers.Dense(4, kernel_regularizer="l2")))
    with pytest.raises(ValueError, match="has an activity regulariser: a loss computed"):
        h.private(_with(keras.layers.Dense(4, activity_regularizer="l2")))


# The layers the TensorFlow models refuse, refused on JAX by the same walk with the same
# messages (lipdp.clipped.layer_support.check_keras_layers). Before, JAX had its own copy.
class SyncBatchNormalization(keras.layers.Layer):
    """Another package's synchronised batch normalisation (not a subclass of Keras'):
    batch statistics in training, and moving statistics updated from the batch."""

    def build(self, shape):
        self.moving_mean = self.add_weight(shape=shape[-1:], initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.moving_mean.assign(0.9 * self.moving_mean.value + 0.1 * ops.mean(x, axis=0))
            return x - ops.mean(x, axis=0)
        return x - self.moving_mean.value


class BatchNormalizationV1(keras.layers.Layer):
    """A copy of Keras 2's v1 class (batch statistics in training), without state."""

    def call(self, x, training=None):
        return x - ops.mean(x, axis=0) if training else x

    def compute_output_shape(self, shape):
        return shape


class DeclaredCoupling(keras.layers.Layer):
    """A user's layer declaring that it mixes the examples of a batch."""

    couples_examples = True

    def call(self, x):
        return x - ops.mean(x, axis=0)

    def compute_output_shape(self, shape):
        return shape


def _rnn(stateful):
    return keras.Sequential(
        [keras.Input((4, h.FEATURES), batch_size=8), keras.layers.SimpleRNN(4, stateful=stateful),
         keras.layers.Dense(h.CLASSES)]
    )  # fmt: skip


DRIFTS = {
    # name: (network, what the TensorFlow walk says)
    "sync-batch-normalization": (
        lambda: _with(keras.layers.Dense(4), SyncBatchNormalization(name="sync")),
        r"'sequential\w*/sync' \(SyncBatchNormalization\) normalises with batch statistics.*"
        "fix_batch_coupling",
    ),
    "batch-normalization-v1": (
        lambda: _with(keras.layers.Dense(4), BatchNormalizationV1(name="v1")),
        r"\(BatchNormalizationV1\) normalises with batch statistics in training",
    ),
    "couples-examples": (
        lambda: _with(keras.layers.Dense(4), DeclaredCoupling(name="mine")),
        r"'sequential\w*/mine' \(DeclaredCoupling\) declares couples_examples = True.*"
        "per_example_replacement",
    ),
    "stateful-rnn": (lambda: _rnn(True), r"\(SimpleRNN\) is stateful: .* Use stateful=False"),
    "spectral-normalization": (
        lambda: _with(keras.layers.SpectralNormalization(keras.layers.Dense(4))),
        r"\(SpectralNormalization\) rewrites its kernel in every training call",
    ),
}


@pytest.mark.parametrize(
    "name", representatives(DRIFTS, default={"sync-batch-normalization", "couples-examples"})
)
def test_the_layers_the_tensorflow_models_refuse_are_refused_at_construction(name):
    """Before (JAX's own copy of the walk): ``couples-examples`` and
    ``batch-normalization-v1`` trained silently (their statistics over a batch of one);
    ``sync-batch-normalization`` and ``spectral-normalization`` were refused only at the
    first step, by the generic message of a state update; ``stateful-rnn`` failed at the
    first step inside Keras (initial state of 8 rows, a batch of 1)."""
    build, message = DRIFTS[name]
    with pytest.raises(ValueError, match=message):
        h.private(build())


def test_options_of_the_tensorflow_backend_only_are_refused():
    metadata = DatasetMetadata(input_shape=(h.FEATURES,), nb_classes=3, nb_samples_train=32)
    with pytest.raises(ValueError, match="per-layer clipping runs on KERAS_BACKEND=tensorflow"):
        DPSGD_JaxModel(h.mlp(), dp_parameters=DPParameters("global", 1.0, 1e-5),
                       clipping=Clipping("per-layer"), dataset_metadata=metadata)  # fmt: skip
    with pytest.raises(ValueError, match="noisify_strategy='global'"):
        DPSGD_JaxModel(h.mlp(), dp_parameters=DPParameters("per-layer", 1.0, 1e-5),
                       dataset_metadata=metadata)  # fmt: skip
    # The clipless family trains on JAX (lipdp.clipless.jax.trainer): ordinary layers are
    # refused as on TensorFlow (first: no input bound).
    with pytest.raises(ValueError, match="needs a public bound on the inputs' norm"):
        lipdp.make_private(h.mlp(), epsilon=1.0, delta=1e-5, epochs=1, batch_size=8,
                           dataset_size=32, method="clipless")  # fmt: skip


@pytest.mark.parametrize("module", ["lipdp.clipped.model", "lipdp.core.private_model"])
def test_tensorflow_programs_refuse_the_jax_backend_naming_the_fix(module):
    with pytest.raises(ImportError, match="Fix: set KERAS_BACKEND=tensorflow before importing"):
        importlib.import_module(module)


def test_the_clipless_model_takes_the_jax_trainer():
    from lipdp.clipless.model import DP_Model
    from lipdp.core.jax.trainer import JaxPrivateTrainer

    assert issubclass(DP_Model, JaxPrivateTrainer)


def test_fixed_size_batches_must_have_the_declared_size():
    model = h.private(h.mlp(), sampling="shuffle", batch_size=8, n=32)
    x, y = h.data(32)
    with pytest.raises(ValueError, match="not a multiple of batch_size=8: the last batch"):
        h.private(h.mlp(), sampling="shuffle", batch_size=8, n=30).fit(x[:30], y[:30], verbose=0)
    with pytest.raises(ValueError, match="declares nb_samples_train=32"):
        model.fit(x[:24], y[:24], epochs=1, verbose=0)
    with pytest.raises(ValueError, match="fit\\(batch_size=16\\) differs"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="exactly 8 rows"):
        model.train_on_batch(x[:7], y[:7])
    history = model.fit(x, y, epochs=1, verbose=0)  # 4 full batches of 8
    assert int(model.noisy_steps.numpy()) == 4 and history.history["loss"]
    assert set(model.evaluate(x, y, verbose=0, return_dict=True)) >= {"loss", "accuracy"}


def test_poisson_models_take_poisson_batches_only():
    model = h.private(h.mlp(), batch_size=8, n=32)
    x, y = h.data(32)

    class Batches(keras.utils.PyDataset):  # batches whose sampling lipdp cannot know
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return x[:8], y[:8]

    with pytest.raises(
        ValueError, match="needs Poisson-sampled batches: pass the arrays themselves, fit"
    ):
        model.fit(Batches(), epochs=1, verbose=0)
    assert int(model.noisy_steps.numpy()) == 0
    with pytest.raises(ValueError, match="sample_weight is not supported"):
        model.fit(lipdp.private_batches(model, x, y), sample_weight=np.ones(32), verbose=0)


def test_mixed_precision_is_refused():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        with pytest.raises(ValueError, match="Mixed precision is not supported"):
            h.private(h.mlp())
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_private_model_and_a_model_of_several_inputs_are_refused_by_make_private():
    budget = dict(epsilon=1.0, delta=1e-5, epochs=1, batch_size=8, dataset_size=32)
    private = lipdp.make_private(h.mlp(), **budget)
    with pytest.raises(ValueError, match="is already private .*compile and fit it") as error:
        lipdp.make_private(private, **budget)
    assert "\n" not in str(error.value)
    values, extra = keras.Input((h.FEATURES,)), keras.Input((2,))
    outputs = keras.layers.Dense(h.CLASSES)(keras.layers.Concatenate()([values, extra]))
    with pytest.raises(ValueError, match="several inputs: the JAX backend trains models of one"):
        lipdp.make_private(keras.Model([values, extra], outputs), **budget)


def test_fix_batch_coupling_runs_on_jax_and_its_copy_trains():
    """``lipdp.fix_batch_coupling`` (:mod:`lipdp.core.coupling_fix`, no TensorFlow) on a
    JAX network: the trainable BatchNormalization becomes a GroupNormalization with its
    gamma, and the copy trains."""
    bn = keras.layers.BatchNormalization(name="bn", gamma_initializer="ones")
    network = _with(keras.layers.Dense(16), bn)
    bn.gamma.assign(np.arange(16, dtype=np.float32))
    fixed, report = lipdp.fix_batch_coupling(network)
    assert report.complete and [r.new_class for r in report.replaced] == ["GroupNormalization"]
    group = next(layer for layer in fixed.layers if layer.name == "bn_gn")
    np.testing.assert_array_equal(group.gamma.numpy(), np.arange(16, dtype=np.float32))
    model = h.private(fixed)
    x, y = h.data(16)
    model.train_on_batch(x, y, sample_weight=np.ones(16, np.float32))
    assert int(model.noisy_steps.numpy()) == 1
