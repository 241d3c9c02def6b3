"""A notice TensorFlow logs on a path lipdp takes on purpose, filtered while lipdp traces it.

``tf.vectorized_map`` (TensorFlow's ``pfor``) has no vectorised rule for the kernel gradient
of a convolution whose input differs from row to row (``Conv2DBackpropFilter``): it runs
that op as a ``while_loop`` over the rows, exactly, and logs at WARNING level, once per
converted op, its own to-do note "Conv2DBackpropFilter uses a while_loop. Fix that!". In
lipdp this is the expected path of a per-row gradient (the clipped family's vectorised
fallback, row isolation, the clipless tightness measure): a keras-hub ResNet printed the
line 12 times in its first step. :func:`pfor_loop_notice_filtered` drops that one message
of the ``tensorflow`` logger inside the block (where the map is traced); every other
message, and the same message outside lipdp's maps, still passes.
"""

from __future__ import annotations

import contextlib
import logging

#: The part of pfor's notice that names the fallback (the op's name comes before it).
PFOR_LOOP_NOTICE = "uses a while_loop. Fix that!"


def _not_the_loop_notice(record: logging.LogRecord) -> bool:
    return PFOR_LOOP_NOTICE not in record.getMessage()


@contextlib.contextmanager
def pfor_loop_notice_filtered():
    """Inside the block, the ``tensorflow`` logger drops pfor's "uses a while_loop. Fix
    that!" notice (and nothing else)."""
    logger = logging.getLogger("tensorflow")  # tf.get_logger()'s logger
    logger.addFilter(_not_the_loop_notice)
    try:
        yield
    finally:
        logger.removeFilter(_not_the_loop_notice)


__all__ = ["PFOR_LOOP_NOTICE", "pfor_loop_notice_filtered"]
