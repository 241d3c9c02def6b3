"""lipdp.foundation.metadata: steps, epochs, normalisers, validation, serialisation, default
delta."""

import json

import pytest

from lipdp.foundation.metadata import (
    SAMPLING_MODES,
    DatasetMetadata,
    default_delta_value,
    steps_per_epoch,
)


def meta(**kwargs):
    defaults = {"input_shape": (4,), "nb_classes": 2, "nb_samples_train": 10, "batch_size": 3}
    return DatasetMetadata(**{**defaults, **kwargs})


# ------------------------------------------------------------------- steps
@pytest.mark.parametrize(
    "n, b, partial, expected",
    [(60000, 1000, False, 60), (10, 3, False, 3), (10, 3, True, 4), (9, 3, True, 3),
     (9, 3, False, 3), (1, 1, False, 1), (1536, 100, True, 16)],
)  # fmt: skip
def test_steps_per_epoch(n, b, partial, expected):
    assert steps_per_epoch(n, b, partial) == expected
    # every example is seen once per epoch when the partial batch is kept, and the
    # dropped remainder is smaller than one batch otherwise
    full, rest = divmod(n, b)
    assert expected == full + (1 if partial and rest else 0)


def test_steps_per_epoch_validation():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            steps_per_epoch(10, bad)
    with pytest.raises(ValueError, match="nb_samples"):
        steps_per_epoch(0, 1)
    assert steps_per_epoch(10.0, 5.0) == 2  # integral floats are accepted


def test_default_steps_and_dropped_examples():
    m = meta(nb_samples_train=1536, batch_size=100)
    assert m.nb_steps_per_epochs == 15 and m.nb_dropped_per_epoch == 36
    m = meta(nb_samples_train=1536, batch_size=100, partial_last_batch=True)
    assert m.nb_steps_per_epochs == 16 and m.nb_dropped_per_epoch == 0
    assert meta(nb_steps_per_epochs=7).nb_steps_per_epochs == 7  # explicit value kept


# -------------------------------------------------- batches and normalisers
def test_rows_per_batch_and_loss_normalizer():
    assert meta(batch_size=3).rows_per_batch == 3 == meta(batch_size=3).loss_normalizer
    assert meta(batch_size=3, multiplicity=1).rows_per_batch == 3
    m = meta(batch_size=3, multiplicity=4)
    assert m.rows_per_batch == 12 == m.loss_normalizer
    assert m.sampling_rate == pytest.approx(3 / 10)  # multiplicity does not change q
    poisson = meta(batch_size=4, sampling="poisson")
    assert poisson.loss_normalizer == 4  # the expected batch size


def test_sampling_rate():
    assert meta(nb_samples_train=60000, batch_size=1000).sampling_rate == 1000 / 60000
    assert meta(nb_samples_train=7, batch_size=7).sampling_rate == 1.0


def test_steps_and_epochs():
    m = meta(nb_samples_train=60000, batch_size=1000)  # 60 steps per epoch
    assert m.steps_for_epochs(0) == 0 and m.steps_for_epochs(5) == 300
    # a partial epoch counts as a whole one (ceil): never under-accounts
    for steps, epochs in [(0, 0), (1, 1), (59, 1), (60, 1), (61, 2), (120, 2), (121, 3)]:
        assert m.epochs_for_steps(steps) == epochs, steps
        assert m.steps_for_epochs(epochs) >= steps
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="steps"):
            m.epochs_for_steps(bad)
        with pytest.raises(ValueError, match="epochs"):
            m.steps_for_epochs(bad)


# ------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sampling": "bernoulli"}, "sampling must be one of"),
        ({"batch_size": 11}, "larger than the training set"),
        ({"batch_size": 0}, "batch_size"),
        ({"nb_samples_train": 0, "batch_size": 1}, "nb_samples_train"),
        ({"multiplicity": -1}, "multiplicity"),
        ({"multiplicity": 1.5}, "multiplicity"),
        ({"nb_steps_per_epochs": 0}, "nb_steps_per_epochs"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        meta(**kwargs)


def test_normalised_fields():
    m = meta(input_shape=[28.0, 28, 1], multiplicity=2.0, class_names=("a", "b"))
    assert m.input_shape == (28, 28, 1) and m.multiplicity == 2
    assert isinstance(m.multiplicity, int) and m.class_names == ["a", "b"]
    assert set(SAMPLING_MODES) == {"shuffle", "poisson"}


# --------------------------------------------------------- serialisation
def test_metadata_round_trip():
    m = DatasetMetadata(
        input_shape=(4,), nb_classes=2, nb_samples_train=10, batch_size=3,
        multiplicity=2, partial_last_batch=True, notes=["n"],
    )  # fmt: skip
    assert m.nb_steps_per_epochs == 4 and m.rows_per_batch == 6
    assert DatasetMetadata(**m.to_config()) == m
    assert DatasetMetadata(input_shape=(4,), nb_classes=2, nb_samples_train=10,
                           batch_size=3).nb_steps_per_epochs == 3  # fmt: skip
    with pytest.raises(ValueError, match="multiplicity"):
        DatasetMetadata(input_shape=(4,), nb_classes=2, nb_samples_train=10, multiplicity=-1)


def test_config_survives_json():
    m = meta(
        nb_samples_test=5, class_names=["x", "y"], max_norm=2.5, sampling="poisson",
        notes=["fitted on the private split"],
    )  # fmt: skip
    config = json.loads(json.dumps(m.to_config()))
    again = DatasetMetadata.from_config(config)
    assert again == m and again.input_shape == (4,)
    assert config["sampling"] == "poisson" and config["max_norm"] == 2.5


# ------------------------------------------------------------ default delta
@pytest.mark.parametrize(
    "n, delta", [(60000, 1e-5), (1797, 1e-4), (1000, 1e-4), (999, 1e-3), (1, 0.1), (10, 0.01)]
)
def test_default_delta_value(n, delta):
    assert default_delta_value(meta(nb_samples_train=n, batch_size=1)) == delta


def test_default_delta_is_the_largest_power_of_ten_below_one_over_n():
    for n in [2, 9, 10, 11, 99, 100, 101, 4999, 50000, 99999, 100000, 123456]:
        delta = default_delta_value(meta(nb_samples_train=n, batch_size=1))
        # 10^k: the smallest power of ten strictly above n (exact integer arithmetic)
        k = next(k for k in range(20) if 10**k > n)
        assert delta == 10.0**-k
