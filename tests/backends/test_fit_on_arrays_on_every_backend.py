"""``fit(x, y, batch_size=b, epochs=E)`` on a Poisson model (issue 40): the model
Poisson-samples the arrays itself, on every backend and in both families.

The sampling is checked on the data source ``fit`` hands to Keras (captured by a spy of
Keras' ``fit``, then iterated as Keras would): batch sizes against Binomial(N, q) (mean,
variance and a chi-square test, at the operating system's entropy -- the draws of ``fit``
are never seeded -- with bounds a correct sampler fails with probability below 1e-6),
every record drawn, no record twice in a batch, labels aligned, fresh draws every epoch
and every ``fit``. Training itself is checked by the step count and the epsilon that
``DP_Accountant`` logs, against the privacy plan taken before ``fit``."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from scipy import stats

from lipdp.core.callbacks import DP_Accountant
from tests.backends import harness as h

N, B = 64, 8
STEPS = N // B  # the metadata's steps per epoch


def records(rows=N):
    """``rows`` records whose first feature is the record's index and whose class is the
    index mod ``CLASSES`` (what the sampled batches are read back by)."""
    x, _ = h.data(rows, seed=3)
    x[:, 0] = np.arange(rows, dtype="float32")
    y = np.eye(h.CLASSES, dtype="float32")[np.arange(rows) % h.CLASSES]
    return x, y


@pytest.fixture
def captured(monkeypatch):
    """Keras' ``fit`` replaced by a spy: the list of what the private model hands it."""
    calls = []

    def spy(model, x=None, y=None, batch_size=None, **kwargs):
        calls.append({"x": x, "y": y, "batch_size": batch_size, **kwargs})

    monkeypatch.setattr(keras.Model, "fit", spy)
    return calls


def epoch_of(source):
    """One epoch of the Poisson source as Keras reads it: per batch, the indices of the
    records drawn (the JAX source pads its batches: rows of weight 0 are padding)."""
    batches = []
    if hasattr(source, "__getitem__"):  # JAX: PoissonBatches, (x, y, weights)
        for step in range(len(source)):
            x, y, weights = (np.asarray(t) for t in source[step])
            kept = weights > 0
            assert not np.any(x[~kept]) and not np.any(y[~kept]), "padding rows are zeros"
            batches.append((x[kept, 0], y[kept]))
    else:  # TensorFlow: a tf.data.Dataset of (x, y)
        for x, y in source:
            batches.append((np.asarray(x)[:, 0], np.asarray(y)))
    ids = []
    for first, labels in batches:
        index = first.astype("int64")
        np.testing.assert_array_equal(index, first)  # whole records, not mixtures
        np.testing.assert_array_equal(np.argmax(labels, axis=1), index % h.CLASSES)
        assert len(set(index.tolist())) == len(index), "a record twice in one batch"
        ids.append(index)
    return ids


@pytest.mark.parametrize("family", h.FAMILIES)
def test_fit_draws_poisson_batches_of_binomial_sizes_afresh_every_epoch(family, captured):
    model = h.private(family, batch_size=B, dataset_size=N)
    x, y = records()
    model.fit(x, y, batch_size=B, epochs=3, verbose=0)
    model.fit(x, y, epochs=3, verbose=0)  # batch_size omitted: the declared b
    first, second = (call["x"] for call in captured)
    for call in captured:
        assert call["y"] is None and call["batch_size"] is None and call["epochs"] == 3
        assert call["shuffle"] is False and "steps_per_epoch" not in call
        # The source states the accountant's rate and steps (what fit checks, rule S5).
        assert model._poisson_batches_facts(call["x"]) == (B / N, STEPS)

    epochs = [epoch_of(first) for _ in range(60)]
    assert all(len(epoch) == STEPS for epoch in epochs)
    sizes = np.array([len(batch) for epoch in epochs for batch in epoch])
    q, draws = B / N, len(sizes)
    mean, variance = N * q, N * q * (1 - q)
    # Six standard errors of the sample mean and of the sample variance (normal
    # approximation; the binomial's excess kurtosis here is 0.05).
    assert abs(sizes.mean() - mean) < 6 * np.sqrt(variance / draws)
    assert abs(sizes.var(ddof=1) - variance) < 6 * variance * np.sqrt(2 / (draws - 1))
    # Chi-square against Binomial(N, q), sizes pooled into bins of expected count >= 5.
    edges = [0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, N + 1]
    observed = np.histogram(sizes, bins=edges)[0]
    cdf = stats.binom.cdf(np.array(edges) - 1, N, q)
    expected = draws * np.diff(cdf)
    assert expected.min() >= 5
    assert stats.chisquare(observed, expected).pvalue > 1e-6
    # Every record can be drawn (each misses all 480 draws with probability 1e-28).
    assert set(np.concatenate([batch for epoch in epochs for batch in epoch])) == set(range(N))
    # Fresh draws every epoch and every fit (equal with probability below 1e-40).
    flat = [np.concatenate(epoch).tolist() for epoch in epochs[:2]]
    assert flat[0] != flat[1]
    assert np.concatenate(epoch_of(second)).tolist() != flat[0]


@pytest.mark.parametrize("family", h.FAMILIES)
def test_fit_on_arrays_trains_and_logs_the_planned_epsilon(family):
    model = h.private(family, batch_size=B, dataset_size=N)
    x, y = records(N + 16)
    plan = model.privacy_plan()
    history = model.fit(
        x, y, batch_size=B, epochs=2, validation_split=0.2, verbose=0,
        callbacks=[DP_Accountant()],
    )  # fmt: skip
    assert int(model.noisy_steps.numpy()) == 2 * STEPS
    assert history.history["epsilon"] == [plan.epsilon(1), plan.epsilon(2)]
    assert (
        np.all(np.isfinite(history.history["val_loss"])) and len(history.history["val_loss"]) == 2
    )
    # Positional arguments as Keras names them (batch_size, epochs, verbose).
    model.fit(x[:N], y[:N], B, 1, 0)
    assert int(model.noisy_steps.numpy()) == 3 * STEPS
    assert model.privacy_plan().epsilon(3) == plan.epsilon(3)


def test_validation_split_holds_out_keras_last_rows_exactly(captured):
    model = h.private("clipped", batch_size=B, dataset_size=N)
    x, y = records(N + 16)
    model.fit(x, y, validation_split=0.2, epochs=1, verbose=0)  # floor(80 * 0.8) = 64
    call = captured[0]
    x_val, y_val = call["validation_data"]
    np.testing.assert_array_equal(np.asarray(x_val), x[N:])
    np.testing.assert_array_equal(np.asarray(y_val), y[N:])
    assert call["validation_batch_size"] == B and "validation_split" not in call
    drawn = np.concatenate([batch for _ in range(20) for batch in epoch_of(call["x"])])
    assert set(drawn) == set(range(N))  # the first N rows, and only those, are trained on


def test_fit_on_arrays_refuses_what_would_break_the_plan():
    model = h.private("clipped", batch_size=B, dataset_size=N)
    x, y = records()
    with pytest.raises(ValueError, match=r"fit\(batch_size=16\) differs from the batch size 8"):
        model.fit(x, y, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match="fit receives 72 training examples but .*=64"):
        model.fit(*records(N + 8), verbose=0)
    with pytest.raises(ValueError, match="fit receives 51 training examples but .*=64"):
        model.fit(x, y, validation_split=0.2, verbose=0)
    with pytest.raises(ValueError, match=r"steps_per_epoch=3\) differs from the 8 steps"):
        model.fit(x, y, steps_per_epoch=3, verbose=0)
    with pytest.raises(ValueError, match=r"fit\(x\) without y"):
        model.fit(x, verbose=0)
    with pytest.raises(ValueError, match="sample_weight is not supported"):
        model.fit(x, y, B, 1, 0, None, 0.0, None, True, None, np.ones(N))  # positional
    with pytest.raises(ValueError, match="x has 1 example"):
        bad = x.copy()
        bad[5, 1] = np.nan
        model.fit(bad, y, verbose=0)

    class Batches(keras.utils.Sequence):  # a source whose sampling lipdp cannot know
        def __len__(self):
            return STEPS

        def __getitem__(self, index):
            return x[:B], y[:B]

    with pytest.raises(ValueError, match="needs Poisson-sampled batches: pass the arrays"):
        model.fit(Batches(), epochs=1, verbose=0)
    assert int(model.noisy_steps.numpy()) == 0
