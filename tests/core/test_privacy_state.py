"""Rule S10: the privacy state is part of the model.

The noisy step count is a model variable (``model.noisy_steps``): saved and restored by
``.keras`` files, ``save_weights`` / ``load_weights`` and Keras' BackupAndRestore, kept
when a model is recompiled with a fresh optimizer; formats that cannot carry it are
refused. A training process killed mid-epoch and resumed reports the epsilon of an
uninterrupted run of the same steps, never less.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from lipdp.accounting import get_eps_delta
from lipdp.clipless import layers as L
from lipdp.clipless import losses
from lipdp.clipless.model import DP_Sequential, DPParameters
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.report import privacy_report
from lipdp.foundation import compat
from lipdp.foundation.metadata import DatasetMetadata

D, K, B, N = 6, 3, 8, 64


def make_model():
    metadata = DatasetMetadata(input_shape=(D,), nb_classes=K, nb_samples_train=N, batch_size=B)
    model = DP_Sequential(
        [L.DP_BoundedInput(input_shape=(D,), upper_bound=1.0), L.DP_QuickSpectralDense(K)],
        dp_parameters=DPParameters("global", 2.0, 1e-5),
        dataset_metadata=metadata,
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="adam")
    return model


def data():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(N, D)).astype("float32"),
        np.eye(K, dtype="float32")[rng.integers(0, K, size=N)],
    )


def fit(model, epochs):
    return model.fit(*data(), batch_size=B, epochs=epochs, verbose=0, callbacks=[DP_Accountant()])


def test_formats_that_cannot_carry_the_state_are_refused(tmp_path):
    model = make_model()
    for path in (tmp_path / "saved_model_dir", tmp_path / "model.h5"):
        with pytest.raises(ValueError, match="saved to .keras files"):
            model.save(path)


@pytest.mark.smoke
def test_keras_file_round_trip_keeps_the_step_count(tmp_path):
    model = make_model()
    fit(model, 2)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert int(loaded.noisy_steps.numpy()) == 2 * N // B
    assert privacy_report(loaded).epochs == 2
    assert privacy_report(loaded).epsilon == get_eps_delta(model, 2)[0]
    history = fit(loaded, 1)
    assert history.history["epsilon"][-1] == get_eps_delta(model, 3)[0]


#: ``save_weights`` files: the ``.weights.h5`` of Keras 2.13+ and 3, and on Keras 2 its
#: TensorFlow checkpoints too (Keras 3 writes ``.weights.h5`` only).
WEIGHT_FILES = ["model.weights.h5"] + ([] if compat.keras_3() else ["checkpoint"])


@pytest.mark.parametrize("filename", WEIGHT_FILES)
def test_weights_checkpoint_and_a_fresh_optimizer_keep_the_count(tmp_path, filename):
    model = make_model()
    fit(model, 2)
    path = str(tmp_path / filename)
    model.save_weights(path)
    fresh = make_model()
    fresh.load_weights(path)
    # A new optimizer (its own iterations start at 0) does not reset the count.
    fresh.compile(loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="adam")
    assert int(fresh.optimizer.iterations.numpy()) == 0
    assert int(fresh.noisy_steps.numpy()) == 2 * N // B
    history = fit(fresh, 1)
    assert history.history["epsilon"][-1] == get_eps_delta(model, 3)[0]
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(4.0), optimizer="sgd")  # recompile
    assert privacy_report(model).epochs == 2


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {root!r})
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    from tests.core.test_privacy_state import data, make_model, B
    from lipdp.core.callbacks import DP_Accountant

    backup, kill_at = sys.argv[1], int(sys.argv[2])

    class KillMidEpoch(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if kill_at >= 0 and int(self.model.noisy_steps.numpy()) == kill_at:
                os.kill(os.getpid(), 9)  # no cleanup, as a crash or a preemption

    model = make_model()
    callbacks = [tf.keras.callbacks.BackupAndRestore(backup), KillMidEpoch(), DP_Accountant()]
    history = model.fit(*data(), batch_size=B, epochs=4, verbose=0, callbacks=callbacks)
    print(json.dumps({{"epsilon": history.history["epsilon"][-1],
                      "steps": int(model.noisy_steps.numpy())}}))
    """
)


def _run(script, backup, kill_at):
    return subprocess.run(
        [sys.executable, str(script), str(backup), str(kill_at)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # three training processes (~20 s): make test-slow
def test_killed_and_resumed_run_reports_the_uninterrupted_epsilon(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).parents[2])))
    steps_per_epoch = N // B
    killed = _run(script, tmp_path / "backup", kill_at=steps_per_epoch + 3)  # mid epoch 2
    assert killed.returncode != 0  # SIGKILL
    resumed = _run(script, tmp_path / "backup", kill_at=-1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    uninterrupted = _run(script, tmp_path / "fresh_backup", kill_at=-1)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-2000:]
    resumed, uninterrupted = (
        json.loads(r.stdout.strip().splitlines()[-1]) for r in (resumed, uninterrupted)
    )
    assert resumed["steps"] == uninterrupted["steps"] == 4 * steps_per_epoch
    assert resumed["epsilon"] == uninterrupted["epsilon"] == get_eps_delta(make_model(), 4)[0]
