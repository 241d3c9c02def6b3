"""What TensorFlow's native code prints to the terminal, kept off it where lipdp can.

TensorFlow 2.21 prints, from C++, a block of start-up lines when it is imported -- twice
(``import tensorflow`` alone does it, without lipdp: two of its libraries initialise
absl logging) -- and a failed ``cuInit`` on a machine without a GPU driver when its
devices are first listed::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 ... port.cc:153] oneDNN custom operations are on. ...
    I0000 ... cudart_stub.cc:31] Could not find cuda drivers on your machine, ...
    E0000 ... cuda_platform.cc:52] failed call to cuInit: ...

``TF_CPP_MIN_LOG_LEVEL`` does not hide them: absl writes messages logged before its
initialisation straight to file descriptor 2, whatever the level. Only that descriptor
can be silenced, which :func:`discarded` does for a block while Python's own ``stderr``
(warnings, logging, tracebacks) keeps the real terminal. The ``lipdp`` command runs
inside it; a script can import TensorFlow through :func:`import_tensorflow_quietly`
before anything else imports it (Keras on its TensorFlow backend does)::

    from lipdp.foundation.native_logs import import_tensorflow_quietly

    tf = import_tensorflow_quietly()
    import keras

``LIPDP_NATIVE_LOGS=1`` shows the lines again (a driver problem on a GPU machine is
reported there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

#: Set to ``"1"`` to let TensorFlow's native lines through.
SHOW_VARIABLE = "LIPDP_NATIVE_LOGS"


@contextlib.contextmanager
def discarded():
    """Inside the block, what native code writes to file descriptor 2 is discarded.
    Python's ``sys.stderr``, when it is the process' own, is replaced by a stream on the
    real descriptor (and the root logger's stream handlers on it follow), so that
    warnings, logging and tracebacks still reach the terminal; a ``sys.stderr`` a caller
    replaced (pytest's capture, a test's buffer) is left as it is. Nothing changes when
    ``LIPDP_NATIVE_LOGS=1``."""
    if os.environ.get(SHOW_VARIABLE) == "1":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    real = None  # our stream on the real descriptor, when sys.stderr was the process' own
    try:
        if python_stderr is sys.__stderr__:
            real = sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
            _move_log_handlers(python_stderr, real)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if real is not None:  # only what this block replaced is put back
            sys.stderr = python_stderr
            _move_log_handlers(real, python_stderr)
            real.close()


def _move_log_handlers(old, new) -> None:
    """Point the root logger's stream handlers that write to ``old`` at ``new``."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(new)


def import_tensorflow_quietly():
    """``tensorflow``, imported and its physical devices listed inside :func:`discarded`
    (the start-up block and the failed ``cuInit`` are printed then, and only then). Listing
    the physical devices does not initialise the runtime: threads and logical devices can
    still be configured afterwards. When TensorFlow is already imported, it is returned as
    is (its lines have been printed)."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    with discarded():
        import tensorflow as tf

        tf.config.list_physical_devices()
    return tf


__all__ = ["SHOW_VARIABLE", "discarded", "import_tensorflow_quietly"]
