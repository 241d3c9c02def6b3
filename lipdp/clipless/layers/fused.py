"""When the clipless layers may run their fused XLA kernels on TensorFlow.

``DP_GroupSort(2)`` and whole-window ``DP_ScaledL2NormPooling2D`` have a fused form (two
XLA-compiled functions each, forward and backward, with the custom gradient between them
in the graph: :func:`lipdp.clipless.layers.activations.sort_pairs_xla`,
:func:`lipdp.clipless.layers.pooling.l2_norm_pool_xla`). ``pfor`` -- ``tf.vectorized_map``
and ``tape.jacobian``, which the per-example tools use (the sensitivity audit of
:mod:`lipdp.clipless.audit`, the diagnostics of :mod:`lipdp.evaluation.diagnostics`, row
isolation) -- cannot vectorise a call into an XLA-compiled function (``UnimplementedError``
at run time). So the fused forms run only where lipdp knows the layers run on the batch,
forward and backward, with no ``pfor`` around them: inside the clipless family's own
training step (:func:`fused_kernels`, entered by the step); everywhere else the layers take
their generic path (the same function and gradient, to float round-off).
"""

from __future__ import annotations

import contextlib

_DEPTH = [0]  # a process-wide count (a replica of tf.distribute may trace in its own thread)


def fused_kernels_allowed() -> bool:
    """Whether the code being traced runs inside :func:`fused_kernels`."""
    return _DEPTH[0] > 0


@contextlib.contextmanager
def fused_kernels():
    """Allow the fused kernels while the block runs (traces)."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


@contextlib.contextmanager
def no_fused_kernels():
    """Forbid the fused kernels while the block runs (traces): code under ``pfor`` inside
    the training step (row isolation's vectorised map)."""
    saved, _DEPTH[0] = _DEPTH[0], 0
    try:
        yield
    finally:
        _DEPTH[0] = saved
