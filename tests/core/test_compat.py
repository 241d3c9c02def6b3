"""lipdp.core.compat: lipdp runs on Keras 2 only, and says how to get it when tf.keras is
Keras 3."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from lipdp.core import compat

KERAS_3_DEFAULT = compat.tensorflow_version() >= compat.KERAS_3_DEFAULT_SINCE


def _run(code):
    """``code`` in a fresh interpreter whose environment does not set TF_USE_LEGACY_KERAS."""
    env = {k: v for k, v in os.environ.items() if k != compat.LEGACY_KERAS_FLAG}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


def test_this_suite_runs_on_keras_2():
    assert compat.keras_problem() is None
    assert compat.loaded_keras_version(tf).startswith("2.")
    assert isinstance(tf.keras.layers.Dense(1), tf.keras.layers.Layer)


@pytest.mark.parametrize(
    "version,flag,has_tf_keras,expected",
    [
        ((2, 15), None, False, None),  # TF 2.15: its own Keras 2, whatever the flag
        ((2, 15), "1", True, None),
        ((2, 21), "1", True, None),
        ((2, 16), "true", True, None),
        ((2, 21), None, True, "TensorFlow 2.21 makes tf.keras Keras 3 while TF_USE_LEGACY_"),
        ((2, 21), "0", True, "TF_USE_LEGACY_KERAS='0'"),
        ((2, 21), "1", False, "needs tf-keras for Keras 2, which is missing"),
        (None, None, False, None),  # unknown TensorFlow: TensorFlow's own import decides
    ],
)
def test_predicted_problem_before_tensorflow_is_imported(version, flag, has_tf_keras, expected):
    problem = compat.predicted_keras_problem(version, flag, has_tf_keras)
    if expected is None:
        assert problem is None
    else:
        assert expected in problem


def test_importing_lipdp_first_gives_keras_2():
    """Without TF_USE_LEGACY_KERAS in the environment, ``import lipdp`` before TensorFlow
    sets it on TensorFlow >= 2.16 and leaves TensorFlow 2.15 with its own Keras 2."""
    result = _run(
        "import os, lipdp, tensorflow as tf; "
        "print(os.environ.get('TF_USE_LEGACY_KERAS'), tf.keras.Model.__module__)"
    )
    assert result.returncode == 0, result.stderr
    flag, module = result.stdout.split()
    if KERAS_3_DEFAULT:
        assert (flag, module.split(".")[0]) == ("1", "tf_keras")
    else:
        assert (flag, module.split(".")[0]) == ("None", "keras")


@pytest.mark.smoke
@pytest.mark.skipif(not KERAS_3_DEFAULT, reason="TensorFlow 2.15's tf.keras is always Keras 2")
def test_keras_3_is_refused_in_one_line_naming_the_fix():
    result = _run("import tensorflow as tf; import lipdp")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: lipdp needs Keras 2 as tf.keras, but tf.keras is Keras 3")
    assert "TF_USE_LEGACY_KERAS is unset" in last
    assert last.endswith(
        "Fix: pip install tf-keras and export TF_USE_LEGACY_KERAS=1 before importing TensorFlow."
    )


@pytest.mark.skipif(not KERAS_3_DEFAULT, reason="TensorFlow 2.15's tf.keras is always Keras 2")
def test_the_flag_set_after_tensorflow_was_imported_is_refused():
    """tf.keras would then be tf-keras, but deel-lip's ``tensorflow.keras`` imports Keras 3."""
    result = _run(
        "import os, tensorflow as tf; os.environ['TF_USE_LEGACY_KERAS'] = '1'; import lipdp"
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "was imported before TF_USE_LEGACY_KERAS=1 was set" in last
    assert last.endswith("before importing TensorFlow.")


@pytest.mark.skipif(KERAS_3_DEFAULT, reason="TensorFlow >= 2.16 without the flag is Keras 3")
def test_tensorflow_2_15_imported_first_is_accepted():
    result = _run(
        "import tensorflow as tf; import lipdp.clipless.model; print(tf.keras.Model.__module__)"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1].startswith("keras.")
