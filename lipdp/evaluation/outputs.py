"""What every evaluation module reads from a model: its logits and probabilities, labels as
class indices, and a figure to draw on -- in one place, so that the evaluation modules
import this one and never each other."""

from __future__ import annotations

import numpy as np


def predict_logits(model, x, batch_size: int = 512) -> np.ndarray:
    """``model(x)`` in inference mode, batched, as a float64 array."""
    x = np.asarray(x, dtype=np.float32)
    out = [
        model(x[i : i + batch_size], training=False).numpy() for i in range(0, len(x), batch_size)
    ]
    return np.concatenate(out, axis=0).astype(np.float64)


def log_softmax(logits, scale: float = 1.0) -> np.ndarray:
    """``log softmax(scale * logits)`` along the last axis, float64.

    With ``m`` the largest entry and ``s = sum_{k != argmax} exp(z_k - m)``, the
    normaliser is ``m + log1p(s)``: the log-probability of the top class,
    ``-log1p(s)``, keeps its relative precision even when it is ``1e-20`` (a
    confidently classified example), where ``log(sum(exp(...)))`` would round it to 0.
    """
    z = scale * np.asarray(logits, dtype=np.float64)
    top = np.argmax(z, axis=-1)[..., None]
    m = np.take_along_axis(z, top, axis=-1)
    e = np.exp(z - m)
    np.put_along_axis(e, top, 0.0, axis=-1)
    return z - m - np.log1p(e.sum(axis=-1, keepdims=True))


def softmax(logits, scale: float = 1.0) -> np.ndarray:
    """``softmax(scale * logits)`` along the last axis (float64, stable)."""
    return np.exp(log_softmax(logits, scale))


def logit_scale(model) -> float:
    """The temperature of the model's compiled loss (``loss.tau``), else 1."""
    return float(getattr(getattr(model, "loss", None), "tau", 1.0))


def class_indices(labels) -> np.ndarray:
    """Labels as int64 class indices: one-hot rows ``(n, K)`` with ``K > 1`` by their
    argmax; indices of any shape ``(n,)``, ``(n, 1)`` as they are."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] > 1:
        return np.argmax(labels, axis=1)
    return labels.reshape(-1).astype(np.int64)


def new_figure(figsize=(5.0, 4.0)):
    """A matplotlib ``Figure`` drawn by the Agg canvas (no pyplot, no GUI backend:
    the process-wide matplotlib backend is left alone)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=figsize)
    FigureCanvasAgg(figure)
    return figure


__all__ = [
    "predict_logits",
    "log_softmax",
    "softmax",
    "logit_scale",
    "class_indices",
    "new_figure",
]
