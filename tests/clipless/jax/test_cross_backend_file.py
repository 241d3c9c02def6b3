"""One ``.keras`` file across backends (rule S10): a clipless ``DP_Sequential`` saved on
TensorFlow loads on JAX, and one saved on JAX loads on TensorFlow, with the same weights
(bitwise), the same ledger (table bitwise, counts), the same step count and epsilon, the
same configuration (sigma, noise strategy, metadata), and trains on: one more step counts
one more run of the same mechanism. The noise key is never in a file (rule S8).

The TensorFlow side runs once, in one subprocess (``file_side.py``, both directions and
both noise strategies). Files written by the JAX models before the common layout (the
zeroed key first, the ledger as int32 words) are written here by that code path (the old
``save_own_variables``, kept below) and still load; a ledger that cannot be read is refused
in one line, never loaded as an empty one."""

import io
import json
import zipfile

import h5py
import keras
import numpy as np
import pytest

from lipdp.core.jax import keys
from lipdp.core.jax import ledger as words_ledger
from lipdp.core.jax.trainer import JaxPrivateTrainer
from lipdp.core.ledger import CAPACITY, WIDTH
from tests.clipless.jax.file_side import SPEC, build, build_clipped, data, state
from tests.clipless.jax.tensorflow_run import run_tensorflow_side
from tests.marks import thorough


@pytest.fixture(scope="module", params=["per-layer", pytest.param("global", marks=thorough)])
def exchanged(request, tmp_path_factory):
    """For one noise strategy: a JAX model trained ``steps`` steps and saved; the
    TensorFlow subprocess's file and report (``file_side.main``, both directions)."""
    strategy = request.param
    directory = tmp_path_factory.mktemp("files")
    x, y = data()
    model = build(strategy)
    for _ in range(SPEC["steps"]):
        model.train_on_batch(x, y)
    model.save(str(directory / f"jax_{strategy}.keras"))
    build_clipped().save(str(directory / "jax_clipped.keras"))
    spec = {"strategies": [strategy], "clipped": True}
    (directory / "spec.json").write_text(json.dumps(spec))
    run_tensorflow_side("file_side", str(directory))
    return strategy, directory, model, dict(np.load(directory / "tf.npz"))


def _same_state(ours, theirs):
    """Two ``file_side.state`` dicts (same prefix removed) equal: weights and the ledger
    table bitwise, counts, steps, epsilon and configuration exactly."""
    assert sorted(ours) == sorted(theirs)
    assert any(name.startswith("w/") for name in ours)
    for name, value in ours.items():
        other = theirs[name]
        if name == "table":  # bitwise, as float64 words
            np.testing.assert_array_equal(value.view(np.int64), other.view(np.int64))
        elif name == "config":
            assert json.loads(str(value)) == json.loads(str(other))
        else:
            assert np.asarray(value).dtype == np.asarray(other).dtype, name
            np.testing.assert_array_equal(value, other, err_msg=name)


def _unprefixed(report, prefix):
    start = f"{prefix}/"
    return {k[len(start) :]: v for k, v in report.items() if k.startswith(start)}


def test_a_tensorflow_file_loads_on_jax_with_its_weights_and_ledger(exchanged):
    strategy, directory, _, report = exchanged
    written = _unprefixed(report, f"tf_{strategy}")
    assert written["steps"] == SPEC["steps"] and written["counts"].sum() == SPEC["steps"]
    loaded = keras.models.load_model(str(directory / f"tf_{strategy}.keras"))
    assert isinstance(loaded, JaxPrivateTrainer)
    _same_state(_unprefixed(state(loaded, "jax"), "jax"), written)
    assert loaded.dp_parameters.noisify_strategy == strategy
    # It trains on: the same mechanism (same row) counted once more, a fresh key.
    (row,) = np.flatnonzero(written["counts"])
    loaded.train_on_batch(*data())
    counts = np.asarray(loaded.privacy_ledger_counts.numpy(), np.int64)
    expected = written["counts"].copy()
    expected[row] += 1
    np.testing.assert_array_equal(counts, expected)
    assert int(loaded.noisy_steps.numpy()) == SPEC["steps"] + 1
    assert np.any(loaded.noise_key.numpy())


def test_a_jax_file_loads_on_tensorflow_with_its_weights_and_ledger(exchanged):
    strategy, _, model, report = exchanged
    ours = _unprefixed(state(model, "jax"), "jax")
    _same_state(_unprefixed(report, f"from_jax_{strategy}"), ours)
    trained = _unprefixed(report, f"from_jax_{strategy}_trained")
    (row,) = np.flatnonzero(ours["counts"])
    expected = ours["counts"].copy()
    expected[row] += 1
    np.testing.assert_array_equal(trained["counts"], expected)
    assert trained["steps"] == SPEC["steps"] + 1


def test_the_file_holds_the_tensorflow_layout_and_never_the_key(exchanged):
    """The model's own entries are the TensorFlow model's (int64 steps, float64 table,
    int64 counts) and nothing of the file is the key: no uint32 array, and the trained
    model's key bytes appear nowhere in the archive."""
    strategy, directory, model, _ = exchanged
    key = np.asarray(model.noise_key.numpy())
    assert np.any(key)
    archive = zipfile.ZipFile(directory / f"jax_{strategy}.keras")
    for name in archive.namelist():
        assert key.tobytes() not in archive.read(name), name
    with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
        own = weights["vars"]
        layout = [(own[k].dtype, own[k].shape) for k in sorted(own, key=int)]
        assert layout == [
            (np.int64, ()),
            (np.float64, (CAPACITY, WIDTH)),
            (np.int64, (CAPACITY,)),
        ]
        arrays = []

        def collect(_, entry):  # visititems stops at a callback's first non-None
            if isinstance(entry, h5py.Dataset):
                arrays.append(entry)

        weights.visititems(collect)
        assert arrays and not any(a.dtype == np.uint32 for a in arrays)
    assert b"noise_key" not in archive.read("config.json")


def test_a_clipped_model_s_file_is_refused_on_the_other_backend(exchanged):
    """``DPSGD_Sequential`` (TensorFlow) and ``DPSGD_JaxModel`` (JAX) are different
    programs with different configurations: a file of one is refused on the other in one
    line naming the backend to load it with (not Keras' "could not locate class")."""
    import lipdp.clipped.jax.model  # noqa: F401 (the clipped family on JAX)

    _, directory, _, report = exchanged
    refusal = str(report["clipped_refusal"])
    assert refusal.startswith("This file holds a DPSGD_JaxModel") and "\n" not in refusal
    assert "KERAS_BACKEND=jax" in refusal
    with pytest.raises(ValueError, match="DPSGD_Sequential.*KERAS_BACKEND=tensorflow"):
        keras.models.load_model(str(directory / "tf_clipped.keras"))


def _old_save_own_variables(self, store):
    """``JaxPrivateTrainer.save_own_variables`` before the common layout (lipdp main
    cf44963): every own variable in Keras' order, the key written as zeros, the step
    count int32, the ledger as int32 words."""
    own = self._trainable_variables + self._non_trainable_variables
    for i, variable in enumerate(own):
        key = variable is self.noise_key
        store[f"{i}"] = np.zeros(keys.KEY_WORDS, np.uint32) if key else variable


def test_a_file_of_the_earlier_jax_layout_still_loads(tmp_path, monkeypatch):
    model = build("per-layer")
    x, y = data()
    for _ in range(SPEC["steps"]):
        model.train_on_batch(x, y)
    monkeypatch.setattr(JaxPrivateTrainer, "save_own_variables", _old_save_own_variables)
    path = str(tmp_path / "old.keras")
    model.save(path)
    monkeypatch.undo()
    with zipfile.ZipFile(path) as archive:  # it is the old layout
        with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
            assert [weights["vars"][k].dtype for k in sorted(weights["vars"], key=int)] == [
                np.uint32, np.int32, np.int32, np.int32
            ]  # fmt: skip
    loaded = keras.models.load_model(path)
    _same_state(_unprefixed(state(loaded, "a"), "a"), _unprefixed(state(model, "a"), "a"))
    loaded.train_on_batch(x, y)
    assert int(loaded.noisy_steps.numpy()) == SPEC["steps"] + 1
    assert loaded.privacy_ledger.entries()[0].count == SPEC["steps"] + 1


def _save_with_table(table, counts):
    def save(self, store):
        for i, variable in enumerate(self._file_variables()):
            store[f"{i}"] = {
                id(self.noisy_steps): np.int64(self.noisy_steps.numpy()),
                id(self.privacy_ledger_table): table,
                id(self.privacy_ledger_counts): counts,
            }.get(id(variable), variable)

    return save


UNREADABLE = {
    "float32 table": (np.zeros((CAPACITY, WIDTH), np.float32), np.zeros(CAPACITY, np.int64)),
    "NaN in the table": (np.full((CAPACITY, WIDTH), np.nan), np.zeros(CAPACITY, np.int64)),
    "counts beyond int32": (np.zeros((CAPACITY, WIDTH)), np.full(CAPACITY, 2**31, np.int64)),
}


@pytest.mark.parametrize("case", UNREADABLE)
def test_a_ledger_that_cannot_be_read_is_refused(tmp_path, monkeypatch, case):
    """Rule S10: never loaded with an empty (or smaller) ledger."""
    model = build("global")
    monkeypatch.setattr(
        JaxPrivateTrainer, "save_own_variables", _save_with_table(*UNREADABLE[case])
    )
    path, weights = str(tmp_path / "bad.keras"), str(tmp_path / "bad.weights.h5")
    model.save(path)
    model.save_weights(weights)  # the same layout through save_weights
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cannot be read"):
        keras.models.load_model(path)
    fresh = build("global")
    with pytest.raises(ValueError, match="cannot be read"):
        fresh.load_weights(weights)
    # skip_mismatch would turn the refusal into a warning: refused itself.
    with pytest.raises(ValueError, match="skip_mismatch"):
        fresh.load_weights(weights, skip_mismatch=True)


def test_from_file_is_exact_on_every_float64():
    """The words of a TensorFlow table are its bits, both ways (denormals, 1e308, inf)."""
    rng = np.random.RandomState(0)
    table = np.abs(rng.randn(CAPACITY, WIDTH)) * 10.0 ** rng.randint(-320, 308, (CAPACITY, WIDTH))
    table[0, :3] = [np.inf, 5e-324, 0.0]
    counts = rng.randint(0, 2**31 - 1, CAPACITY).astype(np.int64)
    words, runs = words_ledger.from_file(table, counts)
    assert words.dtype == np.int32 and runs.dtype == np.int32
    back, back_counts = words_ledger.file_entries(words, runs)
    np.testing.assert_array_equal(back.view(np.int64), table.view(np.int64))
    np.testing.assert_array_equal(back_counts, counts)
