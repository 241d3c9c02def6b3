r"""Adversarial examples by projected gradient ascent (PGD), for training and evaluation.

One implementation of the attack: :class:`PGD` is the ``adversarial=`` option of both model
families (:class:`lipdp.clipless.model.DP_Model`, :class:`lipdp.clipped.model.DPSGD_Model`), and
:func:`lipdp.evaluation.robustness.pgd_attack` runs the same steps (:func:`pgd_step`) with
restarts to measure robustness.

The attack (Madry et al., *Towards Deep Learning Models Resistant to Adversarial
Attacks*, 2018)
----------------------------------------------------------------------------------------
For each row ``x_i`` of a batch, ``x'_i = x_i + delta_i`` with ``delta_i`` in the ball
``||delta|| <= r`` (``"l2"`` or ``"linf"``): from ``delta = 0`` or a uniform random point of
the ball, ``steps`` ascent steps on the row's loss ``ell(f(x_i + delta), y_i)``,

* ``"l2"``: ``delta <- P(delta + alpha g / ||g||_2)``, ``P`` the projection on the ball
  (rescaling to norm ``r``);
* ``"linf"``: ``delta <- clip(delta + alpha sign(g), -r, r)``;

``g`` the gradient of the row's loss with respect to its input, ``alpha`` the step size
(``2.5 r / steps`` by default). With ``clip_values=(lo, hi)`` the point is also kept in
the box: ``delta <- clip(x + delta, lo, hi) - x``, which never moves a coordinate farther
from ``x`` (for ``x`` in the box), so the result stays in the ball (for ``x`` outside the
box, the ball projection that follows keeps ``||delta|| <= r``).

Why adversarial training keeps the privacy guarantee
----------------------------------------------------
The attack of row ``i`` reads the row ``(x_i, y_i)``, the current weights and public
constants, nothing else: the gradient of ``sum_j ell_j`` with respect to ``x_i`` is the
gradient of ``ell_i`` alone, since no layer couples the rows (batch normalisation is
refused by both families; the gradient of a row is its own, ``tests/core/test_adversarial.py``
checks that a row attacked alone gives the same point). The weights are the output of
the earlier noisy steps, a release already paid for. So ``x_i -> x'_i`` is a
per-example transformation, and row ``i``'s training loss

    ``L_i(theta) = (1 - w) ell(f_theta(x_i), y_i) + w ell(f_theta(x'_i), y_i)``

(``w = mix``; ``x'_i`` held constant, Danskin's theorem) depends on row ``i`` alone. What
is left is to bound its gradient:

* **clipless** (:class:`lipdp.clipless.model.DP_Model`): the first layer,
  :class:`~lipdp.clipless.layers.DP_BoundedInput`, projects ``x'_i`` onto the input ball of radius
  ``X`` exactly as it does ``x_i``; every per-layer bound holds for *any* input, so each
  term's gradient is at most the bound ``B_v`` of variable ``v`` and, by the triangle
  inequality, ``||grad_v L_i|| <= (1 - w) B_v + w B_v = B_v``. Cotangent clipping
  (:class:`~lipdp.clipless.layers.DP_ClipGradient`) clips each pass's cotangents at its own share
  (``(1 - w) C`` and ``w C``: the pass runs with the loss normaliser divided by its
  weight), so the sum of the two clipped parts stays within ``C``.
* **clipped** (:class:`lipdp.clipped.model.DPSGD_Model`): with ``w = 1`` the row's gradient at
  ``x'_i`` is clipped as any row's. With ``w < 1`` the clean and the adversarial
  gradients are clipped separately (each to norm ``<= R`` by the mode's rule) and
  weighted ``1 - w`` and ``w``: the sum is at most ``R``.

Sensitivity, noise and epsilon are therefore those of training without the attack
(``tests/core/test_adversarial.py``: per-example ratios under adversarial search, epsilon
identical). The random start draws from TensorFlow's generator: it is not privacy noise
and need not be secret.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tensorflow as tf

from lipdp.core.records import finite_rows, zero_rows
from lipdp.foundation import validation
from lipdp.foundation.config import Config

#: The balls of the attack.
NORMS = ("l2", "linf")


# ----------------------------------------------------------------------------- steps
def _row_shape(x):
    """``(rows, 1, ..., 1)``: a per-row scalar broadcast over an example's entries."""
    return tf.concat([tf.shape(x)[:1], tf.ones([tf.rank(x) - 1], tf.int32)], axis=0)


def _row_norms(t):
    """Euclidean norm of each row, shaped ``(rows, 1, ..., 1)``."""
    axes = list(range(1, len(t.shape)))
    return tf.sqrt(tf.reduce_sum(tf.square(t), axis=axes, keepdims=True))


def project(delta, norm, radius):
    """``delta`` projected row by row onto the ``norm`` ball of ``radius`` (a scalar or a
    ``(rows, 1, ..., 1)`` tensor)."""
    radius = tf.cast(radius, delta.dtype)
    if norm == "linf":
        return tf.clip_by_value(delta, -radius, radius)
    factor = tf.minimum(1.0, radius / tf.maximum(_row_norms(delta), 1e-12))
    return delta * factor


def ascent_direction(grad, norm):
    """The steepest-ascent direction of unit ``norm``: ``g / ||g||_2`` (0 for a zero row)
    or ``sign(g)``."""
    if norm == "linf":
        return tf.sign(grad)
    return grad / tf.maximum(_row_norms(grad), 1e-12)


def random_start(x, norm, radius, generator=None):
    """A uniform random point of the ball around 0, one per row of ``x`` (drawn from
    ``generator``, a ``tf.random.Generator``, or TensorFlow's global random ops)."""
    uniform = tf.random.uniform if generator is None else generator.uniform
    normal = tf.random.normal if generator is None else generator.normal
    radius = tf.cast(radius, x.dtype)
    if norm == "linf":
        return uniform(tf.shape(x), -1.0, 1.0, dtype=x.dtype) * radius
    direction = normal(tf.shape(x), dtype=x.dtype)
    direction = direction / tf.maximum(_row_norms(direction), 1e-12)
    dim = tf.cast(tf.reduce_prod(tf.shape(x)[1:]), x.dtype)
    # Uniform in the ball: the radius of a uniform point has CDF (t / r)^dim.
    scale = uniform(_row_shape(x), dtype=x.dtype) ** (1.0 / dim)
    return direction * scale * radius


def in_box(x, delta, clip_values, norm, radius):
    """``delta`` moved so that ``x + delta`` lies in the box ``clip_values`` (if any), then
    projected on the ball. For ``x`` in the box the box step never lengthens ``delta`` and
    the projection does nothing; for ``x`` outside it (data outside its declared range)
    the ball wins: ``||delta|| <= radius`` always holds."""
    if clip_values is None:
        return delta
    low, high = clip_values
    return project(tf.clip_by_value(x + delta, low, high) - x, norm, radius)


def pgd_step(delta, grad, norm, radius, step_size):
    """One PGD step: ``P(delta + step_size * direction(grad))``."""
    return project(delta + step_size * ascent_direction(grad, norm), norm, radius)


# ------------------------------------------------------------------------ training
@dataclass(frozen=True)
class PGD(Config):
    """Adversarial training by PGD (module docstring): every training row is replaced by
    (or mixed with) its adversarial version, computed inside the training step from the
    current weights.

    Attributes:
        radius: ``r > 0``, the radius of the ball in input space (before the model's
            input clipping).
        norm: ``"l2"`` (default) or ``"linf"``.
        steps: ascent steps (>= 1).
        step_size: ``alpha``; default ``2.5 r / steps``.
        random_start: start from a uniform random point of the ball (default) or from
            ``x``.
        mix: ``w`` in ``(0, 1]``, the weight of the adversarial loss: each row's loss is
            ``(1 - w) ell(x) + w ell(x')`` (1: adversarial examples only, as Madry et
            al.; 0.5: Goodfellow et al.'s half and half). ``w < 1`` costs a second forward
            and backward pass.
        clip_values: ``(low, high)``: keep ``x'`` in this box (e.g. ``(0, 1)`` for
            pixels); ``None`` (default): no box.
        trades_beta: ``beta > 0`` for the TRADES loss of Zhang et al. (2019), row ``i``'s
            loss ``ell(f(x_i), y_i) + beta KL(p(x_i) || p(x'_i))`` (``p``: softmax of the
            logits), ``x'_i`` maximising the KL term (random start required) — clipped
            family only, with ``gradient_method="jacobian"`` (the loss couples two
            forward passes of the row); ``mix`` is then unused. The clipless family
            refuses it: the KL term's gradient with respect to the clean logits, ``p_k
            (log p_k - log q_k - KL)``, has no bound. ``None`` (default): no TRADES.
    """

    argument_name = "adversarial"

    radius: float
    norm: str = "l2"
    steps: int = 10
    step_size: float | None = None
    random_start: bool = True
    mix: float = 1.0
    clip_values: tuple | None = None
    trades_beta: float | None = None

    def __post_init__(self):
        self._set("radius", validation.positive("PGD radius", self.radius))
        validation.choice("PGD norm", self.norm, NORMS)
        self._set("steps", validation.count("PGD steps", self.steps, minimum=1))
        if self.step_size is not None:
            self._set("step_size", validation.positive("PGD step_size", self.step_size))
        self._set("random_start", bool(self.random_start))
        mix = validation.real("PGD mix", self.mix, low=0.0, high=1.0, high_open=False)
        self._set("mix", mix)
        if self.clip_values is not None:
            low, high = (validation.real("PGD clip_values", v) for v in self.clip_values)
            if not low < high:
                raise ValueError(
                    f"PGD clip_values must be (low, high) with low < high, got "
                    f"{self.clip_values!r}."
                )
            self._set("clip_values", (low, high))
        if self.trades_beta is not None:
            self._set("trades_beta", validation.positive("PGD trades_beta", self.trades_beta))
            if not self.random_start:
                raise ValueError(
                    "TRADES needs random_start=True: the KL term and its gradient are 0 at x."
                )

    @property
    def alpha(self) -> float:
        """The step size: ``step_size`` or ``2.5 r / steps``."""
        return self.step_size if self.step_size is not None else 2.5 * self.radius / self.steps

    def describe(self) -> str:
        """One line for logs and reports."""
        box = "" if self.clip_values is None else f", box {self.clip_values}"
        loss = f"TRADES beta {self.trades_beta:g}" if self.trades_beta else f"mix {self.mix:g}"
        return (
            f"PGD {self.norm} radius {self.radius:g}, {self.steps} steps of {self.alpha:.3g}"
            f"{', random start' if self.random_start else ''}, {loss}{box}"
        )

    def perturb(self, row_losses, x):
        """The adversarial version of every row of ``x`` (no gradient flows through it).

        ``row_losses(x)`` returns the ``(rows,)`` losses of the rows of ``x`` (the
        model's loss at its current weights); their sum is ascended, which ascends each
        row's own loss since no layer couples the rows. Rows holding a NaN or an infinity
        are returned unchanged (the model neutralises them, rule S9).
        """
        if isinstance(x, (tuple, list, dict)):
            raise ValueError(
                "Adversarial training needs a single input tensor (got a nested input): "
                "the PGD ball is defined on one tensor."
            )
        x = tf.stop_gradient(tf.convert_to_tensor(x))
        finite = finite_rows(x)
        mask = tf.reshape(finite, _row_shape(x))
        clean = zero_rows(finite, x)
        delta = random_start(clean, self.norm, self.radius) if self.random_start else None
        delta = tf.zeros_like(clean) if delta is None else delta
        delta = in_box(clean, delta, self.clip_values, self.norm, self.radius)

        def step(i, delta):
            with tf.GradientTape() as tape:
                tape.watch(delta)
                total = tf.reduce_sum(row_losses(clean + delta))
            grad = tape.gradient(total, delta)
            grad = tf.zeros_like(delta) if grad is None else grad
            grad = tf.where(tf.math.is_finite(grad), grad, tf.zeros((), grad.dtype))
            delta = pgd_step(delta, grad, self.norm, self.radius, self.alpha)
            return i + 1, in_box(clean, delta, self.clip_values, self.norm, self.radius)

        _, delta = tf.while_loop(
            lambda i, _: i < self.steps, step, (tf.constant(0), delta), parallel_iterations=1
        )
        return tf.stop_gradient(tf.where(mask, clean + delta, x))


def softmax_kl(clean_logits, adversarial_logits):
    """``KL(p || q)`` per row, ``p`` and ``q`` the softmax of the two logits (TRADES)."""
    log_p = tf.nn.log_softmax(clean_logits, axis=-1)
    log_q = tf.nn.log_softmax(adversarial_logits, axis=-1)
    return tf.reduce_sum(tf.exp(log_p) * (log_p - log_q), axis=-1)


def matching_l2_radius(linf_radius: float, dim: int) -> float:
    """``r sqrt(d)``: the ``l2`` ball that contains the ``linf`` ball of radius ``r`` in
    ``d`` dimensions (a Lipschitz certificate at that ``l2`` radius covers every ``linf``
    perturbation of size ``r``)."""
    return float(validation.positive("linf_radius", linf_radius)) * math.sqrt(
        validation.count("dim", dim, minimum=1)
    )


__all__ = [
    "NORMS",
    "PGD",
    "ascent_direction",
    "in_box",
    "matching_l2_radius",
    "pgd_step",
    "project",
    "random_start",
    "softmax_kl",
]
