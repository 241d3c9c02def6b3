r"""Certified robustness of Lipschitz classifiers.

A lipdp model is Lipschitz by construction: its layers declare their Lipschitz
constants to the bound propagation. This module turns those declarations into
*certificates* for the trained function.

Lipschitz constant of the function
----------------------------------
:func:`lipschitz_constant` reads the constant of the one bound pass
(:func:`lipdp.clipless.bounds.bound_pass`), which composes the layers' own
``propagate_lipschitz``. The constant of one layer is by default
``layer.backpropagate_inputs(X, 1.0)``: the bound on the cotangent at the layer
input for a unit cotangent at its output, i.e. a bound on the operator norm of the
layer's Jacobian at every input of norm at most ``X`` (the layer's input bound).
Since the model starts with :class:`~lipdp.clipless.layers.DP_BoundedInput`, a projection
onto a ball (1-Lipschitz on the whole space), every layer only ever sees inputs
within its input bound, and a bound on the Jacobian over a convex set is a
Lipschitz constant on that set. Two exceptions:

* :class:`~lipdp.clipless.layers.DP_ClipGradient` clips the *cotangent*, which is a property
  of the training procedure, not of the function (forward it is the identity):
  its constant is 1;
* residual blocks carry pairs ``(skip path, transformed path)``. The constants of
  the two paths with respect to the block input are tracked separately
  (``l1 = 1`` on the skip path, ``l2`` the product of the wrapped layers'
  constants) and the merge gives ``scale * (l1 + l2)`` with the merge layer's
  ``scale`` (1 for ``"add"``, 1/2 for ``"1-lip-add"``).

The result is an upper bound on the ``l2 -> l2`` Lipschitz constant of
``x -> logits`` *provided the weights satisfy their constraints*; the operator
norms of constrained kernels can be checked independently with
:func:`lipdp.clipless.audit.audit_model`.

Certificates
------------
If ``f`` is ``L``-Lipschitz (``l2 -> l2``), every logit difference
``f_i - f_j = (e_i - e_j)^T f`` is ``sqrt(2) L``-Lipschitz. Hence, with ``m`` the
gap between the largest and the second largest logit at ``x``, the predicted class
cannot change for any ``||delta|| < m / (sqrt(2) L)`` (Tsuzuku, Sato & Sugiyama,
*Lipschitz-Margin Training*, NeurIPS 2018). For a single-logit model (decision
``f(x) > 0``) the radius is ``|f(x)| / L``.

``certified_accuracy(model, x, y, radii)`` is the fraction of examples that are
correctly classified *and* certified at each radius ``r``: certified radius
``> r`` for ``r > 0`` (strict: at ``||delta|| = m / (sqrt(2) L)`` a tie is possible),
clean accuracy at ``r = 0``.

A :class:`~lipdp.clipless.layers.DP_GroupNormalization` (the scattering network of
``lipdp train``) makes ``L`` useless: it counts the layer's worst slope ``1 / alpha``
(``alpha = 1e-4`` there: ``L`` about 2 500 w.r.t. the pixels). For such a model
:func:`model_certified_radius` (and :func:`certified_accuracy` without an explicit
``lipschitz``) certify with the layer's slope on the ball around each example instead
(:mod:`lipdp.evaluation.local_certificates`), never a smaller radius.

Attacks
-------
:func:`pgd_attack` (projected gradient ascent on the margin loss over the ``l2`` or
``linf`` ball, several random restarts; the steps of :mod:`lipdp.core.adversarial`, which
adversarial training uses too) and :func:`empirical_lipschitz` (gradient ascent on
``||f(x) - f(x')|| / ||x - x'||``) give *lower* bounds on what an attacker can do:
they check that the certificates hold, never certify anything.
:func:`robust_accuracy` and :func:`robustness_curves` turn the attack into accuracy
against radius (next to the certified accuracy), :func:`plot_robustness_curves` draws
them.

Keras metrics
-------------
:class:`ScaledAUC` and :class:`CertifiableAUROC` (names of the original package).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from lipdp.clipless.bounds import bound_pass
from lipdp.core import adversarial
from lipdp.evaluation.outputs import class_indices, new_figure, predict_logits
from lipdp.foundation import validation

SQRT2 = math.sqrt(2.0)


# ------------------------------------------------------------------ Lipschitz constant
def lipschitz_constant(model) -> float:
    """Upper bound on the ``l2 -> l2`` Lipschitz constant of ``x -> model(x)``.

    The Lipschitz constant of the bound pass (:func:`lipdp.clipless.bounds.bound_pass`, module
    docstring): single-path layers multiply, residual blocks track one constant per path
    and merge them with the merge layer's factor,
    :class:`~lipdp.clipless.layers.DP_ClipGradient` counts 1.
    """
    return float(bound_pass(model.layers_forward_order()).lipschitz)


# ------------------------------------------------------------------------ certificates
def certified_radius(logits, lipschitz: float) -> np.ndarray:
    """Radius within which the decision at each example cannot change.

    ``(top1 - top2) / (sqrt(2) * lipschitz)`` for several logits,
    ``|f| / lipschitz`` for a single logit (decision ``f > 0``).
    """
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim == 1:
        logits = logits[:, None]
    if not lipschitz > 0:
        raise ValueError(f"lipschitz must be > 0, got {lipschitz}.")
    if logits.shape[1] == 1:
        return np.abs(logits[:, 0]) / lipschitz
    top2 = np.sort(logits, axis=1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]) / (SQRT2 * lipschitz)


def _predictions(logits) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim == 1 or logits.shape[1] == 1:
        return (logits.reshape(-1) > 0).astype(np.int64)
    return np.argmax(logits, axis=1)


def certified_accuracy_from_logits(logits, y, radii, lipschitz: float) -> np.ndarray:
    """Certified accuracy at each radius from precomputed logits (see
    :func:`certified_accuracy`)."""
    radii = np.atleast_1d(np.asarray(radii, dtype=np.float64))
    if np.any(radii < 0):
        raise ValueError("radii must be >= 0.")
    correct = _predictions(logits) == class_indices(y)
    radius = certified_radius(logits, lipschitz)
    return np.array([np.mean(correct & ((r == 0) | (radius > r))) for r in radii])


def certified_accuracy(model, x, y, radii, lipschitz: float | None = None, batch_size=512):
    """Fraction of ``(x, y)`` correctly classified and certified at each radius.

    Args:
        model: a lipdp model (or any model if ``lipschitz`` is given).
        x, y: examples and labels (integers or one-hot).
        radii: iterable of ``l2`` radii ``r >= 0`` in input space (the space of
            ``x`` as fed to the model, before the model's input clipping).
        lipschitz: a constant of the model: the global certificate with it. Default: the
            radii of :func:`model_certified_radius` (the local certificate of a model with
            a group normalisation, the global one with :func:`lipschitz_constant`
            otherwise).

    Returns:
        ``np.ndarray`` aligned with ``radii``; at ``r = 0`` the clean accuracy.
    """
    logits = predict_logits(model, x, batch_size)
    if lipschitz is not None:
        return certified_accuracy_from_logits(logits, y, radii, lipschitz)
    radius, _ = model_certified_radius(model, x, batch_size, logits=logits)
    return certified_accuracy_from_radius(logits, y, radii, radius)


def certified_accuracy_from_radius(logits, y, radii, radius) -> np.ndarray:
    """Certified accuracy at each of ``radii`` from each example's certified ``radius``
    (correct and ``radius > r``; the clean accuracy at ``r = 0``)."""
    radii = np.atleast_1d(np.asarray(radii, dtype=np.float64))
    if np.any(radii < 0):
        raise ValueError("radii must be >= 0.")
    correct = _predictions(logits) == class_indices(y)
    radius = np.asarray(radius, dtype=np.float64)
    return np.array([np.mean(correct & ((r == 0) | (radius > r))) for r in radii])


def model_certified_radius(model, x, batch_size=512, logits=None):
    """Each example's certified ``l2`` radius in the space of ``x`` (raw inputs, as fed to
    the model) and the certificate used: ``"local"`` for a model with one group
    normalisation (:mod:`lipdp.evaluation.local_certificates`: its slope around each
    example instead of its worst case ``1 / alpha``; never smaller), ``"global"``
    (``margin / (sqrt(2) L)``, :func:`lipschitz_constant`) otherwise.

    Returns:
        ``(radius, kind)``: an ``np.ndarray`` of radii and ``"local"`` or ``"global"``.
    """
    from lipdp.evaluation.local_certificates import local_certified_radius

    local = local_certified_radius(model, x, batch_size)
    if local is not None:
        return local, "local"
    if logits is None:
        logits = predict_logits(model, x, batch_size)
    return certified_radius(logits, lipschitz_constant(model)), "global"


# ----------------------------------------------------------------------------- attacks
def _margin_loss(logits, labels):
    """``max_{j != y} f_j - f_y`` (positive iff misclassified); ``-(2y-1) f`` for one logit."""
    if logits.shape[-1] == 1:
        sign = 2.0 * tf.cast(labels, logits.dtype) - 1.0
        return -sign * logits[:, 0]
    onehot = tf.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    true = tf.reduce_sum(onehot * logits, axis=1)
    other = tf.reduce_max(logits - 1e9 * onehot, axis=1)
    return other - true


def _as_row_radius(radius, n, rank):
    """``radius`` (a scalar or one per example) as a ``(n, 1, ..., 1)`` float32 tensor."""
    values = np.broadcast_to(np.asarray(radius, dtype=np.float32), (n,))
    if np.any(values < 0) or not np.all(np.isfinite(values)):
        raise ValueError(f"radius must be finite and >= 0, got {radius!r}.")
    return tf.reshape(tf.constant(values), (n,) + (1,) * (rank - 1))


def pgd_attack(
    model,
    x,
    y,
    radius,
    norm: str = "l2",
    steps: int = 50,
    step_size=None,
    restarts: int = 5,
    seed: int = 0,
    clip_values=None,
    batch_size: int = 512,
):
    """Untargeted PGD within the ``norm`` ball of ``radius`` around each example.

    Maximises the margin loss ``max_{j != y} f_j(x') - f_y(x')`` by the steps of
    :func:`lipdp.core.adversarial.pgd_step` (normalised gradient for ``"l2"``, its sign for
    ``"linf"``), projected onto ``||x' - x|| <= radius`` and, with ``clip_values=(lo,
    hi)``, onto the box (default: none; the certificates hold on the whole space). The
    first restart starts at ``x``, the others at a uniformly random point of the ball; the
    iterate with the largest margin loss over all steps and restarts is kept for each
    example (the attack is evaluated after every step, so more steps never weaken it).

    Args:
        radius: a scalar or one radius per example.
        norm: ``"l2"`` or ``"linf"``.
        step_size: default ``2.5 * radius / steps``.
        batch_size: examples attacked at once.

    Returns:
        ``(x_adv, margin)``: the adversarial examples (numpy) and their margin loss;
        ``margin >= 0`` means the attack changed the decision (or made a tie).
    """
    validation.choice("norm", norm, adversarial.NORMS)
    steps = validation.count("steps", steps, minimum=1)
    restarts = validation.count("restarts", restarts, minimum=1)
    x = np.asarray(x, dtype=np.float32)
    labels = class_indices(y)
    radius = np.broadcast_to(np.asarray(radius, dtype=np.float32), (len(x),))
    rng = tf.random.Generator.from_seed(seed)

    @tf.function(reduce_retracing=True)
    def margin_and_gradient(points, labels):
        with tf.GradientTape() as tape:
            tape.watch(points)
            margin = _margin_loss(model(points, training=False), labels)
            total = tf.reduce_sum(margin)
        return margin, tape.gradient(total, points)

    out_x, out_margin = [], []
    for i in range(0, len(x), batch_size):
        xb = tf.constant(x[i : i + batch_size])
        lb = tf.constant(labels[i : i + batch_size])
        rb = _as_row_radius(radius[i : i + batch_size], xb.shape[0], len(xb.shape))
        alpha = 2.5 * rb / steps if step_size is None else tf.cast(step_size, tf.float32)
        best_x, best = _attack_batch(
            margin_and_gradient, xb, lb, rb, norm, steps, alpha, restarts, rng, clip_values
        )
        out_x.append(best_x.numpy())
        out_margin.append(best.numpy())
    return np.concatenate(out_x), np.concatenate(out_margin)


def _attack_batch(margin_and_gradient, x, labels, radius, norm, steps, alpha, restarts, rng, box):
    shape = (x.shape[0],) + (1,) * (len(x.shape) - 1)
    best, _ = margin_and_gradient(x, labels)
    best_x = x
    for restart in range(restarts):
        if restart == 0:
            delta = tf.zeros_like(x)
        else:
            delta = adversarial.random_start(x, norm, radius, generator=rng)
        delta = adversarial.in_box(x, delta, box, norm, radius)
        for _ in range(steps):
            _, grad = margin_and_gradient(x + delta, labels)
            delta = adversarial.pgd_step(delta, grad, norm, radius, alpha)
            delta = adversarial.in_box(x, delta, box, norm, radius)
            margin, _ = margin_and_gradient(x + delta, labels)
            better = margin > best
            best = tf.where(better, margin, best)
            best_x = tf.where(tf.reshape(better, shape), x + delta, best_x)
    return best_x, best


def pgd_l2_attack(
    model, x, y, radius, steps: int = 50, step_size=None, restarts: int = 5, seed: int = 0
):
    """:func:`pgd_attack` with ``norm="l2"`` (the name of earlier releases)."""
    return pgd_attack(model, x, y, radius, "l2", steps, step_size, restarts, seed)


def robust_accuracy(
    model, x, y, radii, norm="l2", steps=50, restarts=1, seed=0, clip_values=None
) -> np.ndarray:
    """Fraction of ``(x, y)`` still correctly classified after :func:`pgd_attack` at each
    radius (clean accuracy at ``r = 0``). An *upper* bound on the true robust accuracy
    (a stronger attack can only lower it); for a Lipschitz model the certified accuracy
    is a lower bound, so ``certified <= robust`` at every ``l2`` radius."""
    radii = np.atleast_1d(np.asarray(radii, dtype=np.float64))
    if np.any(radii < 0):
        raise ValueError("radii must be >= 0.")
    labels = class_indices(y)
    result = []
    for r in radii:
        if r == 0:
            result.append(float(np.mean(_predictions(predict_logits(model, x)) == labels)))
            continue
        _, margin = pgd_attack(
            model, x, labels, r, norm, steps, None, restarts, seed, clip_values=clip_values
        )
        result.append(float(np.mean(margin < 0)))
    return np.array(result)


def robustness_curves(
    model, x, y, radii, norms=("l2", "linf"), steps=50, restarts=1, seed=0, certified=None
) -> dict:
    """Clean, PGD-robust and (Lipschitz models) certified accuracy at each radius.

    Returns ``{"radii": [...], "pgd_l2": [...], "pgd_linf": [...], "certified_l2": [...],
    "certified_linf": [...]}`` (PGD keys for the ``norms`` asked). ``certified``: ``True``
    for a lipdp (Lipschitz) model, ``False`` otherwise; default: whether the model has a
    bound pass (``bounds``). The ``linf`` certificate uses the ``l2`` ball of radius ``r
    sqrt(d)`` that contains the ``linf`` ball (:func:`lipdp.core.adversarial.matching_l2_radius`).
    """
    radii = [float(r) for r in np.atleast_1d(radii)]
    curves = {"radii": radii}
    for norm in norms:
        curves[f"pgd_{norm}"] = robust_accuracy(
            model, x, y, radii, norm, steps, restarts, seed
        ).tolist()
    if certified is None:
        certified = callable(getattr(model, "bounds", None))
    if certified:
        logits = predict_logits(model, x)
        radius, _ = model_certified_radius(model, x, logits=logits)
        dim = int(np.prod(np.asarray(x).shape[1:]))
        curves["certified_l2"] = certified_accuracy_from_radius(logits, y, radii, radius).tolist()
        if "linf" in norms:
            wide = [adversarial.matching_l2_radius(r, dim) if r > 0 else 0.0 for r in radii]
            curves["certified_linf"] = certified_accuracy_from_radius(
                logits, y, wide, radius
            ).tolist()
    return curves


def plot_robustness_curves(curves: dict, ax=None, label: str | None = None):
    """Accuracy against radius, one line per entry of :func:`robustness_curves` (PGD
    solid, certified dashed). Returns the Axes."""
    if ax is None:
        ax = new_figure().add_subplot()
    prefix = f"{label}: " if label else ""
    for key, values in curves.items():
        if key == "radii":
            continue
        style = "--" if key.startswith("certified") else "-"
        ax.plot(curves["radii"], values, style, marker="o", label=prefix + key.replace("_", " "))
    ax.set_xlabel("radius")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.legend()
    return ax


def empirical_lipschitz(
    model, x, steps: int = 50, step_size: float = 0.05, min_distance: float = 1e-2, seed=0
):
    """Largest ratio ``||f(a) - f(b)|| / ||a - b||`` found by gradient ascent.

    Starts from the pairs ``(x, x + small random delta)`` and ascends the ratio in
    both points (normalised steps of relative size ``step_size``). The two points
    are kept at least ``min_distance`` apart: float32 round-off in ``f(a) - f(b)``
    would otherwise dominate the ratio. A *lower* bound on the Lipschitz
    constant, to compare with :func:`lipschitz_constant`.

    Returns:
        the per-pair largest ratio seen (numpy, one entry per example of ``x``).
    """
    rng = np.random.default_rng(seed)
    a = tf.Variable(np.asarray(x, dtype=np.float32))
    noise = rng.normal(size=a.shape).astype(np.float32)
    # float32 under numpy 2 too (a numpy float64 scalar no longer adapts to the array).
    b = tf.Variable((a.numpy() + 0.1 * noise / np.sqrt(noise[0].size)).astype(np.float32))
    axes = list(range(1, len(a.shape)))

    def ratios():
        num = tf.norm(
            tf.reshape(model(a, training=False) - model(b, training=False), (a.shape[0], -1)),
            axis=1,
        )
        den = tf.sqrt(tf.reduce_sum(tf.square(a - b), axis=axes))
        return num / tf.maximum(den, 1e-12)

    best = ratios().numpy()
    for _ in range(steps):
        with tf.GradientTape() as tape:
            objective = tf.reduce_sum(ratios())
        for var, grad in zip((a, b), tape.gradient(objective, [a, b])):
            if grad is None:
                continue
            norm = tf.sqrt(tf.reduce_sum(tf.square(grad), axis=axes, keepdims=True))
            scale = tf.sqrt(tf.reduce_sum(tf.square(var), axis=axes, keepdims=True)) + 1e-3
            var.assign_add(step_size * scale * grad / tf.maximum(norm, 1e-12))
        diff = b - a
        dist = tf.sqrt(tf.reduce_sum(tf.square(diff), axis=axes, keepdims=True))
        b.assign(a + diff * tf.maximum(1.0, min_distance / tf.maximum(dist, 1e-12)))
        best = np.maximum(best, ratios().numpy())
    return best


# ----------------------------------------------------------------------------- metrics
class ScaledAUC(keras.metrics.AUC):
    """Keras ``AUC`` of logits multiplied by ``scale``.

    The exact AUROC does not change when the scores are multiplied by a positive
    factor, but Keras estimates it with a fixed grid of ``num_thresholds``
    thresholds in ``[0, 1]`` applied after a sigmoid (``from_logits=True``, forced
    here). A Lipschitz network outputs logits of small magnitude, which the sigmoid
    maps into a few buckets around 0.5, and the estimate degrades. Multiplying the
    logits by ``scale`` (e.g. the temperature ``tau`` of the loss) spreads them
    over the grid.

    Args:
        scale: positive factor applied to ``y_pred``.
        name, **kwargs: as ``keras.metrics.AUC`` (``from_logits`` must be True).
    """

    def __init__(self, scale=1.0, name="auc", **kwargs):
        if kwargs.get("from_logits", True) is False:
            raise ValueError("ScaledAUC works on logits: from_logits must be True.")
        kwargs["from_logits"] = True
        if not float(scale) > 0:
            raise ValueError(f"scale must be > 0, got {scale}.")
        super().__init__(name=name, **kwargs)
        self.scale = float(scale)

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = tf.cast(y_pred, tf.float32) * self.scale
        return super().update_state(y_true, y_pred, sample_weight=sample_weight)

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


class CertifiableAUROC(ScaledAUC):
    r"""AUROC that no perturbation of norm at most ``radius`` can decrease.

    For a score ``s`` (a logit) that is ``lipschitz``-Lipschitz in the input and a
    label ``y`` in ``{0, 1}``, every perturbation ``||delta|| <= radius`` keeps
    ``s(x + delta)`` within ``s(x) +- lipschitz * radius``. The metric is the AUROC
    (Keras estimate, as :class:`ScaledAUC`) of the *worst-case* scores

    .. math:: s_r(x) = s(x) - (2y - 1) \cdot \mathrm{lipschitz} \cdot \mathrm{radius},

    positives moved down and negatives moved up by the largest amount allowed.
    Any pair (positive, negative) ranked correctly by ``s_r`` stays ranked correctly
    whatever the perturbations of the two examples, so this is a lower bound on the
    AUROC under any adversarial perturbation of the test points within ``radius``
    (a *certified* AUROC); ``radius = 0`` gives the plain AUROC.

    With several outputs (one-hot ``y_true``, ``multi_label=False``) the shift is
    applied to every entry: each logit of an ``L``-Lipschitz model is
    ``L``-Lipschitz. Pass ``lipschitz=lipschitz_constant(model)`` for a model whose
    constant is not 1.

    Args:
        radius: the ``l2`` radius ``>= 0`` in input space.
        lipschitz: Lipschitz constant of the scores (default 1, as lipdp models
            built from 1-Lipschitz layers).
        scale: multiplies the scores before the sigmoid (see :class:`ScaledAUC`).
    """

    def __init__(self, radius, lipschitz=1.0, scale=1.0, name="certifiable_auroc", **kwargs):
        if not float(radius) >= 0:
            raise ValueError(f"radius must be >= 0, got {radius}.")
        if not float(lipschitz) > 0:
            raise ValueError(f"lipschitz must be > 0, got {lipschitz}.")
        super().__init__(scale=scale, name=name, **kwargs)
        self.radius = float(radius)
        self.lipschitz = float(lipschitz)

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = tf.cast(y_pred, tf.float32)
        sign = 2.0 * tf.cast(tf.reshape(y_true, tf.shape(y_pred)), tf.float32) - 1.0
        worst = y_pred - sign * (self.lipschitz * self.radius)
        return super().update_state(y_true, worst, sample_weight=sample_weight)

    def get_config(self):
        return {**super().get_config(), "radius": self.radius, "lipschitz": self.lipschitz}


__all__ = [
    "lipschitz_constant",
    "certified_radius",
    "certified_accuracy",
    "certified_accuracy_from_logits",
    "certified_accuracy_from_radius",
    "model_certified_radius",
    "pgd_attack",
    "pgd_l2_attack",
    "robust_accuracy",
    "robustness_curves",
    "plot_robustness_curves",
    "empirical_lipschitz",
    "ScaledAUC",
    "CertifiableAUROC",
]
