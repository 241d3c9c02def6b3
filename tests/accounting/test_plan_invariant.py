"""Rule S11, end to end: the epsilon planned before ``fit`` is the epsilon reported after it.

For every configuration below (global and per-layer noise, a residual network,
augmentation multiplicity 3, Poisson sampling, a fixed DP_ClipGradient, Laplace and
quantile dynamic clipping):

* ``get_eps_delta`` and ``privacy_report`` computed *before* training for E epochs equal
  the epsilon ``DP_Accountant`` writes into the logs after E epochs, and the report made
  after training (from the model's step count);
* the dynamic-clipping callbacks make exactly the releases the plan counted;
* ``get_max_epochs(budget)`` equals the number of epochs ``DP_Accountant(epsilon_budget=
  budget)`` lets ``fit`` run.
"""

from dataclasses import replace

import numpy as np
import pytest
import tensorflow as tf

from lipdp.accounting import get_eps_delta, get_max_epochs
from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.dynamic import AdaptiveQuantileClipping, LaplaceAdaptiveLossGradientClipping
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.report import privacy_report
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.pipeline import poisson_batches

N, B, D, CLASSES, EPOCHS = 192, 32, 12, 4, 2


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, size=N)]
    return x, y


def dense_stack(nm_coef=1.0):
    return [
        L.DP_BoundedInput(input_shape=(D,), upper_bound=2.0),
        L.DP_QuickSpectralDense(16, nm_coef=nm_coef),
        L.DP_AddBias(norm_max=1.0, nm_coef=2.0 * nm_coef),
        L.DP_GroupSort(2),
        L.DP_QuickSpectralDense(CLASSES),
    ]


def residual_stack():
    return [
        L.DP_BoundedInput(input_shape=(D,), upper_bound=2.0),
        *L.make_residuals("1-lip-add", [L.DP_QuickSpectralDense(D), L.DP_GroupSort(2)]),
        *L.make_residuals("add", [L.DP_QuickSpectralDense(D), L.DP_GroupSort(2)]),
        L.DP_QuickSpectralDense(CLASSES),
    ]


def shuffled(x, y, multiplicity=0):
    """Fixed-size batches; with multiplicity m each example's m copies are contiguous."""
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=1)
    ds = ds.batch(B, drop_remainder=True)
    if multiplicity:
        ds = ds.map(lambda a, b: (tf.repeat(a, multiplicity, 0), tf.repeat(b, multiplicity, 0)))
    return ds


def configuration(name):
    """``(model, training data, extra callbacks)`` of one configuration."""
    x, y = data()
    full_pass = tf.data.Dataset.from_tensor_slices((x, y)).batch(50)
    strategy, stack, sampling, multiplicity, callbacks = "global", dense_stack(), "shuffle", 0, []
    if name == "per-layer":
        strategy, stack = "per-layer", dense_stack(nm_coef=1.5)
    elif name == "residual":
        stack = residual_stack()
    elif name == "multiplicity-3":
        multiplicity = 3
    elif name == "poisson":
        sampling = "poisson"
    elif name == "fixed-clip":
        stack = dense_stack() + [L.DP_ClipGradient(0.5)]
    elif name == "laplace-clipping":
        stack = dense_stack() + [L.DP_ClipGradient(1.0, mode="dynamic")]
        callbacks = [LaplaceAdaptiveLossGradientClipping(full_pass, epsilon=0.2, seed=0)]
    elif name == "quantile-clipping":
        stack = dense_stack() + [L.DP_ClipGradient(1.0, mode="dynamic")]
        callbacks = [
            AdaptiveQuantileClipping(full_pass, noise_multiplier=3.0, steps_per_update=2, seed=0)
        ]
    metadata = DatasetMetadata(
        input_shape=(D,),
        nb_classes=CLASSES,
        nb_samples_train=N,
        batch_size=B,
        sampling=sampling,
        multiplicity=multiplicity,
    )
    parameters = DPParameters(
        strategy, 2.0, 1e-5, dynamic_clipping=callbacks[0] if callbacks else None
    )
    model = DP_Sequential(stack, dp_parameters=parameters, dataset_metadata=metadata)
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="adam")
    if sampling == "poisson":
        train = poisson_batches(x, y, metadata.sampling_rate, metadata.nb_steps_per_epochs, 0)
    else:
        train = shuffled(x, y, multiplicity)
    return model, train, callbacks


CONFIGURATIONS = [
    "global",
    "per-layer",
    # The architecture does not enter the plan (its releases are the same as "global"'s):
    # make test-slow (about 7 s each on 2 idle cores).
    pytest.param("residual", marks=pytest.mark.slow),
    "multiplicity-3",
    "poisson",
    pytest.param("fixed-clip", marks=pytest.mark.slow),
    "laplace-clipping",
    "quantile-clipping",
]


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_epsilon_before_fit_equals_epsilon_after(name):
    model, train, callbacks = configuration(name)
    planned, delta = get_eps_delta(model, EPOCHS)
    report_before = privacy_report(model, EPOCHS)
    pld_planned, _ = get_eps_delta(model, EPOCHS, accountant="pld")
    history = model.fit(
        train,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[*callbacks, DP_Accountant(), DP_Accountant(accountant="pld")],
    )
    # The second accountant overwrites the first's keys: read both from their own runs.
    logged = history.history["epsilon"]
    assert len(logged) == EPOCHS
    assert logged[-1] == pytest.approx(pld_planned, rel=1e-12)
    rdp_logged = DP_Accountant()
    rdp_logged.set_model(model)
    assert rdp_logged._epsilon(rdp_logged._epochs_done()) == (planned, delta)
    assert report_before.epsilon == planned
    report_after = privacy_report(model)  # epochs from the model's steps
    assert report_after.epochs == EPOCHS
    assert report_after.epsilon == planned
    assert report_after.steps == report_before.steps == EPOCHS * N // B
    assert report_after.dynamic_clipping == report_before.dynamic_clipping
    if not callbacks:  # (dynamic clipping changes the clip values, hence the sensitivities)
        # The same report, plus what was released (nothing before the fit).
        assert report_before.released == [] and len(report_after.released) == 1
        assert str(replace(report_after, released=[])) == str(report_before)
    assert planned > 0 and delta == 1e-5
    for callback in callbacks:
        counted = model.privacy_plan().releases[1].count(EPOCHS)
        assert callback.releases == counted > 0


@pytest.mark.parametrize("name", ["global", "laplace-clipping", "poisson"])
def test_get_max_epochs_agrees_with_the_budget_stop(name):
    model, train, callbacks = configuration(name)
    eps3, _ = get_eps_delta(model, 3)
    eps4, _ = get_eps_delta(model, 4)
    budget = 0.5 * (eps3 + eps4)
    assert get_max_epochs(budget, model) == 3
    history = model.fit(
        train,
        epochs=10,
        verbose=0,
        callbacks=[*callbacks, DP_Accountant(epsilon_budget=budget)],
    )
    assert len(history.epoch) == 3
    assert history.history["epsilon"][-1] == pytest.approx(eps3, rel=1e-12)
    assert eps3 <= budget < eps4
