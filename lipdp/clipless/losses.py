r"""Losses with a known Lipschitz constant, for DP training without per-sample clipping.

The sensitivity of a minibatch gradient is bounded analytically: the backward bound pass
starts from ``loss.get_L()``, an upper bound on the Euclidean norm of
:math:`\nabla_{z_i} \ell(y_i, z_i)` -- the gradient of ONE example's loss with respect to
that example's logits -- valid for every logit vector and every admissible label. An
under-estimated constant is a privacy leak, so every constant below is a proven upper
bound (derivation in each class docstring), tight unless noted.

Two rules hold for every loss of this module:

* **mean reduction** (S1): the minibatch loss a DP model trains on is the mean over the
  batch of per-example terms, so each example contributes ``get_L() / batch_size`` to the
  gradient. A loss accepts every Keras reduction when it is built (``NONE`` gives the
  per-example values, ``SUM`` their sum: useful outside training), but a DP model refuses
  at ``compile`` a loss whose reduction is not ``SUM_OVER_BATCH_SIZE`` (or ``AUTO``,
  which resolves to it). Sample weights outside ``[0, 1]`` and Keras masks (which
  rescale the per-example weights by ``batch_size / number_of_valid_entries``) are
  refused.
* **per-example terms** (S2): ``call(y_true, y_pred)`` returns a tensor of shape
  ``(batch,)`` whose entry ``i`` depends on example ``i`` only. Inputs of rank > 2 are
  reduced over every non-batch axis by a mean, which can only shrink the gradient norm:
  the mean of ``T`` terms over disjoint slices, each ``L``-Lipschitz, is
  ``L / sqrt(T)``-Lipschitz.

Labels are mapped into the admissible set inside ``call`` (identity on admissible
labels), so that the bound holds whatever tensor is passed as ``y_true``. An example
whose label holds a NaN or an infinity -- or, for a subclass taking class indices, an
index outside ``[0, K)`` -- has loss 0 and gradient 0 (rule S9, :meth:`DP_Loss.call`).

Table of constants (``K`` = number of classes / outputs of one example, ``tau`` =
temperature, ``a`` = ``alpha``, ``m`` = ``min_margin``):

=========================  ==========================  ====================================
loss                       per-example gradient        ``get_L()``
=========================  ==========================  ====================================
DP_TauCategorical-         ``softmax(tau z) - y``      ``sqrt(2)`` (tight for one-hot y)
Crossentropy(tau)
DP_TauBCE(tau)             ``(sigmoid(tau z) - y)/K``  ``1`` (``= 1/sqrt(K)`` at K=1)
DP_MulticlassHinge(m)      ``-(K-1)/K`` on the label,  ``sqrt((K-1)/K)`` if ``nb_classes``
                           ``+1/K`` elsewhere (active  given, else ``1`` (sup over K)
                           terms)
DP_MulticlassKR()          ``-1`` on the label,        ``sqrt(K/(K-1))`` if ``nb_classes``
                           ``+1/(K-1)`` elsewhere      given, else ``sqrt(2)`` (K = 2)
DP_MulticlassHKR(a, m)     KR + a * hinge (aligned)    ``sqrt(K/(K-1)) + a sqrt((K-1)/K)``
                                                       if ``nb_classes`` given, else
                                                       ``max(sqrt(2) + a/sqrt(2), 1 + a)``
DP_KCosineSimilarity(K)    ``-y^/K`` inside the ball   ``1/K``
                           ``||z|| <= K``
DP_MeanAbsoluteError()     ``sign(z - y)/K``           ``1`` (``= 1/sqrt(K)``, tight at K=1)
=========================  ==========================  ====================================

All the multiclass margin losses (hinge, KR, HKR) take the label as
``argmax(y_true)``: one-hot labels (and +-1 encoded ones) are handled exactly as in
deel-lip, and any other tensor still yields exactly one positive class, which is what the
constants above assume.

**Backends.** Every loss is written once with :func:`lipdp.foundation.compat.array_ops`
(``keras.ops``; the TensorFlow shim on Keras 2) and runs under ``jax.jit``: the number of
classes ``K`` is read from the static shape (and the tempered softmax is shifted before
its scaling on JAX, :func:`_scaled_log_softmax`); the only run-time checks left are TensorFlow's
for shapes unknown when a graph is traced (``tf.debugging`` asserts, never reached on JAX,
whose shapes are static) and the sample-weight check of :meth:`DP_Loss.__call__` (a
per-backend hook: an assert on TensorFlow, a host check on concrete JAX arrays, and the
weights mapped into ``[0, 1]`` -- a non-finite weight to 0 -- for traced ones, where no
value can be checked).
"""

from __future__ import annotations

import abc
import math

import keras

from lipdp.clipless import projections
from lipdp.core.records import is_floating, neutralised_losses
from lipdp.foundation import compat, validation

__all__ = [
    "DP_Loss",
    "DP_TauCategoricalCrossentropy",
    "DP_TauBCE",
    "DP_MulticlassHinge",
    "DP_MulticlassKR",
    "DP_MulticlassHKR",
    "DP_KCosineSimilarity",
    "DP_MeanAbsoluteError",
]

Reduction = compat.Reduction  # the names of Keras' loss reductions


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _nb_classes_or_none(value) -> int | None:
    return None if value is None else validation.count("`nb_classes`", value, minimum=2)


def _static_shape(x):
    """``x``'s static shape as a tuple (``None`` for unknown sizes), or ``None`` when even
    the rank is unknown (a TensorFlow graph only)."""
    shape = x.shape
    if getattr(shape, "rank", 0) is None:
        return None
    return tuple(shape)


def _compatible(a, b) -> bool:
    """Static shapes ``a``, ``b`` (:func:`_static_shape`) can be equal."""
    if a is None or b is None:
        return True
    return len(a) == len(b) and all(p is None or q is None or p == q for p, q in zip(a, b))


def _prepare(y_true, y_pred, min_classes: int = 1):
    """Convert inputs, cast ``y_true`` to ``y_pred``'s dtype and check shapes.

    ``y_pred`` must have rank >= 2 ((batch, ..., K)): reducing the last axis of a rank-1
    tensor would mix the examples of the batch.
    """
    ops = compat.array_ops()
    y_pred = ops.convert_to_tensor(y_pred)
    if not is_floating(y_pred.dtype):
        y_pred = ops.cast(y_pred, keras.backend.floatx())
    y_true = ops.cast(ops.convert_to_tensor(y_true), y_pred.dtype)
    shape, label_shape = _static_shape(y_pred), _static_shape(y_true)
    if shape is not None and len(shape) < 2:
        raise ValueError(
            "y_pred must have shape (batch_size, ..., K) with rank >= 2, got shape "
            f"{y_pred.shape}; reducing the last axis of a rank-1 tensor would mix the "
            "examples of the batch."
        )
    if not _compatible(label_shape, shape):
        raise ValueError(
            f"y_true and y_pred must have the same shape, got {y_true.shape} and {y_pred.shape}."
        )
    k = shape[-1] if shape is not None else None
    if k is not None and k < min_classes:
        raise ValueError(
            f"this loss needs at least {min_classes} classes on the last axis of y_pred, "
            f"got shape {y_pred.shape}."
        )
    return y_true, y_pred


def _per_example(values):
    """Mean over every non-batch axis: shape (batch, ...) -> (batch,)."""
    ops = compat.array_ops()
    shape = _static_shape(values)
    if shape is not None and len(shape) == 1:
        return values
    if shape is not None:
        return ops.mean(values, axis=tuple(range(1, len(shape))))
    flat = ops.reshape(values, (ops.shape(values)[0], -1))  # unknown rank: TensorFlow only
    return ops.mean(flat, axis=1)


def _relu(x):
    """``max(x, 0)`` (``tf.nn.relu`` on TensorFlow)."""
    return compat.array_ops().relu(x)


def _one_hot_argmax(y_true, y_pred):
    """One-hot encoding of ``argmax(y_true)`` on the last axis, depth = K of ``y_pred``.

    The first maximal entry wins, ``-0.0`` and ``0.0`` being equal (``tf.argmax``'s rule):
    ``keras.ops.argmax`` ranks ``-0.0`` below ``0.0``, so every zero is made ``+0.0`` first
    (``where``, which no compiler folds away).
    """
    ops = compat.array_ops()
    y_true = ops.where(y_true == 0, ops.zeros_like(y_true), y_true)
    depth = ops.shape(y_pred)[-1]
    return ops.one_hot(ops.argmax(y_true, axis=-1), depth, dtype=y_pred.dtype)


def _margin_inputs(y_true, y_pred, nb_classes):
    """``(one-hot label, logits, K)`` of the multiclass margin losses (label = argmax)."""
    y_true, y_pred = _prepare(y_true, y_pred, min_classes=2)
    return _one_hot_argmax(y_true, y_pred), y_pred, _num_classes(y_pred, nb_classes)


def _num_classes(y_pred, nb_classes: int | None):
    """K as a tensor of ``y_pred``'s dtype, checked against ``nb_classes`` if given.

    Static on every backend whose shapes are (JAX; TensorFlow when the graph is traced
    with a known class count): the checks are Python comparisons at trace time. A
    TensorFlow graph traced with an unknown last axis checks it at run time
    (``tf.debugging`` asserts; JAX never gets there).
    """
    ops = compat.array_ops()
    static_k = y_pred.shape[-1]
    if nb_classes is not None and static_k is not None and static_k != nb_classes:
        raise ValueError(
            f"the loss was built with nb_classes={nb_classes} (its get_L() assumes it) but "
            f"y_pred has {static_k} classes on its last axis."
        )
    if static_k is not None:
        return ops.cast(static_k, y_pred.dtype)
    import tensorflow as tf  # an unknown static size: a TensorFlow graph

    k = tf.shape(y_pred)[-1]
    checks = [tf.debugging.assert_greater_equal(k, 2, message="need at least 2 classes")]
    if nb_classes is not None:
        checks.append(
            tf.debugging.assert_equal(
                k, nb_classes, message="y_pred's last axis differs from nb_classes"
            )
        )
    with tf.control_dependencies(checks):
        k = tf.identity(k)
    return tf.cast(k, y_pred.dtype)


def _hinge_terms(onehot, y_pred, k, min_margin: float):
    """deel-lip's multiclass hinge, per example: mean_k w_k relu(m/2 - s_k z_k)."""
    ops = compat.array_ops()
    sign = 2.0 * onehot - 1.0
    hinge = _relu(min_margin / 2.0 - sign * y_pred)
    weight = onehot * (k - 1.0) + (1.0 - onehot)
    return ops.mean(weight * hinge, axis=-1)


def _kr_terms(onehot, y_pred, k):
    """Per-example KR term: -(z_y - 1/(K-1) sum_{k != y} z_k) = -<w, z>."""
    weight = (k * onehot - 1.0) / (k - 1.0)
    return -compat.array_ops().sum(weight * y_pred, axis=-1)


def _hinge_constant(nb_classes: int | None) -> float:
    if nb_classes is None:
        return 1.0
    return math.sqrt((nb_classes - 1.0) / nb_classes)


def _kr_constant(nb_classes: int | None) -> float:
    if nb_classes is None:
        return math.sqrt(2.0)
    return math.sqrt(nb_classes / (nb_classes - 1.0))


# --------------------------------------------------------------------------------------
# base class
# --------------------------------------------------------------------------------------
@keras.utils.register_keras_serializable(package="lipdp")
class DP_Loss(keras.losses.Loss, metaclass=abc.ABCMeta):
    """Base class of the losses usable for DP training with analytic sensitivity.

    Subclasses implement ``call(y_true, y_pred)`` returning per-example losses of shape
    ``(batch,)`` (entry ``i`` depending on example ``i`` only) and ``get_L()``, an upper
    bound on ``||d loss_i / d y_pred_i||_2`` for any logits and any admissible label.

    Every Keras reduction is accepted (``NONE``: per-example values, ``SUM``: their sum,
    e.g. to study the losses outside training); a DP model's ``compile`` accepts only
    ``SUM_OVER_BATCH_SIZE`` and ``AUTO`` (which Keras ``fit`` resolves to
    ``SUM_OVER_BATCH_SIZE``): the sensitivity assumes the batch loss is the mean of the
    per-example terms (:func:`lipdp.core.private_model.check_reduction`). For the same reason
    ``__call__`` refuses sample weights outside ``[0, 1]`` and Keras masks on ``y_pred``.
    """

    def __init__(self, reduction=Reduction.SUM_OVER_BATCH_SIZE, name=None):
        super().__init__(reduction=reduction, name=name)

    @abc.abstractmethod
    def get_L(self) -> float:
        """Upper bound on the norm of the gradient of one example's loss wrt its logits."""

    @abc.abstractmethod
    def per_example_loss(self, y_true, y_pred):
        """The loss of each example, shape ``(batch,)``, for usable labels (finite, and
        class indices in range)."""

    def call(self, y_true, y_pred):
        """Per-example losses; an example whose label has a NaN or an infinity, or is a
        class index out of range, counts 0.

        Rule S9 (:func:`lipdp.core.records.neutralised_losses`): a NaN label would make the
        example's gradient NaN, i.e. unbounded, and an out-of-range index would make a
        sparse loss fail. Its label is replaced by zeros (finite, so the loss and its
        gradient are finite) and its loss by 0 (so its gradient is exactly 0, within every
        bound). The losses of this module take labels of ``y_pred``'s shape, never class
        indices; a subclass that takes indices (``(batch,)`` for ``(batch, K)``) gets them
        checked against ``[0, K)``.
        """
        y_pred = compat.array_ops().convert_to_tensor(y_pred)
        return neutralised_losses(self.per_example_loss, y_true, y_pred)

    def __call__(self, y_true, y_pred, sample_weight=None):
        if getattr(y_pred, "_keras_mask", None) is not None:
            raise ValueError(
                f"{type(self).__name__} does not support Keras masks on y_pred: Keras "
                "re-weights the unmasked entries by batch_size / n_valid, which would "
                "scale each example's gradient beyond get_L() / batch_size."
            )
        if sample_weight is not None:
            sample_weight = _checked_weights(sample_weight)
        return super().__call__(y_true, y_pred, sample_weight=sample_weight)

    def get_config(self):
        return super().get_config()


def _checked_weights(sample_weight):
    """``sample_weight``, checked to lie in ``[0, 1]`` (a weight ``w`` multiplies the
    example's gradient, hence its sensitivity, by ``w``).

    Per-backend hook. TensorFlow: ``tf.debugging`` asserts (run in the graph, as always).
    JAX: concrete weights are checked on the host (the same message); traced weights (a
    jit step: no value can be read, no assert can run) are mapped into the admissible set
    instead, ``clip(w, 0, 1)`` with a non-finite weight set to 0 -- what rule S9 does with
    labels -- so that no weight can scale a gradient beyond its bound.
    """
    message = "sample_weight must be in [0, 1] for DP losses"
    if compat.keras_backend() == "tensorflow":
        import tensorflow as tf

        sample_weight = tf.convert_to_tensor(sample_weight)
        weight = tf.cast(sample_weight, tf.float32)
        checks = [
            tf.debugging.assert_non_negative(weight, message=message),
            tf.debugging.assert_less_equal(
                weight,
                tf.ones_like(weight),
                message=f"{message}: a weight w multiplies the example's gradient (and "
                "sensitivity) by w",
            ),
        ]
        with tf.control_dependencies(checks):
            return tf.identity(sample_weight)
    import jax
    import numpy as np

    ops = compat.array_ops()
    sample_weight = ops.convert_to_tensor(sample_weight)
    if not isinstance(sample_weight, jax.core.Tracer):
        values = np.asarray(sample_weight, dtype=np.float64)
        if not np.all((values >= 0) & (values <= 1)):
            raise ValueError(f"{message}: got values outside it (or not finite).")
        return sample_weight
    finite = ops.isfinite(sample_weight)
    return ops.where(finite, ops.clip(sample_weight, 0, 1), ops.zeros_like(sample_weight))


# --------------------------------------------------------------------------------------
# cross-entropies
# --------------------------------------------------------------------------------------
@keras.utils.register_keras_serializable(package="lipdp")
class DP_TauCategoricalCrossentropy(DP_Loss):
    r"""Categorical cross-entropy with temperature: ``CE(y, softmax(tau z)) / tau``.

    Same values as deel-lip's ``TauCategoricalCrossentropy`` for labels in the
    probability simplex (one-hot or label-smoothed).

    Constant, :math:`L = \sqrt 2`. Write :math:`s = \sum_k y_k` and
    :math:`p = \mathrm{softmax}(\tau z)`. The loss is
    :math:`\ell(z) = \frac1\tau\big(s\,\mathrm{LSE}(\tau z) - \tau\langle y, z\rangle\big)`
    so :math:`\nabla_z \ell = s\,p - y`. For :math:`y \ge 0`, :math:`s \le 1`:
    :math:`\|s p - y\|^2 = s^2\|p\|^2 + \|y\|^2 - 2s\langle p, y\rangle
    \le s^2 + \|y\|_1^2 \le 2`, using :math:`\|p\|_2 \le \|p\|_1 = 1`,
    :math:`\|y\|_2 \le \|y\|_1 = s` and :math:`\langle p, y\rangle \ge 0`.
    The bound is independent of ``tau`` and tight for one-hot labels (take
    :math:`p \to e_j`, :math:`j \ne` label).

    Labels are made admissible first: :math:`y \leftarrow \max(y, 0)`, then divided by
    :math:`\max(s, 1)` (identity on the simplex), so the bound holds for any ``y_true``.
    """

    def __init__(
        self,
        tau,
        reduction=Reduction.SUM_OVER_BATCH_SIZE,
        name="DP_TauCategoricalCrossentropy",
    ):
        self.tau = validation.positive("`tau`", tau)
        super().__init__(reduction=reduction, name=name)

    def per_example_loss(self, y_true, y_pred):
        ops = compat.array_ops()
        y_true, y_pred = _prepare(y_true, y_pred)
        y_true = _relu(y_true)
        total = ops.sum(y_true, axis=-1, keepdims=True)
        y_true = y_true / ops.maximum(total, 1.0)
        log_p = _scaled_log_softmax(y_pred, self.tau)
        return _per_example(-ops.sum(y_true * log_p, axis=-1) / self.tau)

    def get_L(self) -> float:
        return math.sqrt(2.0)

    def get_config(self):
        return {**super().get_config(), "tau": self.tau}


@keras.utils.register_keras_serializable(package="lipdp")
class DP_TauBCE(DP_Loss):
    r"""Binary cross-entropy on logits with temperature, averaged over the outputs.

    For an example with K outputs:
    :math:`\ell(z) = \frac1K \sum_k \mathrm{BCE}(y_k, \sigma(\tau z_k)) / \tau` with
    :math:`\mathrm{BCE}(y, \sigma(x)) = \mathrm{softplus}(x) - y x`.

    Constant, :math:`L = 1`:
    :math:`\partial \ell / \partial z_k = (\sigma(\tau z_k) - y_k) / K`, and for
    :math:`y_k \in [0, 1]` each numerator lies in :math:`(-1, 1)`, so
    :math:`\|\nabla_z \ell\| < \sqrt K / K = 1/\sqrt K \le 1`. K is only known at call
    time, so ``get_L`` returns the K-independent value 1, tight for one output (K = 1,
    the usual binary case: :math:`z \to -\infty` with :math:`y = 1`).

    Labels are clipped to ``[0, 1]``, the admissible set; this maps the {-1, 1}
    encoding accepted by deel-lip's ``TauBinaryCrossentropy`` onto {0, 1}.
    """

    def __init__(self, tau, reduction=Reduction.SUM_OVER_BATCH_SIZE, name="DP_TauBCE"):
        self.tau = validation.positive("`tau`", tau)
        super().__init__(reduction=reduction, name=name)

    def per_example_loss(self, y_true, y_pred):
        y_true, y_pred = _prepare(y_true, y_pred)
        y_true = compat.array_ops().clip(y_true, 0.0, 1.0)
        bce = _sigmoid_cross_entropy(y_true, self.tau * y_pred)
        return _per_example(bce / self.tau)

    def get_L(self) -> float:
        return 1.0

    def get_config(self):
        return {**super().get_config(), "tau": self.tau}


def _scaled_log_softmax(logits, tau):
    """``log_softmax(tau z)`` on the last axis.

    Per-backend hook. TensorFlow: ``log_softmax(tau z)``, the numbers lipdp has always
    given. JAX: ``log_softmax(tau (z - max z))``, the same function (the shift is a
    constant of the row, outside the gradient), because XLA's CPU code contracts the
    ``tau z - max(tau z)`` inside ``log_softmax`` into one fused multiply-add whose
    unrounded product no longer cancels the rounded maximum: at ``tau z ~ 4e31`` the shift
    is off by ~1e24, ``exp`` overflows and the loss and its gradient are NaN under
    ``jax.jit``. Shifted first, the row's largest entry is exactly 0 and nothing overflows.
    """
    ops = compat.array_ops()
    if compat.keras_backend() == "tensorflow":
        return ops.log_softmax(tau * logits, axis=-1)
    shift = ops.stop_gradient(ops.max(logits, axis=-1, keepdims=True))
    return ops.log_softmax(tau * (logits - shift), axis=-1)


def _sigmoid_cross_entropy(labels, logits):
    """``softplus(x) - y x`` computed without overflow as
    ``max(x, 0) - x y + log1p(exp(-|x|))`` -- the operations of
    ``tf.nn.sigmoid_cross_entropy_with_logits``, so the same numbers and gradients."""
    ops = compat.array_ops()
    zeros = ops.zeros_like(logits)
    positive = logits >= zeros
    relu_logits = ops.where(positive, logits, zeros)
    neg_abs_logits = ops.where(positive, -logits, logits)
    return (relu_logits - logits * labels) + ops.log1p(ops.exp(neg_abs_logits))


# --------------------------------------------------------------------------------------
# multiclass margin losses
# --------------------------------------------------------------------------------------
@keras.utils.register_keras_serializable(package="lipdp")
class DP_MulticlassHinge(DP_Loss):
    r"""deel-lip's multiclass hinge loss (already per-example), with its constant.

    With :math:`c` the label, :math:`s_k = +1` if :math:`k = c` else :math:`-1` and
    :math:`m` = ``min_margin``:
    :math:`\ell(z) = \frac1K\big[(K-1)(m/2 - z_c)_+ + \sum_{k\ne c}(m/2 + z_k)_+\big]`,
    exactly deel-lip 1.5's ``multiclass_hinge`` for one-hot labels.

    Constant: the (sub)gradient has :math:`-\frac{K-1}K a_c` on the label and
    :math:`\frac1K a_k` elsewhere, with activities :math:`a_k \in [0, 1]`, so
    :math:`\|\nabla\ell\|^2 \le \frac{(K-1)^2 + (K-1)}{K^2} = \frac{K-1}K`, i.e.
    :math:`L_K = \sqrt{(K-1)/K}`, attained whenever every term is active (e.g. z = 0).
    With ``nb_classes`` given, ``get_L`` returns :math:`L_K` and ``call`` checks that
    y_pred has ``nb_classes`` classes; without it, ``get_L`` returns
    :math:`\sup_K L_K = 1`.

    The label is ``argmax(y_true)``: this guarantees exactly one positive class (with
    P classes weighted by K - 1 the norm could reach :math:`(K-1)/\sqrt K`).
    """

    def __init__(
        self,
        min_margin=1.0,
        nb_classes=None,
        reduction=Reduction.SUM_OVER_BATCH_SIZE,
        name="DP_MulticlassHinge",
    ):
        self.min_margin = validation.positive("`min_margin`", min_margin)
        self.nb_classes = _nb_classes_or_none(nb_classes)
        super().__init__(reduction=reduction, name=name)

    def per_example_loss(self, y_true, y_pred):
        onehot, y_pred, k = _margin_inputs(y_true, y_pred, self.nb_classes)
        return _per_example(_hinge_terms(onehot, y_pred, k, self.min_margin))

    def get_L(self) -> float:
        return _hinge_constant(self.nb_classes)

    def get_config(self):
        return {
            **super().get_config(),
            "min_margin": self.min_margin,
            "nb_classes": self.nb_classes,
        }


@keras.utils.register_keras_serializable(package="lipdp")
class DP_MulticlassKR(DP_Loss):
    r"""Per-example multiclass Kantorovich-Rubinstein loss (to be minimised).

    :math:`\ell(z) = -\big(z_c - \frac1{K-1}\sum_{k\ne c} z_k\big)`, c the label.

    deel-lip's ``MulticlassKR`` divides each example's term by the number of examples of
    its class in the minibatch (``_kr``), which couples the examples (changing one label
    changes every other example's weight) and breaks the per-example sensitivity. Here
    the weights are fixed: on a perfectly class-balanced batch (B / K examples per
    class) deel-lip's per-class weights are :math:`K/B` and :math:`K/((K-1)B)`, and its
    value equals :math:`\mathrm{mean}_i (z_{i,c_i} - \frac1{K-1}\sum_{k\ne c_i} z_{ik})`,
    i.e. exactly MINUS the mean of this loss (deel-lip's KR is the Wasserstein estimate,
    to be maximised; its HKR uses ``-KR``). No rescaling is applied.

    Constant: the loss is linear, :math:`\nabla\ell = -e_c + \frac1{K-1}(1 - e_c)`, of
    norm :math:`\sqrt{1 + (K-1)/(K-1)^2} = \sqrt{K/(K-1)}` everywhere (exact). With
    ``nb_classes`` given, ``get_L`` returns it and ``call`` checks K; without it,
    ``get_L`` returns :math:`\sup_{K \ge 2} \sqrt{K/(K-1)} = \sqrt 2` (K = 2).

    The label is ``argmax(y_true)`` (one-hot or +-1 encodings).
    """

    def __init__(
        self,
        nb_classes=None,
        reduction=Reduction.SUM_OVER_BATCH_SIZE,
        name="DP_MulticlassKR",
    ):
        self.nb_classes = _nb_classes_or_none(nb_classes)
        super().__init__(reduction=reduction, name=name)

    def per_example_loss(self, y_true, y_pred):
        onehot, y_pred, k = _margin_inputs(y_true, y_pred, self.nb_classes)
        return _per_example(_kr_terms(onehot, y_pred, k))

    def get_L(self) -> float:
        return _kr_constant(self.nb_classes)

    def get_config(self):
        return {**super().get_config(), "nb_classes": self.nb_classes}


@keras.utils.register_keras_serializable(package="lipdp")
class DP_MulticlassHKR(DP_Loss):
    r"""Per-example multiclass hinge-KR: ``KR + alpha * hinge``.

    Same convention as deel-lip 1.5's ``MulticlassHKR`` (``-KR + alpha * hinge``, alpha
    weighting the hinge term only), with the per-example KR of :class:`DP_MulticlassKR`
    (which is ``-KR`` of deel-lip on a class-balanced batch) and the hinge of
    :class:`DP_MulticlassHinge`. On a perfectly balanced batch it therefore equals
    deel-lip's value.

    Constant: triangle inequality,
    :math:`L_K = \sqrt{K/(K-1)} + \alpha\sqrt{(K-1)/K}`. It is exact: both gradients
    have a negative label coordinate and non-negative other coordinates, proportional
    when every hinge term is active (hinge = :math:`\frac{K-1}{K}` times KR's
    direction), e.g. at z = 0. Without ``nb_classes``, with
    :math:`t = \sqrt{(K-1)/K} \in [1/\sqrt2, 1)`, :math:`L_K = 1/t + \alpha t` is convex
    in t, so :math:`\sup_K L_K = \max(\sqrt2 + \alpha/\sqrt2,\ 1 + \alpha)`.

    ``alpha`` must be finite and >= 0 (deel-lip's ``alpha=inf`` means hinge only: use
    :class:`DP_MulticlassHinge`).
    """

    def __init__(
        self,
        alpha=10.0,
        min_margin=1.0,
        nb_classes=None,
        reduction=Reduction.SUM_OVER_BATCH_SIZE,
        name="DP_MulticlassHKR",
    ):
        self.alpha = validation.non_negative("`alpha`", alpha)
        self.min_margin = validation.positive("`min_margin`", min_margin)
        self.nb_classes = _nb_classes_or_none(nb_classes)
        super().__init__(reduction=reduction, name=name)

    def per_example_loss(self, y_true, y_pred):
        onehot, y_pred, k = _margin_inputs(y_true, y_pred, self.nb_classes)
        kr = _kr_terms(onehot, y_pred, k)
        hinge = _hinge_terms(onehot, y_pred, k, self.min_margin)
        return _per_example(kr + self.alpha * hinge)

    def get_L(self) -> float:
        if self.nb_classes is not None:
            return _kr_constant(self.nb_classes) + self.alpha * _hinge_constant(self.nb_classes)
        return max(math.sqrt(2.0) + self.alpha / math.sqrt(2.0), 1.0 + self.alpha)

    def get_config(self):
        return {
            **super().get_config(),
            "alpha": self.alpha,
            "min_margin": self.min_margin,
            "nb_classes": self.nb_classes,
        }


# --------------------------------------------------------------------------------------
# regression-style losses
# --------------------------------------------------------------------------------------
@keras.utils.register_keras_serializable(package="lipdp")
class DP_KCosineSimilarity(DP_Loss):
    r"""Cosine-like loss with a ball of radius K: ``-< y/||y||, z / max(||z||, K) >``.

    Constant, :math:`L = 1/K`. Let :math:`\hat y = y/\|y\|` (unit, or 0 if y = 0).

    * inside the ball, :math:`\|z\| < K`: :math:`\ell = -\langle\hat y, z\rangle/K`, gradient
      :math:`-\hat y/K`, norm :math:`1/K`;
    * outside, :math:`\|z\| > K`: :math:`\ell = -\langle\hat y, \hat z\rangle`, gradient
      :math:`-(\hat y - \langle\hat y,\hat z\rangle\hat z)/\|z\|`, norm
      :math:`\sin\theta/\|z\| < 1/K`;
    * the function is continuous across the sphere :math:`\|z\| = K`, and a segment
      meets the sphere in at most two points, so on each segment it is piecewise
      :math:`C^1` with gradient norm :math:`\le 1/K`: it is :math:`1/K`-Lipschitz, for
      every K > 0 (tight inside the ball).

    Note: the original lip-dp computed the same function of z with
    ``tf.linalg.l2_normalize(., epsilon=K**2)`` and returned ``1/K**2``. With a unit
    :math:`\hat y` that under-estimates the constant by a factor K for every K > 1. (The
    original also normalised y with ``max(||y||, K)``; its true constant is then
    :math:`\min(\|y\|, K)/K^2`, which exceeds :math:`1/K^2` whenever K > 1 and
    :math:`\|y\| > 1`.)

    ``y = 0`` gives a zero loss and a zero gradient (no NaN). ``axis`` is the axis of the
    vectors (not the batch axis); other non-batch axes are averaged.
    """

    def __init__(
        self,
        K=1.0,
        axis=-1,
        reduction=Reduction.SUM_OVER_BATCH_SIZE,
        name="DP_KCosineSimilarity",
    ):
        self.K = validation.positive("`K`", K)
        if isinstance(axis, bool) or int(axis) != axis or int(axis) == 0:
            raise ValueError(
                f"`axis` must be a non-zero integer (axis 0 is the batch axis), got {axis!r}."
            )
        self.axis = int(axis)
        super().__init__(reduction=reduction, name=name)

    def per_example_loss(self, y_true, y_pred):
        ops = compat.array_ops()
        y_true, y_pred = _prepare(y_true, y_pred)
        shape = _static_shape(y_pred)
        rank = None if shape is None else len(shape)
        if rank is not None and self.axis % rank == 0:
            raise ValueError(
                f"axis={self.axis} is the batch axis for inputs of rank {rank}; the "
                "cosine must be computed within each example."
            )
        y_unit = projections.l2_normalize(y_true, axis=self.axis)  # ||y_unit|| <= 1
        # z / sqrt(max(||z||^2, K^2)) = z / max(||z||, K); the gradient is finite at z = 0.
        sq_norm = ops.sum(ops.square(y_pred), axis=self.axis, keepdims=True)
        k_sq = ops.cast(self.K * self.K, y_pred.dtype)
        # max(||z||^2, K^2) as a where: at ||z|| = K the gradient follows ||z||^2 on every
        # backend (tf.maximum's rule; JAX's maximum would split it between both sides).
        z_scaled = y_pred * ops.rsqrt(ops.where(sq_norm >= k_sq, sq_norm, k_sq))
        return _per_example(-ops.sum(y_unit * z_scaled, axis=self.axis))

    def get_L(self) -> float:
        return 1.0 / self.K

    def get_config(self):
        return {**super().get_config(), "K": self.K, "axis": self.axis}


@keras.utils.register_keras_serializable(package="lipdp")
class DP_MeanAbsoluteError(DP_Loss):
    r"""Mean absolute error over the outputs of an example: :math:`\frac1K\sum_k|z_k-y_k|`.

    Constant, :math:`L = 1`: the (sub)gradient is :math:`\mathrm{sign}(z_k - y_k)/K`, of
    norm :math:`\le \sqrt K / K = 1/\sqrt K \le 1` for any real targets. ``get_L``
    returns the K-independent value 1, tight for a single output.
    """

    def __init__(
        self,
        reduction=Reduction.SUM_OVER_BATCH_SIZE,
        name="DP_MeanAbsoluteError",
    ):
        super().__init__(reduction=reduction, name=name)

    def per_example_loss(self, y_true, y_pred):
        y_true, y_pred = _prepare(y_true, y_pred)
        ops = compat.array_ops()
        # |d| with the subgradient 0 at d = 0 on every backend (TensorFlow's abs; JAX's abs
        # has derivative 1 there): the where sends no gradient to a tied output.
        difference = y_pred - y_true
        return _per_example(
            ops.where(difference == 0, ops.zeros_like(difference), ops.abs(difference))
        )

    def get_L(self) -> float:
        return 1.0
