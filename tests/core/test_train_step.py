"""The one training step of :class:`lipdp.core.private_model.PrivateModel` (issue 27): both
families run it, with the noise levels computed once in the base.

* The standard deviation of every variable's noise and the accountant's multipliers,
  recomputed here by hand -- from the model's sensitivities (and, for the clipped
  family, from the clip norm itself), sigma and the ``nm_coef`` the test gave each layer
  --, not through :mod:`lipdp.core.noise`: ``"global"``, one Gaussian of standard
  deviation ``sigma sqrt(sum_v Delta_v^2)`` on every coordinate and the multiplier
  ``sigma``; ``"per-layer"``, ``sigma c_v Delta_v`` on variable ``v`` and the multipliers
  ``sigma c_v``.
* The soundness check on one real step of each family (:mod:`tests.remove_one`): with
  identical noise, removing one row moves the released gradient by at most the declared
  sensitivity.
* The non-private reference run: no noise, multipliers 0, epsilon infinite after a step.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipless import layers as DPL
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Model, DP_Sequential
from lipdp.clipped.model import Clipping, DPSGD_Model, DPSGD_Sequential
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.core.parameters import DPParameters
from lipdp.core.private_model import PrivateModel
from lipdp.foundation.metadata import DatasetMetadata
from lipdp.foundation.variables import variable_key
from tests.marks import thorough
from tests.remove_one import TOLERANCE, remove_one_ratios

FEATURES, CLASSES, BATCH, N = 6, 3, 8, 64
SIGMA = 1.7
#: ``nm_coef`` of the clipless layers with variables, forward order.
COEFS = {"dense": 2.0, "bias": 0.5, "head": 3.0}
#: The clipped family's clip norm and per-layer shares.
CLIP, SHARES = 0.4, (3.0, 1.0)
STRATEGIES = ("global", "per-layer")


def _metadata(sampling="poisson"):
    return DatasetMetadata(
        input_shape=(FEATURES,),
        nb_classes=CLASSES,
        nb_samples_train=N,
        batch_size=BATCH,
        sampling=sampling,
    )


def _params(strategy, sigma=SIGMA):
    return DPParameters(strategy, sigma, 1e-5, non_private=sigma == 0)


def _clipless(strategy, sigma=SIGMA):
    tf.keras.utils.set_random_seed(3)
    model = DP_Sequential(
        [
            DPL.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=1.0),
            DPL.DP_SpectralDense(8, nm_coef=COEFS["dense"], name="dense"),
            DPL.DP_AddBias(1.0, nm_coef=COEFS["bias"], name="bias"),
            DPL.DP_GroupSort(2),
            DPL.DP_QuickSpectralDense(CLASSES, nm_coef=COEFS["head"], name="head"),
        ],
        dp_parameters=_params(strategy, sigma),
        dataset_metadata=_metadata(),
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")
    return model


def _clipped(strategy, sigma=SIGMA):
    tf.keras.utils.set_random_seed(3)
    # Per-layer noise needs per-layer clipping; global noise is tested on flat clipping.
    if strategy == "per-layer":
        clipping = Clipping("per-layer", CLIP, layer_shares=SHARES)
    else:
        clipping = Clipping("flat", CLIP)
    model = DPSGD_Sequential(
        [
            tf.keras.layers.Dense(8, activation="tanh", input_shape=(FEATURES,), name="dense"),
            tf.keras.layers.Dense(CLASSES, name="head"),
        ],
        dp_parameters=_params(strategy, sigma),
        clipping=clipping,
        dataset_metadata=_metadata(),
    )
    model.compile(loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True), optimizer="sgd")
    return model


BUILDERS = {"clipless": _clipless, "clipped": _clipped}


def _data(seed=0, rows=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, rows)]
    return x, y


def _owner(model, variable) -> str:
    """The name of the layer owning ``variable`` (the test's own bookkeeping)."""
    (name,) = [
        layer.name
        for layer in model.dp_layers
        if variable_key(variable) in {variable_key(v) for v in layer.trainable_variables}
    ]
    return name


def test_the_families_inherit_the_one_step_and_the_one_noise_rule():
    for family in (DP_Model, DPSGD_Model):
        for name in ("train_step", "release_step", "noisify", "noise_stddevs"):
            assert name not in vars(family), f"{family.__name__} overrides {name}"
        assert "noise_multipliers" not in vars(family)
        assert family.train_step is PrivateModel.train_step


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clipless_noise_levels_match_a_hand_computation(strategy):
    model = _clipless(strategy)
    variables = model.trainable_variables
    deltas = {variable_key(entry.variable): float(delta) for entry, delta in model.sensitivities()}
    assert set(deltas) == {variable_key(v) for v in variables}  # one mechanism part per variable
    coef = {variable_key(v): COEFS[_owner(model, v)] for v in variables}
    stddevs = model.noise_stddevs()
    if strategy == "global":
        expected = {
            variable_key(v): SIGMA * math.sqrt(sum(d * d for d in deltas.values()))
            for v in variables
        }
        assert model.noise_multipliers() == [SIGMA]
    else:
        expected = {
            variable_key(v): SIGMA * coef[variable_key(v)] * deltas[variable_key(v)]
            for v in variables
        }
        assert model.noise_multipliers() == [SIGMA * coef[variable_key(v)] for v in variables]
    assert set(stddevs) == set(expected)
    for ref, value in expected.items():
        assert float(stddevs[ref]) == pytest.approx(value, rel=1e-6)  # float32 arithmetic


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clipped_noise_levels_match_a_hand_computation(strategy):
    """Also the sensitivities themselves: ``R (1 + slack) / b``, or ``R_l (1 + slack) / b``
    per weighted layer with ``R_l = R s_l / ||s||``."""
    model = _clipped(strategy)
    entries = model.sensitivities()
    slack = (1.0 + ROUNDOFF_SLACK) / BATCH
    if strategy == "global":
        radii = {"all": CLIP}
        group = {variable_key(v): "all" for v in model.trainable_variables}
    else:
        norm = math.sqrt(sum(s * s for s in SHARES))
        radii = {"dense": CLIP * SHARES[0] / norm, "head": CLIP * SHARES[1] / norm}
        group = {variable_key(v): _owner(model, v) for v in model.trainable_variables}
    assert [float(d) for _, d in entries] == pytest.approx(
        [r * slack for r in radii.values()], rel=1e-12
    )
    stddevs = model.noise_stddevs()
    if strategy == "global":
        # One entry: sigma sqrt(Delta^2) = sigma Delta.
        expected = {ref: SIGMA * CLIP * slack for ref in group}
        assert model.noise_multipliers() == [SIGMA]
    else:
        expected = {ref: SIGMA * radii[name] * slack for ref, name in group.items()}
        assert model.noise_multipliers() == [SIGMA, SIGMA]  # one Gaussian per layer
    assert set(stddevs) == set(expected)
    for ref, value in expected.items():
        assert float(stddevs[ref]) == pytest.approx(value, rel=1e-6)


#: Default run: each family once, each noise strategy once; the crossed pairs are thorough.
CROSSED = [
    ("clipless", "per-layer"),
    ("clipped", "global"),
    pytest.param("clipless", "global", marks=thorough),
    pytest.param("clipped", "per-layer", marks=thorough),
]


@pytest.mark.parametrize("family, strategy", CROSSED)
def test_removing_one_row_moves_the_released_step_by_at_most_the_sensitivity(family, strategy):
    """One real step of each family on a Poisson batch and on the batch without one row,
    identical noise: the released gradients differ by at most the declared sensitivity
    of each Gaussian mechanism (:mod:`tests.remove_one`); not vacuously (the row moves
    the step)."""
    model = BUILDERS[family](strategy)
    x, y = _data()
    ratios = remove_one_ratios(model, x, y, rows=[0, 5])
    assert ratios.max() <= 1 + TOLERANCE
    assert ratios.max() > (0.99 if family == "clipped" else 0.3)  # 1.0 and 0.57, 0.84


@pytest.mark.parametrize("family, strategy", CROSSED)
def test_a_non_private_reference_has_no_noise_and_an_infinite_epsilon(family, strategy):
    model = BUILDERS[family](strategy, sigma=0.0)
    assert all(float(s) == 0.0 for s in model.noise_stddevs().values())
    assert all(s == 0.0 for s in model.noise_multipliers())
    zeros = [tf.zeros_like(v) for v in model.trainable_variables]
    noisy = model.noisify(zeros, model.trainable_variables)
    assert all(np.all(n.numpy() == 0) for n in noisy)
    plan = model.privacy_plan()
    assert plan.non_private and plan.noise_multiplier is None and plan.epsilon(0) == 0.0
    model.train_on_batch(*_data())
    assert int(model.noisy_steps.numpy()) == 1
    (entry,) = model.privacy_ledger.entries()
    assert entry.count == 1 and entry.gaussians == 1 and entry.mechanism is None
    assert model.privacy_plan().epsilon(0) == math.inf  # the step already taken
