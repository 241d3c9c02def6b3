r"""Per-example gradient norms and clipped gradient sums for a chain of Keras layers.

* :mod:`~lipdp.clipped.per_example.engine`: what no layer family owns -- the recorded
  forward pass, the ghost and Jacobian methods, the vectorised per-row fallback, the
  float64 norms that cannot underflow or overflow (rule S13) and why each released
  contribution stays within its radius; :func:`per_example_gradients`.
* :mod:`~lipdp.clipped.per_example.registry`: ghost rules, looked up by Keras layer class
  (:class:`GhostRule`, :func:`register_ghost_rule`).
* one module per layer family, each registering its rule when imported (here):
  :mod:`~lipdp.clipped.per_example.dense` (``Dense``, and the identities of sums of outer
  products), :mod:`~lipdp.clipped.per_example.convolution` (``Conv2D``),
  :mod:`~lipdp.clipped.per_example.embedding` (``Embedding``).

* :mod:`~lipdp.clipped.per_example.scale`: row scaling and round-off, both backends.

Supporting another layer in the ghost method is one rule registered for its class, from
a new module or from user code; the engine does not change. The registry and the rules
import no TensorFlow: the JAX step (:mod:`lipdp.clipped.jax.ghost`) consults the same
registry; the engine's names (TensorFlow) are imported when first used.
"""

import importlib

# The built-in rules register themselves when imported.
from lipdp.clipped.per_example import convolution, dense, embedding  # noqa: F401
from lipdp.clipped.per_example.registry import (
    GhostRule,
    find_ghost_rule,
    ghost_rule,
    register_ghost_rule,
    registered_ghost_rule,
    registered_rules,
    unregister_ghost_rule,
)


def __getattr__(name):
    """The engine's public names (TensorFlow), imported on first use (PEP 562)."""
    if not name.startswith("_"):
        engine = importlib.import_module("lipdp.clipped.per_example.engine")
        if name in engine.__all__:
            return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GRADIENT_METHODS",
    "Ascent",
    "GhostRule",
    "PerExampleGradients",
    "find_ghost_rule",
    "ghost_rule",
    "per_example_gradients",
    "refuse_loss_reads",
    "refuse_untracked_reads",
    "register_ghost_rule",
    "registered_ghost_rule",
    "registered_rules",
    "row_loop_layers",
    "unregister_ghost_rule",
    "weighted_layers",
]
