r"""Training diagnostics: gradient norms against their bounds, signal against noise.

**These callbacks read private training data** (a batch given by the user) and
their outputs are *not* covered by the privacy guarantee of the training run:
they are tools for the data owner while developing a model (or for public
stand-in data), never added by default, and their numbers must not be published
as part of a DP release.

For a batch ``(x_i, y_i)`` and every trainable variable ``v``:

* per-row gradients ``g_i = grad_v loss(y_i, f(x_i))`` by ``tape.jacobian`` of the
  per-row losses ``model.loss.call(y, y_pred)``. The losses are divided by the
  model's loss normaliser (:attr:`lipdp.foundation.metadata.DatasetMetadata.loss_normalizer`, the
  number training divides by: ``b * m`` rows with augmentation multiplicity ``m``)
  before differentiation and the Jacobian multiplied back, so a
  :class:`~lipdp.clipless.layers.DP_ClipGradient` clips every row's cotangent at ``C`` exactly as
  in training. A row's gradient is bounded by the per-example bound too (an original
  example's gradient is the mean of its ``m`` rows');
* **gradient-to-bound ratio** ``||g_i|| / B_v`` with ``B_v`` the per-example bound of
  the model's bound pass (:mod:`lipdp.clipless.bounds`). Rule S1 says it never exceeds 1; how
  far below 1 it sits measures how loose the bound is;
* **signal-to-noise ratio** ``||mean_i g_i|| / (s_v sqrt(d_v))``: the norm of the
  averaged gradient against the expected norm of the noise added to it
  (``d_v`` coordinates of standard deviation ``s_v``; ``E||N(0, s^2 I_d)|| ~
  s sqrt(d)``), ``s_v`` from the noise rule of :mod:`lipdp.core.noise` (what training
  adds).

:class:`SensitivityAudit` combines the measured gradient ratios with the exact
operator norms of :func:`lipdp.clipless.audit.audit_model` and reports (or raises on) any
violation of the declared bounds.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from lipdp.clipless.audit import (
    DEFAULT_TOLERANCE,
    SensitivityViolation,
    audit_model,
    format_records,
)
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.evaluation.outputs import new_figure
from lipdp.foundation.variables import variable_key

logger = logging.getLogger(__name__)


def _loss_normalizer(model, rows: int) -> int:
    """The number training divides the summed loss by (``rows`` without metadata)."""
    normalizer = getattr(model, "loss_normalizer", None)
    return int(rows) if normalizer is None else int(normalizer)


def _per_example_variable_gradients(model, x, y, b):
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        contributions = model.loss.call(y, model(x, training=True)) / b
    jacobians = tape.jacobian(contributions, variables)
    return [
        b * (tf.zeros((tf.shape(x)[0], *v.shape)) if j is None else j)
        for v, j in zip(variables, jacobians)
    ]


def per_example_variable_gradients(model, x, y, function=None) -> list:
    """Per-row gradients of the per-row losses, one ``(n, *v.shape)`` tensor per
    trainable variable (aligned with ``model.trainable_variables``), with cotangents
    clipped as in training (module docstring).

    ``function``: a compiled version from :func:`compiled_per_example_gradients`
    (reused across calls; the default traces the Jacobian anew at every call).
    """
    x = tf.convert_to_tensor(np.asarray(x, dtype=np.float32))
    y = tf.convert_to_tensor(np.asarray(y, dtype=np.float32))
    b = tf.constant(float(_loss_normalizer(model, x.shape[0])))
    return (function or _per_example_variable_gradients)(model, x, y, b)


def compiled_per_example_gradients():
    """A ``tf.function`` computing :func:`per_example_variable_gradients`; keep it to reuse
    the traced graph (one trace per model and batch shape)."""
    return tf.function(_per_example_variable_gradients)


@dataclass
class VariableStatistics:
    """Gradient statistics of one trainable variable on one batch.

    Attributes:
        name: ``"<layer>/<variable>"`` (key of ``compute_gradient_bounds``).
        ratios: per-example ``||g_i|| / B_v``.
        bound: per-example bound ``B_v``.
        mean_gradient_norm: ``||mean_i g_i||``.
        noise_std: per-coordinate standard deviation of the training noise.
        dim: number of coordinates ``d_v``.
    """

    name: str
    ratios: np.ndarray
    bound: float
    mean_gradient_norm: float
    noise_std: float
    dim: int

    @property
    def expected_noise_norm(self) -> float:
        return self.noise_std * math.sqrt(self.dim)

    @property
    def signal_to_noise(self) -> float:
        noise = self.expected_noise_norm
        return float("inf") if noise == 0 else self.mean_gradient_norm / noise

    @property
    def mean_ratio(self) -> float:
        return float(np.mean(self.ratios))

    @property
    def max_ratio(self) -> float:
        return float(np.max(self.ratios))


def gradient_statistics(model, x, y, function=None) -> list[VariableStatistics]:
    """:class:`VariableStatistics` of every trainable variable on ``(x, y)``
    (module docstring). Reads the data given: private if it is training data.
    ``function``: see :func:`per_example_variable_gradients`."""
    entries = {variable_key(entry.variable): entry for entry, _ in model.sensitivities()}
    stddevs = model.noise_stddevs()
    stats = []
    for v, g in zip(
        model.trainable_variables, per_example_variable_gradients(model, x, y, function)
    ):
        entry = entries[variable_key(v)]
        n = g.shape[0]
        norms = tf.norm(tf.reshape(g, (n, -1)), axis=1).numpy()
        stats.append(
            VariableStatistics(
                name=entry.key,
                ratios=norms / float(entry.bound),
                bound=float(entry.bound),
                mean_gradient_norm=float(tf.norm(tf.reduce_mean(g, axis=0))),
                noise_std=float(stddevs[variable_key(v)]),
                dim=int(v.shape.num_elements()),
            )
        )
    return stats


def _summary_logs(stats) -> dict:
    means = [s.mean_ratio for s in stats]
    signal = math.sqrt(sum(s.mean_gradient_norm**2 for s in stats))
    noise = math.sqrt(sum(s.expected_noise_norm**2 for s in stats))
    return {
        "gradient_to_bound_mean": float(np.mean(means)) if means else 0.0,
        "gradient_to_bound_max": max((s.max_ratio for s in stats), default=0.0),
        "signal_to_noise": float("inf") if noise == 0 else signal / noise,
    }


class _GradientCallback(keras.callbacks.Callback):
    def __init__(self, batch, log_fn=None):
        super().__init__()
        if len(batch) != 2:
            raise ValueError("batch must be a pair (x, y).")
        self.x, self.y = batch
        if log_fn is not None and not callable(log_fn):
            raise TypeError("log_fn must be callable.")
        self.log_fn = log_fn
        self.epochs: list[int] = []
        self.history: list[list[VariableStatistics]] = []
        self._function = compiled_per_example_gradients()

    def on_epoch_end(self, epoch, logs=None):
        stats = gradient_statistics(self.model, self.x, self.y, self._function)
        self.epochs.append(int(epoch))
        self.history.append(stats)
        summary = _summary_logs(stats)
        if logs is not None:
            logs.update(summary)
        if self.log_fn is not None:
            self.log_fn(self._log_payload(epoch, stats, summary))

    def _log_payload(self, epoch, stats, summary):
        payload = {"epoch": int(epoch), **summary}
        for s in stats:
            payload[f"{s.name}/gradient_to_bound"] = s.mean_ratio
            payload[f"{s.name}/signal_to_noise"] = s.signal_to_noise
        return payload


class SignaltoNoiseAverage(_GradientCallback):
    """Per-layer *average* gradient-to-bound and signal-to-noise ratios per epoch.

    Reads private data (module docstring); not added by default.

    Args:
        batch: ``(x, y)`` evaluated at the end of every epoch (any size; the
            per-example gradients of the whole batch are materialised).
        log_fn: optional callable receiving a flat dict per epoch
            (``"<layer>/<var>/gradient_to_bound"``, ``".../signal_to_noise"``,
            and the summaries below).

    Writes into the epoch ``logs``: ``gradient_to_bound_mean`` (mean over variables
    of the mean ratio), ``gradient_to_bound_max`` and ``signal_to_noise`` (whole
    gradient against whole noise). ``history`` keeps the
    :class:`VariableStatistics` of every epoch; :meth:`plot` draws them.
    """

    def series(self) -> dict:
        """``{variable: (mean gradient-to-bound ratios, signal-to-noise ratios)}``."""
        out = {}
        for stats in self.history:
            for s in stats:
                ratios, snr = out.setdefault(s.name, ([], []))
                ratios.append(s.mean_ratio)
                snr.append(s.signal_to_noise)
        return {k: (np.array(a), np.array(b)) for k, (a, b) in out.items()}

    def plot(self):
        """Two panels against the epoch: mean ``||g_i|| / B`` and signal-to-noise per
        variable. Returns the matplotlib ``Figure`` (Agg canvas)."""
        figure = new_figure((9.0, 3.5))
        left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
        epochs = np.array(self.epochs) + 1
        for name, (ratios, snr) in self.series().items():
            left.plot(epochs, ratios, marker="o", label=name)
            right.plot(epochs, snr, marker="o", label=name)
        left.set(xlabel="epoch", ylabel="mean ||g_i|| / bound", ylim=(0, None))
        right.set(xlabel="epoch", ylabel="||mean g|| / E||noise||")
        right.set_yscale("log")
        left.legend(fontsize="small")
        figure.tight_layout()
        return figure


class SignaltoNoiseHistogram(_GradientCallback):
    """Per-layer *distribution* of the per-example gradient-to-bound ratios.

    Same measurement as :class:`SignaltoNoiseAverage` (and the same summaries in
    ``logs``), but :meth:`plot` draws the histogram of ``||g_i|| / B`` of every
    variable at one epoch, with the signal-to-noise ratio in the legend. Reads
    private data (module docstring); not added by default.
    """

    def plot(self, epoch: int = -1, bins: int = 20):
        """Histograms of the epoch at index ``epoch`` of ``history`` (default: last).
        Returns the matplotlib ``Figure`` (Agg canvas)."""
        if not self.history:
            raise RuntimeError("nothing measured yet: train the model first.")
        stats = self.history[epoch]
        figure = new_figure((4.0 * len(stats), 3.2))
        for i, s in enumerate(stats):
            ax = figure.add_subplot(1, len(stats), i + 1)
            upper = max(1.0, float(np.max(s.ratios)))
            ax.hist(s.ratios, bins=bins, range=(0.0, upper), color="tab:blue", edgecolor="black")
            ax.axvline(1.0, color="tab:red", linestyle="--", label="bound")
            ax.set_title(f"{s.name}\nSNR {s.signal_to_noise:.3g}", fontsize="small")
            ax.set_xlabel("||g_i|| / bound")
            ax.legend(fontsize="small")
        figure.tight_layout()
        return figure


@dataclass
class AuditReport:
    """One run of :class:`SensitivityAudit`.

    Attributes:
        epoch: the epoch (``None`` outside training).
        gradient_ratios: ``{variable: max_i ||g_i|| / B_v}`` on the audit batch.
        operator_norms: the :class:`lipdp.clipless.audit.AuditRecord` of every constrained layer.
        violations: human-readable description of every violation (empty if sound).
    """

    epoch: int | None
    gradient_ratios: dict
    operator_norms: list
    violations: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def max_gradient_ratio(self) -> float:
        return max(self.gradient_ratios.values(), default=0.0)

    @property
    def max_operator_norm_ratio(self) -> float:
        return max((r.measured / r.declared for r in self.operator_norms), default=0.0)


class SensitivityAudit(keras.callbacks.Callback):
    """Checks the declared bounds at the end of every epoch (rules S1 and S4).

    Two independent measurements on the current weights:

    * the largest per-example gradient norm of every trainable variable on
      ``batch``, divided by its declared per-example bound (violation if above
      ``1 + tolerance``; the model's noise covers ``1 + ROUNDOFF_SLACK``);
    * the exact operator norm of every constrained kernel
      (:func:`lipdp.clipless.audit.audit_model`; violation if a layer is not ``ok``).

    The audit can only detect violations *on the batch given* (a sound bound is
    never exceeded; a passing audit does not prove soundness). **It reads private
    data** (module docstring); not added by default.

    Args:
        batch: ``(x, y)`` for the per-example gradients.
        raise_on_violation: raise :class:`lipdp.clipless.audit.SensitivityViolation`
            (which stops ``fit``) instead of logging a warning.
        tolerance: relative slack on the gradient ratios (default ``ROUNDOFF_SLACK``).
        audit_tolerance: tolerance of :func:`lipdp.clipless.audit.audit_model`.
        log_fn: optional callable receiving the :class:`AuditReport`.
        audit_kwargs: passed to :func:`lipdp.clipless.audit.audit_model` (e.g. ``input_shape``).

    Writes into the epoch ``logs``: ``audit_gradient_ratio`` (largest gradient
    ratio), ``audit_operator_norm_ratio`` (largest measured / declared operator
    norm) and ``audit_violations`` (their number). ``reports`` keeps every
    :class:`AuditReport`.
    """

    def __init__(
        self,
        batch,
        raise_on_violation: bool = False,
        tolerance: float = ROUNDOFF_SLACK,
        audit_tolerance: float = DEFAULT_TOLERANCE,
        log_fn=None,
        **audit_kwargs,
    ):
        super().__init__()
        if len(batch) != 2:
            raise ValueError("batch must be a pair (x, y).")
        self.x, self.y = batch
        self.raise_on_violation = bool(raise_on_violation)
        self.tolerance = float(tolerance)
        self.audit_tolerance = float(audit_tolerance)
        if log_fn is not None and not callable(log_fn):
            raise TypeError("log_fn must be callable.")
        self.log_fn = log_fn
        self.audit_kwargs = audit_kwargs
        self.reports: list[AuditReport] = []
        self._function = compiled_per_example_gradients()

    def run(self, epoch=None) -> AuditReport:
        """Audit ``self.model`` now; returns the report (never raises on violations)."""
        model = self.model
        entries = {variable_key(entry.variable): entry for entry in model.bounds().variables}
        ratios = {}
        gradients = per_example_variable_gradients(model, self.x, self.y, self._function)
        for v, g in zip(model.trainable_variables, gradients):
            norms = tf.norm(tf.reshape(g, (g.shape[0], -1)), axis=1)
            entry = entries[variable_key(v)]
            ratios[entry.key] = float(tf.reduce_max(norms)) / float(entry.bound)
        records = audit_model(model, tolerance=self.audit_tolerance, **self.audit_kwargs)
        violations = [
            f"{name}: per-example gradient norm {ratio:.6g} x its declared bound"
            for name, ratio in ratios.items()
            if ratio > 1.0 + self.tolerance
        ]
        bad = [r for r in records if not r.ok]
        if bad:
            violations += format_records(bad).splitlines()
        return AuditReport(epoch, ratios, records, violations)

    def on_epoch_end(self, epoch, logs=None):
        report = self.run(epoch)
        self.reports.append(report)
        if logs is not None:
            logs["audit_gradient_ratio"] = report.max_gradient_ratio
            logs["audit_operator_norm_ratio"] = report.max_operator_norm_ratio
            logs["audit_violations"] = len(report.violations)
        if self.log_fn is not None:
            self.log_fn(report)
        if report.ok:
            logger.info(
                "sensitivity audit, epoch %d: ok (gradient ratio %.4g, operator norm ratio %.6g)",
                epoch + 1,
                report.max_gradient_ratio,
                report.max_operator_norm_ratio,
            )
            return
        message = f"sensitivity audit, epoch {epoch + 1}: {len(report.violations)} violation(s):\n"
        message += "\n".join(report.violations)
        if self.raise_on_violation:
            raise SensitivityViolation(message, [r for r in report.operator_norms if not r.ok])
        logger.warning(message)


__all__ = [
    "per_example_variable_gradients",
    "compiled_per_example_gradients",
    "VariableStatistics",
    "gradient_statistics",
    "SignaltoNoiseAverage",
    "SignaltoNoiseHistogram",
    "AuditReport",
    "SensitivityAudit",
]
