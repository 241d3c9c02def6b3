"""The soundness checks every backend must pass, written once (tests/backends/conftest.py):
the default suite runs them on TensorFlow, ``make test-jax`` on JAX.

* remove-one (rule S1): one real step on a batch and on the batch minus a record, identical
  noise: the release moves by at most the declared sensitivity, for random records and for
  hostile ones (rows of norm 1e-30 and 1e30, a NaN, an infinity, zeros: rules S9, S13);
  under ``"per-layer"`` noise (clipless), each mechanism's part within its own ``Delta_v``;
* the layers that couple the rows of a batch are refused (rule S2);
* the privacy ledger survives ``save`` / ``load_model`` (rule S10)."""

import keras
import numpy as np
import pytest

from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.core.report import privacy_report
from tests.backends import harness as h
from tests.marks import thorough

LIMIT = 1.0 + ROUNDOFF_SLACK


def _families():
    return [pytest.param(family) for family in h.FAMILIES]


@pytest.mark.parametrize("family", _families())
def test_removing_a_random_record_moves_the_release_within_its_sensitivity(family):
    x, y = h.data(8, seed=1)
    ratios = h.remove_one_ratios(family, x, y, rows=(0, 5))
    assert max(ratios) <= LIMIT, ratios
    assert min(ratios) > 1e-3, ratios  # the release does depend on the record


HOSTILE = {"tiny": 1e-30, "huge": 1e30, "nan": np.nan, "inf": np.inf, "zero": 0.0}


@pytest.mark.parametrize("family", _families())
def test_hostile_records_move_the_release_within_its_sensitivity(family):
    scales = [1.0, 3.0, *HOSTILE.values(), 0.5]
    x, y = h.data(len(scales), seed=2, scales=scales)
    full = h.without_projection(h.private(family))
    release = h.released(full, x, y)
    assert np.all(np.isfinite(release))
    ratios = h.remove_one_ratios(family, x, y, rows=range(2, 2 + len(HOSTILE)))
    assert max(ratios) <= LIMIT, dict(zip(HOSTILE, ratios))


@thorough
@pytest.mark.parametrize("family", _families())
def test_records_of_every_magnitude_move_the_release_within_its_sensitivity(family):
    """Rows of norm ``10^k``, ``k = -30, -20, ..., 30`` (rule S13: no square of a row
    underflows or overflows into a wrong bound), each removed in turn."""
    scales = [10.0**k for k in range(-30, 31, 10)]
    x, y = h.data(len(scales), seed=3, scales=scales)
    ratios = h.remove_one_ratios(family, x, y, rows=range(len(scales)))
    assert max(ratios) <= LIMIT, dict(zip(scales, ratios))
    assert max(ratios) > 0.5, ratios  # the large rows reach their bound


def test_per_layer_noise_moves_each_mechanism_within_its_own_sensitivity():
    """``"per-layer"`` noise (clipless family): one Gaussian mechanism per kernel, each of
    its own ``Delta_v``; removing a record (a random one, a huge one clipped to the input
    bound, a NaN one) moves each kernel's part of the release by at most its ``Delta_v``."""
    scales = [1.0, 3.0, 1e30, 0.5, np.nan, 2.0, 1e-30, 1.0]
    x, y = h.data(len(scales), seed=4, scales=scales)
    ratios = h.mechanism_ratios("clipless", x, y, rows=(2, 4, 5))
    assert ratios.shape == (3, 2)  # two kernels: two mechanisms
    assert ratios.max() <= LIMIT, ratios
    assert ratios.max() > 0.5, ratios  # the check is not vacuous (0.82 here)


class DeclaredCoupling(keras.layers.Layer):
    """The identity, declaring that it couples the rows of a batch (rule S2's escape
    hatch for layers lipdp cannot see through)."""

    couples_examples = True

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape


COUPLINGS = {
    "batch_normalization": (keras.layers.BatchNormalization, "(?i)batch.?normali[sz]ation"),
    "declared": (DeclaredCoupling, "couples_examples|not a DP layer"),
}


@pytest.mark.parametrize("coupling", list(COUPLINGS))
@pytest.mark.parametrize("family", _families())
def test_a_layer_coupling_the_rows_is_refused(family, coupling):
    make, message = COUPLINGS[coupling]
    layers = h.network(family)
    layers.insert(2, make())
    with pytest.raises((TypeError, ValueError), match=message):
        model = h.make_private(
            layers, epsilon=3.0, delta=1e-5, epochs=1, batch_size=8, dataset_size=64,
            method=family,
        )  # fmt: skip
        model.compile(optimizer="sgd", loss=h.loss(family))
        model.train_on_batch(*h.data(8))


@pytest.mark.parametrize("family", _families())
def test_the_ledger_survives_save_and_load(family, tmp_path):
    model = h.private(family)
    x, y = h.data(8)
    for _ in range(2):
        model.train_on_batch(x, y)
    epsilon = privacy_report(model, epochs=1).epsilon
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.privacy_ledger.entries() == model.privacy_ledger.entries()
    assert privacy_report(loaded, epochs=1).epsilon == epsilon
    loaded.train_on_batch(x, y)
    assert [e.count for e in loaded.privacy_ledger.releases()] == [3]
