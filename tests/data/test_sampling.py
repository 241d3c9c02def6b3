"""lipdp.data.sampling: Poisson batches, the uniform shuffle of the pipelines, batch sizes."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.data import sources
from lipdp.data.images import load_and_prepare_images_data
from lipdp.data.sampling import (
    _check_batch_size,
    _one_hot,
    _ordered_batches,
    _partial_last_batch,
    _shuffled_batches,
    poisson_batches,
)
from lipdp.foundation.metadata import steps_per_epoch
from tests.data_helpers import batches, digest


# ------------------------------------------------------------------- Poisson
def test_poisson_batches_keep_each_example_with_probability_q():
    x = np.arange(200, dtype="float32")[:, None]
    ds = poisson_batches(x, -x[:, 0], sampling_rate=0.25, steps_per_epoch=400, seed=7)
    counts = np.zeros(200)
    for xs, ys in ds:
        np.testing.assert_array_equal(ys.numpy(), -xs.numpy()[:, 0])  # pairs stay aligned
        ids = xs.numpy()[:, 0].astype(int)
        assert np.all(np.diff(ids) > 0)  # a subset, no example twice
        counts[ids] += 1
    # each example: Binomial(400, 0.25), mean 100, std ~8.7
    assert abs(counts.mean() - 100) < 2.0 and 5.0 < counts.std() < 12.5


def test_poisson_batches_are_reproducible_and_rate_one_is_the_full_set():
    x = np.arange(50, dtype="float32")[:, None]

    def first_epoch(seed):
        ds = poisson_batches(x, x[:, 0], 0.3, 5, seed=seed)
        return [b.numpy()[:, 0].tolist() for b, _ in ds]

    assert first_epoch(11) == first_epoch(11) != first_epoch(12)
    full = poisson_batches(x, x[:, 0], 1.0, 3, seed=0)
    assert [b.numpy()[:, 0].tolist() for b, _ in full] == [list(range(50))] * 3


def test_poisson_batches_validation():
    x = np.zeros((10, 2), "float32")
    for rate in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="sampling_rate"):
            poisson_batches(x, x[:, 0], rate, 4)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        poisson_batches(x, x[:, 0], 0.5, 0)
    with pytest.raises(ValueError, match="10 examples but y has 9"):
        poisson_batches(x, x[:9, 0], 0.5, 4)


# ------------------------------------------------------ fixed-size batches
def test_check_batch_size():
    assert _check_batch_size(3, 10) == 3 and _check_batch_size(10.0, 10) == 10
    assert isinstance(_check_batch_size(np.int64(4), 10), int)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            _check_batch_size(bad, 10)
    with pytest.raises(ValueError, match="larger than the training set"):
        _check_batch_size(11, 10)


@pytest.mark.parametrize("n, b", [(10, 3), (12, 4), (7, 7), (5, 1)])
@pytest.mark.parametrize("drop_remainder", [True, False])
def test_shuffled_batches_cover_the_set_once_per_epoch(n, b, drop_remainder):
    ds = _shuffled_batches(n, b, drop_remainder, 5, lambda indices, seed: (indices, seed))
    partial = _partial_last_batch(n, b, drop_remainder)
    assert partial == (not drop_remainder and n % b != 0)
    epochs = []
    for _ in range(3):
        epoch = [(i.numpy(), int(s)) for i, s in ds]
        sizes = [len(i) for i, _ in epoch]
        # as many batches as metadata's steps_per_epoch counts
        assert len(epoch) == steps_per_epoch(n, b, partial)
        assert sizes[: n // b] == [b] * (n // b) and sum(sizes) == (n if partial else n // b * b)
        indices = np.concatenate([i for i, _ in epoch])
        assert len(set(indices.tolist())) == len(indices) and set(indices) <= set(range(n))
        epochs.append(epoch)
    if n > b > 1:  # a new permutation and new per-batch seeds every epoch
        orders = [np.concatenate([i for i, _ in e]).tolist() for e in epochs]
        assert orders[0] != orders[1] or orders[1] != orders[2]
    seeds = [s for e in epochs for _, s in e]
    assert len(set(seeds)) == len(seeds)


def test_shuffled_batches_are_reproducible_with_a_seed():
    def order(seed):
        ds = _shuffled_batches(100, 10, True, seed, lambda indices, _: indices)
        return np.concatenate([i.numpy() for i in ds]).tolist()

    assert order(3) == order(3) != order(4)
    assert sorted(order(3)) == list(range(100))


def test_ordered_batches():
    ds = _ordered_batches(7, 3, lambda indices: indices * 10)
    assert [b.numpy().tolist() for b in ds] == [[0, 10, 20], [30, 40, 50], [60]]


def test_one_hot():
    labels = np.array([2, 0, 1, 2])
    expected = np.zeros((4, 3), "float32")
    expected[np.arange(4), labels] = 1.0
    out = _one_hot(labels, 3)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)


# --------------------------------------------------- through the image pipeline
def test_partial_last_batch_is_declared():
    ds_train, _, meta = load_and_prepare_images_data(
        "digits", batch_size=100, drop_remainder=False, seed=1
    )
    sizes = [len(x) for x, _ in batches(ds_train)]
    assert sizes == [100] * 15 + [36]
    assert meta.partial_last_batch and meta.nb_steps_per_epochs == 16 == len(sizes)
    assert meta.nb_dropped_per_epoch == 0
    _, _, meta = load_and_prepare_images_data("digits", batch_size=256, drop_remainder=False)
    assert not meta.partial_last_batch and meta.nb_steps_per_epochs == 6


def test_shuffle_is_uniform_over_the_whole_set_and_changes_each_epoch():
    ds_train, _, meta = load_and_prepare_images_data("digits", batch_size=256, seed=3)
    raw = sources.load_digits().x_train
    expected = sorted(digest(image) for image in raw)
    orders = []
    for _ in range(3):
        epoch = np.concatenate([x for x, _ in batches(ds_train)])
        assert sorted(digest(image) for image in epoch) == expected  # every example, once
        orders.append([digest(image) for image in epoch])
    assert orders[0] != orders[1] != orders[2]
    # the first batch mixes examples from the whole set, not a window of it
    position = {h: i for i, h in enumerate(digest(image) for image in raw)}
    first = [position[h] for h in orders[1][:256]]
    assert max(first) - min(first) > 1200
    # same seed: same sequence of epochs
    again, _, _ = load_and_prepare_images_data("digits", batch_size=256, seed=3)
    epoch = np.concatenate([x for x, _ in batches(again)])
    assert [digest(image) for image in epoch] == orders[0]


def test_pipeline_batch_size_errors():
    with pytest.raises(ValueError, match="larger than the training set"):
        load_and_prepare_images_data("digits", batch_size=2000)
    with pytest.raises(ValueError, match="batch_size"):
        load_and_prepare_images_data("digits", batch_size=0)


def test_poisson_indices_are_independent_bernoulli_draws():
    """poisson_indices draws geometric gaps (O(expected size)); the result must be the
    law of n independent Bernoulli(q) inclusions: per-index rates q, batch size
    Binomial(n, q), pairs of neighbours included together with probability q^2."""
    from lipdp.data.sampling import poisson_indices

    n, q, draws = 200, 0.1, 2000
    draw = tf.function(lambda seed: poisson_indices(n, q, seed))  # one trace, as in tf.data
    included = np.zeros((draws, n), dtype=bool)
    for seed in range(draws):
        indices = draw(tf.constant(seed, tf.int64)).numpy()
        assert len(np.unique(indices)) == len(indices) and indices.min(initial=0) >= 0
        included[seed, indices] = True
    sd = np.sqrt(q * (1 - q) / draws)
    assert np.all(np.abs(included.mean(axis=0) - q) < 5 * sd)
    sizes = included.sum(axis=1)
    assert abs(sizes.mean() - n * q) < 4 * np.sqrt(n * q * (1 - q) / draws)
    assert abs(sizes.var() / (n * q * (1 - q)) - 1) < 0.15
    together = (included[:, :-1] & included[:, 1:]).mean()
    assert abs(together - q * q) < 5 * np.sqrt(q * q / (draws * (n - 1)))
    assert poisson_indices(5, 1.0, 0).numpy().tolist() == [0, 1, 2, 3, 4]
    big = poisson_indices(1_000_000, 1e-4, 7).numpy()  # ~100 draws, not a million
    assert 40 < len(big) < 200 and np.all(np.diff(big) > 0)
