"""The soundness checks every backend must pass, written once (tests/backends/conftest.py):
the default suite runs them on TensorFlow, ``make test-jax`` on JAX.

* remove-one (rule S1): one real step on a batch and on the batch minus a record, identical
  noise: the release moves by at most the declared sensitivity, for random records and for
  hostile ones (rows of norm 1e-30 and 1e30, a NaN, an infinity, zeros: rules S9, S13);
* the layers that couple the rows of a batch are refused (rule S2);
* the privacy ledger survives ``save`` / ``load_model`` (rule S10)."""

import keras
import numpy as np
import pytest

from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.core.report import privacy_report
from tests.backends import harness as h

LIMIT = 1.0 + ROUNDOFF_SLACK


def _families():
    """Both families; the clipless family's JAX model is being built (issue 38 item 5):
    until it lands, its JAX cases must fail (strict), so that they cannot stay off."""
    not_yet = pytest.mark.xfail(
        h.BACKEND == "jax", reason="clipless family on JAX: not yet",
        raises=(ValueError, AssertionError), strict=True,
    )  # fmt: skip
    return [pytest.param("clipped"), pytest.param("clipless", marks=not_yet)]


@pytest.mark.parametrize("family", _families())
def test_removing_a_random_record_moves_the_release_within_its_sensitivity(family):
    x, y = h.data(8, seed=1)
    ratios = [h.remove_one_ratio(family, x, y, row) for row in (0, 5)]
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
    for row, name in enumerate(HOSTILE, start=2):
        ratio = h.remove_one_ratio(family, x, y, row)
        assert ratio <= LIMIT, (name, ratio)


@pytest.mark.parametrize("family", _families())
def test_a_batch_normalisation_is_refused(family):
    layers = h.network(family)
    layers.insert(2, keras.layers.BatchNormalization())
    with pytest.raises((TypeError, ValueError), match="(?i)batch ?normali[sz]ation"):
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
