"""pfor's "Conv2DBackpropFilter uses a while_loop. Fix that!" is dropped inside lipdp's
per-row maps (lipdp.foundation.tf_notices), and nothing else is."""

import logging

import numpy as np
import tensorflow as tf

from lipdp.foundation.tf_notices import PFOR_LOOP_NOTICE, pfor_loop_notice_filtered


def _per_row_kernel_gradients():
    """The per-row kernel gradient of a convolution under ``tf.vectorized_map``, traced
    afresh: the op pfor runs as a loop, with its notice."""
    kernel = tf.constant(np.random.default_rng(0).normal(size=(3, 3, 1, 2)), tf.float32)
    rows = tf.constant(np.random.default_rng(1).normal(size=(4, 1, 6, 6, 1)), tf.float32)

    def one_row(row):
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            loss = tf.reduce_sum(tf.nn.conv2d(row, kernel, 1, "SAME") ** 2)
        return tape.gradient(loss, kernel)

    return tf.function(lambda r: tf.vectorized_map(one_row, r))(rows)


def _notices(caplog):
    return [r for r in caplog.records if PFOR_LOOP_NOTICE in r.getMessage()]


def test_the_real_notice_is_dropped_inside_and_kept_outside(caplog):
    caplog.set_level(logging.WARNING, logger="tensorflow")
    _per_row_kernel_gradients()
    assert len(_notices(caplog)) >= 1  # TensorFlow still logs it: the check has teeth
    caplog.clear()
    with pfor_loop_notice_filtered():
        gradients = _per_row_kernel_gradients()
    assert _notices(caplog) == []
    assert gradients.shape == (4, 3, 3, 1, 2)


def test_other_messages_pass_and_the_filter_is_removed(caplog):
    caplog.set_level(logging.WARNING, logger="tensorflow")
    logger = tf.get_logger()
    with pfor_loop_notice_filtered():
        logger.warning("another warning")
        logger.warning("Conv2DBackpropFilter " + PFOR_LOOP_NOTICE)
    logger.warning("Conv2DBackpropFilter " + PFOR_LOOP_NOTICE)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["another warning", "Conv2DBackpropFilter " + PFOR_LOOP_NOTICE]
    assert logger.filters == []
