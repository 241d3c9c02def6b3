r"""Calibration of the predicted probabilities.

Bu, Wang, Dai & Long (*On the Convergence and Calibration of Deep Learning with
Differential Privacy*, TMLR 2023) show that DP training (with per-sample clipping)
can leave classifiers badly mis-calibrated, and measure it with the expected and
maximum calibration errors of Guo et al. (*On Calibration of Modern Neural
Networks*, ICML 2017). The same quantities are computed here.

For ``n`` examples with predicted distributions ``p_i``, confidence
``c_i = max_k p_ik``, prediction ``argmax_k p_ik`` and correctness ``a_i`` (1 if the
prediction is the label):

* equal-width confidence bins ``B_m = ((m-1)/M, m/M]`` for ``m = 1..M`` (a
  confidence of exactly 0 goes into ``B_1``);
* ``acc(B_m)`` = mean of ``a_i`` and ``conf(B_m)`` = mean of ``c_i`` over the bin;
* ``ECE = sum_m |B_m| / n * |acc(B_m) - conf(B_m)|``;
* ``MCE = max_m |acc(B_m) - conf(B_m)|`` over the non-empty bins;
* ``NLL = -mean_i log p_{i, y_i}`` (probabilities floored at ``eps``).

A Lipschitz network trained with ``DP_TauCategoricalCrossentropy(tau)`` models the
distribution ``softmax(tau * logits)``: :func:`predict_probabilities` uses the
``tau`` of the compiled loss by default.

Evaluating calibration on *training* data touches private data; on a held-out
public or test set it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lipdp.evaluation.outputs import logit_scale, new_figure, predict_logits, softmax

DEFAULT_BINS = 15


def predict_probabilities(model, x, scale: float | None = None, batch_size: int = 512):
    """``softmax(scale * model(x))``; ``scale`` defaults to :func:`logit_scale`."""
    if scale is None:
        scale = logit_scale(model)
    return softmax(predict_logits(model, x, batch_size), scale)


def _check(probs, labels):
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape (n, classes), got {probs.shape}.")
    labels = np.asarray(labels)
    if labels.ndim == 2:
        labels = np.argmax(labels, axis=1)
    labels = labels.reshape(-1).astype(np.int64)
    if len(labels) != len(probs):
        raise ValueError(f"{len(probs)} predictions for {len(labels)} labels.")
    if len(probs) == 0:
        raise ValueError("no examples.")
    return probs, labels


@dataclass
class ReliabilityDiagram:
    """Per-bin data of a reliability diagram (``M`` equal-width confidence bins).

    Attributes:
        edges: ``M + 1`` bin edges ``0, 1/M, ..., 1``.
        counts: number of examples per bin.
        confidence: mean confidence per bin (``nan`` for an empty bin).
        accuracy: accuracy per bin (``nan`` for an empty bin).
    """

    edges: np.ndarray
    counts: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray

    @property
    def gaps(self) -> np.ndarray:
        """``|accuracy - confidence|`` per bin (``nan`` for empty bins)."""
        return np.abs(self.accuracy - self.confidence)

    @property
    def ece(self) -> float:
        filled = self.counts > 0
        weights = self.counts[filled] / self.counts.sum()
        return float(np.sum(weights * self.gaps[filled]))

    @property
    def mce(self) -> float:
        return float(np.max(self.gaps[self.counts > 0]))


def reliability_diagram(probs, labels, n_bins: int = DEFAULT_BINS) -> ReliabilityDiagram:
    """Bin the confidences into ``n_bins`` equal-width bins ``((m-1)/M, m/M]``."""
    probs, labels = _check(probs, labels)
    if int(n_bins) < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}.")
    n_bins = int(n_bins)
    confidence = probs.max(axis=1)
    correct = (probs.argmax(axis=1) == labels).astype(np.float64)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    # right=True: edges[m-1] < c <= edges[m] -> bin m-1; c <= edges[1] -> bin 0.
    index = np.clip(np.digitize(confidence, edges[1:-1], right=True), 0, n_bins - 1)
    counts = np.bincount(index, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(index, weights=confidence, minlength=n_bins) / counts
        accuracy = np.bincount(index, weights=correct, minlength=n_bins) / counts
    return ReliabilityDiagram(edges, counts, mean_conf, accuracy)


def expected_calibration_error(probs, labels, n_bins: int = DEFAULT_BINS) -> float:
    """ECE with ``n_bins`` equal-width confidence bins (module docstring)."""
    return reliability_diagram(probs, labels, n_bins).ece


def maximum_calibration_error(probs, labels, n_bins: int = DEFAULT_BINS) -> float:
    """MCE: the largest ``|accuracy - confidence|`` over non-empty bins."""
    return reliability_diagram(probs, labels, n_bins).mce


def negative_log_likelihood(probs, labels, eps: float = 1e-12) -> float:
    """``-mean log p_{i, y_i}`` with probabilities floored at ``eps``."""
    probs, labels = _check(probs, labels)
    return float(-np.mean(np.log(np.maximum(probs[np.arange(len(labels)), labels], eps))))


@dataclass
class CalibrationReport:
    accuracy: float
    ece: float
    mce: float
    nll: float
    diagram: ReliabilityDiagram

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "ece": self.ece, "mce": self.mce, "nll": self.nll}


def calibration_report(probs, labels, n_bins: int = DEFAULT_BINS) -> CalibrationReport:
    """Accuracy, ECE, MCE, NLL and the reliability diagram in one pass."""
    probs, labels = _check(probs, labels)
    diagram = reliability_diagram(probs, labels, n_bins)
    return CalibrationReport(
        accuracy=float(np.mean(probs.argmax(axis=1) == labels)),
        ece=diagram.ece,
        mce=diagram.mce,
        nll=negative_log_likelihood(probs, labels),
        diagram=diagram,
    )


def plot_reliability_diagram(diagram, labels=None, n_bins: int = DEFAULT_BINS, title=None, ax=None):
    """Reliability diagram: accuracy per confidence bin against the diagonal.

    The hatched bar of a bin spans from its accuracy to its mean confidence: above the
    blue bar where the model is over-confident, inside it where it is under-confident.

    Args:
        diagram: a :class:`ReliabilityDiagram`, or probabilities ``(n, classes)``
            (then ``labels`` is required).
        title: optional title (ECE and MCE are appended).
        ax: a matplotlib ``Axes`` to draw into (e.g. one panel of a grid from
            :func:`new_figure`); default: a new figure with one ``Axes``.

    Returns:
        the matplotlib ``Figure`` holding the diagram (Agg canvas for a new one); save it
        with ``fig.savefig(path)``.
    """
    if not isinstance(diagram, ReliabilityDiagram):
        if labels is None:
            raise ValueError("labels are required when probabilities are given.")
        diagram = reliability_diagram(diagram, labels, n_bins)
    if ax is None:
        ax = new_figure().add_subplot(1, 1, 1)
    figure = ax.figure
    edges = diagram.edges
    width = np.diff(edges)
    filled = diagram.counts > 0
    ax.bar(
        edges[:-1][filled],
        diagram.accuracy[filled],
        width=width[filled],
        align="edge",
        edgecolor="black",
        color="tab:blue",
        label="accuracy",
    )
    ax.bar(
        edges[:-1][filled],
        (diagram.confidence - diagram.accuracy)[filled],
        bottom=diagram.accuracy[filled],
        width=width[filled],
        align="edge",
        color="tab:red",
        alpha=0.3,
        hatch="//",
        label="gap to confidence",
    )
    ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    summary = f"ECE {diagram.ece:.3f}, MCE {diagram.mce:.3f}"
    ax.set_title(f"{title}: {summary}" if title else summary)
    ax.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    return figure


__all__ = [
    "DEFAULT_BINS",
    "predict_probabilities",
    "ReliabilityDiagram",
    "reliability_diagram",
    "expected_calibration_error",
    "maximum_calibration_error",
    "negative_log_likelihood",
    "CalibrationReport",
    "calibration_report",
    "plot_reliability_diagram",
]
