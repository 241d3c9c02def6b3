r"""How tight are the declared bounds? Measured norms against the bound pass, layer by layer.

The noise of a clipless model is calibrated for the bounds of
:func:`lipdp.clipless.bounds.bound_pass` (notation of :mod:`lipdp.clipless.layers.base`,
for ONE example): ``B_v`` on the gradient of every trainable variable ``v``, ``X`` on the
input norm of every layer and ``G`` on the cotangent at its output. A bound far above
what examples reach wastes noise. :func:`tightness_report` measures, on a batch
``(x, y)``, for every example ``i``:

* ``||g_{i,v}||``, the Frobenius norm of the gradient of example ``i``'s loss w.r.t. ``v``,
  against ``B_v``;
* ``||h_{i,k-1}||``, the norm of the input of layer ``k`` (flattened), against ``X_k``;
* ``||dloss_i / dh_{i,k}||``, the norm of the cotangent at the output of layer ``k``,
  against ``G_k``;

and keeps, per bound, the largest, mean and median norm over the examples and the ratios
``max / bound``, ``mean / bound``. Inside a residual block inputs, cotangents and their
bounds are pairs ``(skip, branch)`` (:mod:`lipdp.clipless.layers.residual`): each path is
a row of its own, named ``"<layer> [skip]"`` / ``"<layer> [branch]"``; a layer wrapped by
:class:`~lipdp.clipless.layers.DP_WrappedResidual` is reported under the wrapper's name (its
variables' keys, :attr:`~lipdp.clipless.bounds.VariableBound.key`, are the wrapper's too).

**What is differentiated is what training differentiates.** The model's own forward loop
(``training=True``) and per-example losses
(:meth:`~lipdp.core.private_model.PrivateModel.per_example_losses`: a row with an unusable
label counts 0), each loss divided by the loss normaliser ``n``
(:attr:`~lipdp.foundation.metadata.DatasetMetadata.loss_normalizer`) before differentiation and
the norms multiplied back by ``n``: a :class:`~lipdp.clipless.layers.DP_ClipGradient` then
clips every example's cotangent at its ``C`` exactly as in a training step. Every example
runs as a batch of one row (``tf.vectorized_map`` over the rows of a chunk of
``batch_size`` examples, in a ``tf.function`` traced once per report), so the gradients of
its loss w.r.t. the variables and the layer outputs are its own; without metadata ``n`` is
that row count, 1, as a clip layer then divides by the rows of its batch. No Jacobian of
the batch's losses is formed (it costs one backward pass of the whole batch per row):
one backward pass of one row per example, memory about ``batch_size`` times the number
of parameters floats per chunk.

**Nothing is changed.** No optimizer step, no projection, no assignment: the forward
pass of every DP layer only reads its variables (``tests/clipless/test_tightness.py``
checks that every weight, trainable or not, and the optimizer's step count are unchanged).

**A diagnostic, not a proof.** A ratio above ``1 + tolerance``
(:meth:`TightnessReport.violations`; ``tolerance`` defaults to
:data:`~lipdp.core.noise.ROUNDOFF_SLACK`, the float32 slack the noise is calibrated with)
shows that a declared bound is violated on this batch: a bug to report. Ratios at or
below 1 only say that these examples stay within the bounds; a bound is sound by the
proof in its layer's docstring (rule S1), for every input, and the exact operator norms
of the kernels are checked by :mod:`lipdp.clipless.audit`. **The report reads the data it
is given**: on private training data its numbers are not covered by the privacy
guarantee (as the training callbacks of :mod:`lipdp.evaluation.diagnostics`, which follow
the gradient ratios of the variables epoch by epoch).

Example::

    from lipdp.clipless.tightness import tightness_report
    report = tightness_report(model, x_train[:1000], y_train[:1000])
    print(report.format())
    assert not report.violations()
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import numpy as np
import tensorflow as tf

from lipdp.clipless.layers.residual import DP_WrappedResidual
from lipdp.clipless.model import DP_Model
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.foundation import validation
from lipdp.foundation.tf_notices import pfor_loop_notice_filtered

logger = logging.getLogger(__name__)

#: The three measured quantities, in the order of :meth:`TightnessReport.format`.
QUANTITIES = ("gradient", "input", "cotangent")
#: Names of the two entries of a pair inside a residual block.
PATHS = ("skip", "branch")


@dataclass(frozen=True)
class TightnessRow:
    """One declared bound against the per-example norms it bounds.

    Attributes:
        quantity: ``"gradient"`` (``B_v``), ``"input"`` (``X``) or ``"cotangent"`` (``G``).
        name: the variable's key (``"<layer>/<variable>"``) or the layer's name, with
            ``" [skip]"`` / ``" [branch]"`` for one path of a residual block.
        layer: name of the DP layer (the wrapper's, inside a residual block).
        kind: class of the layer (``"DP_WrappedResidual(DP_QuickSpectralConv2D)"``).
        bound: the declared bound.
        max_norm, mean_norm, median_norm: over the examples.
        argmax: index in ``x`` of the example reaching ``max_norm``.
    """

    quantity: str
    name: str
    layer: str
    kind: str
    bound: float
    max_norm: float
    mean_norm: float
    median_norm: float
    argmax: int

    @property
    def max_ratio(self) -> float:
        """``max_norm / bound``: above 1 (plus round-off) the bound is violated."""
        return _ratio(self.max_norm, self.bound)

    @property
    def mean_ratio(self) -> float:
        """``mean_norm / bound``: how much of the bound a typical example uses."""
        return _ratio(self.mean_norm, self.bound)

    def violated(self, tolerance: float = ROUNDOFF_SLACK) -> bool:
        """``max_norm > bound * (1 + tolerance)``."""
        return self.max_norm > self.bound * (1.0 + tolerance)

    def as_dict(self) -> dict:
        return {**asdict(self), "max_ratio": self.max_ratio, "mean_ratio": self.mean_ratio}


def _ratio(value: float, bound: float) -> float:
    if bound > 0:
        return value / bound
    return 0.0 if value == 0 else math.inf


@dataclass(frozen=True)
class TightnessReport:
    """What :func:`tightness_report` measured (module docstring).

    Attributes:
        rows: the :class:`TightnessRow` s: every trainable variable (forward order), then
            every layer input with a declared bound, then every layer output's cotangent.
        examples: number of examples measured.
        loss_normalizer: ``n``, what each loss was divided by (as in training; 1 for a
            model without metadata).
    """

    rows: tuple
    examples: int
    loss_normalizer: float

    def select(self, quantity: str) -> tuple:
        """The rows of one quantity (:data:`QUANTITIES`)."""
        validation.choice("quantity", quantity, QUANTITIES)
        return tuple(row for row in self.rows if row.quantity == quantity)

    def row(self, name: str, quantity: str = "gradient") -> TightnessRow:
        """The row of variable key (or layer name) ``name``."""
        for row in self.select(quantity):
            if row.name == name:
                return row
        raise KeyError(f"no {quantity} row named {name!r}.")

    def violations(self, tolerance: float = ROUNDOFF_SLACK) -> tuple:
        """The rows whose largest norm exceeds the bound by more than ``tolerance``
        (relative): a declared bound that does not hold on this batch (module docstring)."""
        tolerance = validation.non_negative("tolerance", tolerance)
        return tuple(row for row in self.rows if row.violated(tolerance))

    def format(self) -> str:
        """A plain-text table: one line per bound, grouped by quantity."""
        width = max([len(row.name) for row in self.rows] + [len("name")])
        header = (
            f"{'name':<{width}}  {'bound':>10}  {'max':>10}  {'mean':>10}  {'median':>10}"
            f"  {'max/bound':>9}  {'mean/bound':>10}"
        )
        titles = {
            "gradient": "per-example gradient norm vs B_v",
            "input": "layer input norm vs X",
            "cotangent": "cotangent norm at the layer output vs G",
        }
        lines = [
            f"Tightness of the declared bounds on {self.examples} examples "
            f"(loss normaliser {self.loss_normalizer:g}):"
        ]
        for quantity in QUANTITIES:
            rows = self.select(quantity)
            if not rows:
                continue
            lines += ["", titles[quantity], header]
            for r in rows:
                flag = "  VIOLATED" if r.violated() else ""
                lines.append(
                    f"{r.name:<{width}}  {r.bound:>10.4g}  {r.max_norm:>10.4g}  "
                    f"{r.mean_norm:>10.4g}  {r.median_norm:>10.4g}  {r.max_ratio:>9.4f}  "
                    f"{r.mean_ratio:>10.4f}{flag}"
                )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """JSON-able: ``{"examples", "loss_normalizer", "rows": [row dicts]}``."""
        return {
            "examples": self.examples,
            "loss_normalizer": self.loss_normalizer,
            "rows": [row.as_dict() for row in self.rows],
        }


def tightness_report(model, x, y, batch_size: int = 256) -> TightnessReport:
    """Measure every declared bound of a compiled clipless model on ``(x, y)``.

    Args:
        model: a built and compiled :class:`~lipdp.clipless.model.DP_Model` (or
            ``DP_Sequential``); it is not modified.
        x: inputs, one row per example (array or tensor, cast to float32).
        y: labels as the model's loss takes them, one row per example.
        batch_size: rows per chunk (memory, module docstring); not the training batch
            size, and without influence on the result.

    Returns:
        a :class:`TightnessReport`. Any ratio above ``1 + ROUNDOFF_SLACK`` is also logged
        as a warning.
    """
    _check_model(model)
    x, y = _check_data(x, y)
    batch_size = validation.count("batch_size", batch_size, 1)
    bounds = model.bounds()
    measure = _chunk_measure(model, bounds, x, y)
    chunks = [
        measure(x[start : start + batch_size], y[start : start + batch_size])
        for start in range(0, int(x.shape[0]), batch_size)
    ]
    norms = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *chunks)
    normalizer = model.loss_normalizer
    report = TightnessReport(
        rows=tuple(_rows(bounds, norms)),
        examples=int(x.shape[0]),
        loss_normalizer=1.0 if normalizer is None else float(normalizer),
    )
    violated = report.violations()
    if violated:
        logger.warning(
            "%d declared bound(s) exceeded on this batch: %s",
            len(violated),
            ", ".join(f"{r.quantity} {r.name} ({r.max_ratio:.6g} x)" for r in violated),
        )
    return report


# ------------------------------------------------------------------------- checks
def _check_model(model) -> None:
    if not isinstance(model, DP_Model):
        raise ValueError(
            f"tightness_report needs a clipless DP_Model or DP_Sequential, got "
            f"{type(model).__name__}: its bounds come from the bound pass of its DP layers."
        )
    if not model.built:
        raise ValueError("Build the model before the report: call it on a batch of inputs.")
    if not callable(getattr(getattr(model, "loss", None), "get_L", None)):
        raise ValueError(
            "Compile the model with a clipless loss before the report: "
            "model.compile(loss=DP_TauCategoricalCrossentropy(tau=...), ...)."
        )


def _check_data(x, y):
    x = tf.cast(tf.convert_to_tensor(x), tf.float32)
    y = tf.convert_to_tensor(y)
    if x.shape.rank is None or x.shape.rank < 1 or y.shape.rank is None or y.shape.rank < 1:
        raise ValueError("x and y must be batches: one row per example.")
    if x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x has {x.shape[0]} rows and y {y.shape[0]}: pass one label row per example."
        )
    if x.shape[0] == 0:
        raise ValueError("x and y are empty: pass at least one example.")
    return x, y


# -------------------------------------------------------------------- measurement
def _chunk_measure(model, bounds, x, y):
    """A ``tf.function`` ``(x, y) -> {"gradient", "input", "cotangent"}`` of per-example
    norms for one chunk (module docstring), traced once (the batch axis is ``None``)."""
    variables = [entry.variable for entry in bounds.variables]
    signature = [
        tf.TensorSpec((None, *x.shape[1:]), x.dtype),
        tf.TensorSpec((None, *y.shape[1:]), y.dtype),
    ]

    def one_example(n, x_i, y_i):
        """Norms for one example, run as a batch of one row (``n``: the loss normaliser)."""
        outputs = []
        with tf.GradientTape() as tape:

            def observe(index, h):
                # Fresh tensors per path: after DP_SplitResidual both entries of the pair
                # are one tensor, whose gradient would sum the two paths.
                h = tf.nest.map_structure(tf.identity, h)
                tape.watch(tf.nest.flatten(h))
                outputs.append(h)
                return h

            logits = model.forward(x_i[None], training=True, observe=observe)
            loss = tf.reduce_sum(model.per_example_losses(y_i[None], logits)) / n
        gradients, cotangents = tape.gradient(loss, (variables, outputs))
        gradient_norms = [
            n * _norm(tf.zeros(v.shape) if g is None else g) for v, g in zip(variables, gradients)
        ]
        cotangent_norms = [
            [n * _norm(c) for c in _flat_cotangents(c, h)] for c, h in zip(cotangents, outputs)
        ]
        # The input of layer k is the output of layer k - 1 (layer 0 reads x).
        inputs = [x_i] + outputs[:-1]
        input_norms = [[_norm(t) for t in tf.nest.flatten(h)] for h in inputs]
        return {"gradient": gradient_norms, "input": input_norms, "cotangent": cotangent_norms}

    @tf.function(input_signature=signature)
    def measure(x, y):
        normalizer = model.loss_normalizer
        n = tf.constant(1.0 if normalizer is None else float(normalizer))
        norms = tf.vectorized_map(lambda row: one_example(n, *row), (x, y))
        # One value per row; a chunk of one row comes back from vectorized_map as a scalar.
        return tf.nest.map_structure(lambda t: tf.reshape(t, (-1,)), norms)

    def run(x_chunk, y_chunk):
        with pfor_loop_notice_filtered():  # traced on the first call
            return tf.nest.map_structure(lambda t: t.numpy(), measure(x_chunk, y_chunk))

    return run


def _norm(tensor):
    """Euclidean (Frobenius) norm of a whole tensor."""
    return tf.norm(tf.reshape(tensor, (-1,)))


def _flat_cotangents(cotangent, output) -> list:
    """The entries of a cotangent (one per path), zero where the loss does not reach."""
    return [
        tf.zeros_like(h) if c is None else c
        for c, h in zip(tf.nest.flatten(cotangent), tf.nest.flatten(output))
    ]


# ---------------------------------------------------------------------------- rows
def _kind(layer) -> str:
    if isinstance(layer, DP_WrappedResidual):
        return f"{type(layer).__name__}({type(layer.block).__name__})"
    return type(layer).__name__


def _summary(quantity, name, layer, bound, norms) -> TightnessRow:
    norms = np.asarray(norms, dtype=np.float64)
    return TightnessRow(
        quantity=quantity,
        name=name,
        layer=layer.name,
        kind=_kind(layer),
        bound=float(bound),
        max_norm=float(np.max(norms)),
        mean_norm=float(np.mean(norms)),
        median_norm=float(np.median(norms)),
        argmax=int(np.argmax(norms)),
    )


def _layer_rows(quantity, layer, bound, norms) -> list:
    """One row, or one per path when ``bound`` is a pair (a residual block)."""
    if isinstance(bound, (tuple, list)):
        return [
            _summary(quantity, f"{layer.name} [{path}]", layer, b, n)
            for path, b, n in zip(PATHS, bound, norms)
        ]
    return [_summary(quantity, layer.name, layer, bound, norms[0])]


def _rows(bounds, norms) -> list:
    rows = [
        _summary("gradient", entry.key, entry.layer, entry.bound, measured)
        for entry, measured in zip(bounds.variables, norms["gradient"])
    ]
    for index, layer in enumerate(bounds.layers):
        if bounds.input_bounds[index] is not None:
            rows += _layer_rows("input", layer, bounds.input_bounds[index], norms["input"][index])
    for index, layer in enumerate(bounds.layers):
        g = bounds.output_cotangent_bounds[index]
        rows += _layer_rows("cotangent", layer, g, norms["cotangent"][index])
    return rows


__all__ = ["QUANTITIES", "TightnessReport", "TightnessRow", "tightness_report"]
