"""lipdp.data.tabular: stratified split, feature scaling, norm bound, batches."""

import numpy as np
import pytest

from lipdp.data.input_bounds import bound_normalize
from lipdp.data.tabular import TABULAR_SCALINGS, _feature_ranges, prepare_tabular_data
from tests.data_helpers import batches, norms


def tabular(n=1000, d=5, seed=0):
    rng = np.random.default_rng(seed)
    y = (rng.uniform(size=n) < 0.1).astype(int)
    x = rng.normal(3.0, 2.0, (n, d)) + 4.0 * y[:, None]
    return x, y


def training_rows(ds):
    """All rows of one pass, sorted (the training order changes every epoch)."""
    rows = np.concatenate([x for x, _ in batches(ds)])
    return rows[np.lexsort(rows.T[::-1])]


def test_tabular_split_is_stratified_and_standardisation_ignores_test():
    x, y = tabular()
    ds_train, ds_test, meta = prepare_tabular_data(
        x, y, test_size=0.2, batch_size=50, bound_fct=100.0, scaling="standardize",
        drop_remainder=False, shuffle_seed=0,
    )  # fmt: skip
    assert (meta.nb_samples_train, meta.nb_samples_test) == (800, 200)
    assert meta.nb_steps_per_epochs == 16 == len(batches(ds_train))
    assert meta.notes and "non-private" in meta.notes[0]
    y_train = np.concatenate([t.argmax(-1) for _, t in batches(ds_train)])
    y_test = np.concatenate([t.argmax(-1) for _, t in batches(ds_test)])
    assert abs(y_train.mean() - y.mean()) < 2 / 800 and abs(y_test.mean() - y.mean()) < 2 / 200
    train = training_rows(ds_train)
    np.testing.assert_allclose(train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(train.std(axis=0), 1.0, atol=1e-5)

    # Change every feature of the test rows: the prepared training data do not move.
    test_rows = np.isin(np.arange(len(x)), _test_indices(x, y))
    x_changed = x.copy()
    x_changed[test_rows] = 1e3
    ds_train2, ds_test2, _ = prepare_tabular_data(
        x_changed, y, test_size=0.2, batch_size=50, bound_fct=100.0, scaling="standardize",
        drop_remainder=False, shuffle_seed=0,
    )  # fmt: skip
    np.testing.assert_array_equal(training_rows(ds_train2), train)
    assert not np.allclose(training_rows(ds_test2), training_rows(ds_test))


def _test_indices(x, y):
    from sklearn.model_selection import train_test_split

    _, test = train_test_split(np.arange(len(x)), test_size=0.2, random_state=0, stratify=y)
    return test


def test_tabular_bounds():
    x, y = tabular(d=6)
    ds_train, ds_test, meta = prepare_tabular_data(
        x, y, batch_size=64, bound_fct=1.5, scaling="standardize"
    )
    assert meta.max_norm == 1.5 and meta.nb_steps_per_epochs == 800 // 64
    rows = [r for ds in (ds_train, ds_test) for r, _ in batches(ds)]
    assert all(len(r) == 64 for r, _ in batches(ds_train))
    assert max(norms(r).max() for r in rows) <= 1.5

    # public feature ranges: clipped, mapped to [-1, 1], bound sqrt(d) without bound_fct
    ds_train, _, meta = prepare_tabular_data(x, y, batch_size=64, feature_ranges=(0.0, 8.0))
    train = training_rows(ds_train)
    assert meta.max_norm == pytest.approx(np.sqrt(6)) and not meta.notes
    assert train.min() >= -1.0 and train.max() <= 1.0 and norms(train).max() <= meta.max_norm
    with pytest.raises(ValueError, match="Choose a feature scaling"):
        prepare_tabular_data(x, y)
    with pytest.raises(ValueError, match="no public bound"):
        prepare_tabular_data(x, y, scaling="standardize")


def test_public_ranges_are_an_affine_map_to_minus_one_one():
    x, y = tabular(n=400, d=3, seed=2)
    low, high = np.array([0.0, -1.0, 2.0]), np.array([8.0, 9.0, 4.0])
    ds_train, ds_test, meta = prepare_tabular_data(
        x, y, batch_size=40, feature_ranges=(low, high), drop_remainder=False, shuffle_seed=1
    )
    expected = 2.0 * (np.clip(x, low, high) - low) / (high - low) - 1.0
    got = np.concatenate([training_rows(ds_train), training_rows(ds_test)])
    want = expected[np.lexsort(expected.T[::-1])]
    np.testing.assert_allclose(got[np.lexsort(got.T[::-1])], want, atol=1e-6)
    assert meta.max_norm == pytest.approx(np.sqrt(3)) and not meta.partial_last_batch


def test_labels_and_bound_pairs():
    x, y = tabular(n=300, d=4, seed=1)
    labels = np.where(y == 1, "anomaly", "normal")  # any sortable label values
    ds_train, _, meta = prepare_tabular_data(
        x, labels, batch_size=32, bound_fct=bound_normalize(), scaling="none", one_hot=False,
        drop_remainder=False,
    )  # fmt: skip
    assert meta.class_names == ["anomaly", "normal"] and meta.nb_classes == 2
    assert meta.partial_last_batch == (240 % 32 != 0) and meta.nb_steps_per_epochs == 8
    rows, targets = map(np.concatenate, zip(*batches(ds_train)))
    assert targets.shape == (240, 1) and set(np.unique(targets)) == {0.0, 1.0}
    assert meta.max_norm == 1.0 and np.allclose(norms(rows), 1.0, atol=1e-5)


def test_tabular_argument_errors():
    x, y = tabular(n=100, d=2)
    with pytest.raises(ValueError, match="scaling must be one of"):
        prepare_tabular_data(x, y, scaling="minmax", bound_fct=1.0)
    assert "minmax" not in TABULAR_SCALINGS
    with pytest.raises(ValueError, match="feature_ranges"):
        prepare_tabular_data(x, y, scaling="none", feature_ranges=(0, 1), bound_fct=1.0)
    with pytest.raises(ValueError, match="shape"):
        prepare_tabular_data(x[:, 0], y, scaling="none", bound_fct=1.0)
    with pytest.raises(ValueError, match="labels"):
        prepare_tabular_data(x, y[:-1], scaling="none", bound_fct=1.0)
    with pytest.raises(ValueError, match="larger than the training set"):
        prepare_tabular_data(x, y, batch_size=81, scaling="none", bound_fct=1.0)


def test_feature_ranges():
    low, high = _feature_ranges((0.0, [1.0, 2.0, 3.0]), 3)
    np.testing.assert_array_equal(low, [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(high, [1.0, 2.0, 3.0])
    for bad in ((1.0, 1.0), (0.0, np.inf), (2.0, 1.0)):
        with pytest.raises(ValueError, match="high > low"):
            _feature_ranges(bad, 3)


def test_poisson_tabular_pipeline_states_its_rate():
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(400, 5)), rng.integers(0, 2, size=400)
    ds_train, _, metadata = prepare_tabular_data(
        x, y, batch_size=32, bound_fct=1.0, scaling="none", sampling="poisson", shuffle_seed=1
    )
    assert metadata.sampling == "poisson" and ds_train.lipdp_sampling_rate == 32 / 320
    sizes = [len(batch) for batch, _ in ds_train]
    assert len(sizes) == 320 // 32 and len(set(sizes)) > 1
