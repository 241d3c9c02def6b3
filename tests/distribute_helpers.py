"""Models, data and a recording optimizer shared by tests/core/test_distribute.py and the
worker processes of its multi-worker tests (tests/distribute_worker.py)."""

import numpy as np
import tensorflow as tf

from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.clipped.model import Clipping, DPSGD_Sequential
from lipdp.foundation import compat
from lipdp.foundation.metadata import DatasetMetadata

FEATURES, CLASSES, N = 6, 3, 64
FAMILIES = ("clipless", "dp-sgd")


def data(zero_inputs=False):
    """``N`` rows, seeded; ``zero_inputs``: all-zero inputs, so that every gradient of the
    bias-free models below is exactly 0 and a released gradient is pure noise."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    if zero_inputs:
        x = np.zeros_like(x)
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, N)]
    return x, y


def metadata(batch_size, sampling="shuffle"):
    return DatasetMetadata(
        input_shape=(FEATURES,),
        nb_classes=CLASSES,
        nb_samples_train=N,
        batch_size=batch_size,
        sampling=sampling,
    )


def build(
    family,
    sigma,
    batch_size,
    sampling="shuffle",
    optimizer=None,
    jit_compile=False,
    steps_per_execution=1,
    **kw,
):
    """A small bias-free model of ``family``, compiled; ``sigma = 0``: non-private; ``kw``:
    options of the model (``adversarial``; DP-SGD's ``ascent``, ``gradient_method``). Its
    initial weights depend only on the Keras seed (set it before calling)."""
    params = DPParameters("global", sigma, 1e-5, non_private=sigma == 0)
    meta = metadata(batch_size, sampling)
    optimizer = optimizer or tf.keras.optimizers.SGD(0.5)
    if family == "clipless":
        model = DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=2.0),
                L.DP_SpectralDense(32),
                L.DP_GroupSort(2),
                L.DP_SpectralDense(CLASSES),
                L.DP_ClipGradient(0.2),  # clips each row's cotangent at 0.2 / n
            ],
            dp_parameters=params,
            dataset_metadata=meta,
            **kw,
        )
        model.compile(
            loss=losses.DP_TauCategoricalCrossentropy(4.0),
            optimizer=optimizer,
            jit_compile=jit_compile,
            steps_per_execution=steps_per_execution,
        )
        return model
    model = DPSGD_Sequential(
        [
            tf.keras.layers.Dense(32, activation="tanh", use_bias=False, input_shape=(FEATURES,)),
            tf.keras.layers.Dense(CLASSES, use_bias=False),
        ],
        dp_parameters=params,
        clipping=Clipping("flat", 0.5),
        dataset_metadata=meta,
        **kw,
    )
    model.compile(
        loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True),
        optimizer=optimizer,
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


class RecordingSGD(tf.keras.optimizers.SGD):
    """SGD with learning rate 0 (the weights stay) that accumulates, per variable, the sum
    and the sum of squares of the gradients it applies -- the released, summed gradients
    (Keras 2: those it is given; Keras 3: those its all-reduce returns) -- and the number
    of steps. Call :meth:`start` in the strategy's scope before training."""

    def __init__(self):
        super().__init__(learning_rate=0.0)

    def start(self, variables):
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA  # assigned in replica context

        def zeros(shape=()):
            return tf.Variable(tf.zeros(shape), trainable=False, aggregation=first)

        self.sums = [zeros(v.shape) for v in variables]
        self.squares = [zeros(v.shape) for v in variables]
        self.steps = zeros()

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not compat.keras_3():  # Keras 2's apply_gradients receives the summed gradients
            self._record(grads_and_vars)
        return super().apply_gradients(grads_and_vars, *args, **kwargs)

    def _all_reduce_sum_gradients(self, grads_and_vars):
        """Keras 3's optimizers sum the replicas' gradients here, in replica context (identity
        without a strategy); what follows applies the sum."""
        summed = super()._all_reduce_sum_gradients(grads_and_vars)
        if compat.keras_3():
            self._record(summed)
        return summed

    def _record(self, grads_and_vars):
        for total, squares, (g, _) in zip(self.sums, self.squares, grads_and_vars):
            total.assign_add(g)
            squares.assign_add(tf.square(g))
        self.steps.assign_add(1.0)

    def noise_statistics(self):
        """``(mean, std)`` over every coordinate and step (the noise has mean 0)."""
        steps = float(self.steps.numpy())
        sums = np.concatenate([s.numpy().ravel() for s in self.sums])
        squares = np.concatenate([s.numpy().ravel() for s in self.squares])
        count = steps * sums.size
        return float(sums.sum() / count), float(np.sqrt(squares.sum() / count))


def expected_stddev(model):
    """The one standard deviation of the global noise rule (all variables equal)."""
    values = {float(s) for s in model.noise_stddevs().values()}
    assert len(values) == 1
    return values.pop()


def flat_weights(model):
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


def replica_copies(strategy, variable):
    """Every replica's copy of ``variable`` under ``strategy``, as arrays (a Keras 3
    variable holds the distributed ``tf.Variable`` as its value)."""
    copies = strategy.experimental_local_results(compat.tape_variable(variable))
    return [np.asarray(c.numpy()) for c in copies]
