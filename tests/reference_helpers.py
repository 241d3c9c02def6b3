"""tensorflow-privacy, the per-example-clipping reference of a few tests: TensorFlow 2.15 only.

tensorflow-privacy 0.9.0 (its last release) imports tensorflow-estimator, which needs
TensorFlow internals gone since TensorFlow 2.16 dropped ``tf.estimator`` (under 2.21:
``cannot import name 'estimator_training' from 'tensorflow.python.distribute'``). It is
therefore installed with TensorFlow 2.15 only (setup.cfg's ``reference`` extra, ``make
install``), and the comparisons with it are skipped, with this reason, on newer TensorFlow.
On TensorFlow 2.15 a missing install is an error, not a skip.
"""

import pytest

from lipdp.foundation import compat

requires_tensorflow_privacy = pytest.mark.skipif(
    compat.tensorflow_version() >= compat.KERAS_3_DEFAULT_SINCE,
    reason="tensorflow-privacy 0.9.0 (its last release) cannot be imported with TensorFlow "
    ">= 2.16 (its tensorflow-estimator import fails); compared on TensorFlow 2.15 only",
)
