"""Every case of the layer, composition and loss catalogue (tests/cases.py) trained by
``DP_Sequential`` on JAX, attacked as the red team does: one real step on a batch and on
the batch minus each record in turn, identical noise (two models built from the same
seed, ``use_reproducible_noise``), projections off so that the release itself is
compared (tests/backends/harness.py). The release may move by at most the declared
sensitivity; several cases reach it (ratios 0.9998-0.99999), so the check has teeth."""

import dataclasses

import keras
import numpy as np
import pytest

from lipdp.clipless import layers as L
from lipdp.core.noise import ROUNDOFF_SLACK
from tests import cases as C
from tests.backends import harness as h
from tests.marks import representatives

CASES = {**C.LAYER_CASES, **C.COMPOSITION_CASES, **C.LOSS_CASES}
# The catalogue's DP_Lambda applies tf.tanh: a user's function on JAX is written with
# keras.ops (TensorFlow ops cannot take JAX tracers).
CASES["Lambda(stated constant)"] = lambda: C.build(
    [
        L.DP_QuickSpectralDense(16),
        L.DP_Lambda(lambda t: 0.5 * keras.ops.tanh(t), lipschitz_constant=0.5, output_gain=0.5),
        L.DP_QuickSpectralDense(C.NB_CLASSES),
    ],
    C.VEC,
)
DEFAULT = (
    "SpectralDense",
    "ResidualConvBlock",
    "CNN+ClipGradient(tail)",
    "Lambda(stated constant)",
)


def _fresh(case):
    """The case's model and batch, from seed 0, Poisson-sampled (a batch minus a row is a
    legal batch), SGD of rate 1 (the update is minus the release), projections off."""
    keras.utils.set_random_seed(0)
    model, x, y = CASES[case]()
    model.dataset_metadata = dataclasses.replace(model.dataset_metadata, sampling="poisson")
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=model.loss)
    return h.without_projection(model), x, y


@pytest.mark.parametrize("case", representatives(CASES, DEFAULT))
def test_removing_any_record_moves_the_release_within_its_sensitivity(case):
    model, x, y = _fresh(case)
    delta = h.global_sensitivity(model)  # of the weights the step starts from
    release = h.released(model, x, y)
    assert np.all(np.isfinite(release))
    ratios = []
    for row in range(len(x)):
        keep = np.arange(len(x)) != row
        without, _, _ = _fresh(case)
        ratios.append(np.linalg.norm(release - h.released(without, x[keep], y[keep])) / delta)
    assert max(ratios) <= 1.0 + ROUNDOFF_SLACK, ratios
    assert max(ratios) > 0.01, ratios  # the records do move the release
