r"""Membership-inference attacks: an *empirical* check of privacy, not a proof.

An attacker who sees the trained model tries to tell the training examples
("members") from held-out examples of the same distribution ("non-members").
Two classical black-box attacks (Yeom et al., *Privacy Risk in Machine Learning*,
CSF 2018; Shokri et al., *Membership Inference Attacks against Machine Learning
Models*, S&P 2017, in the simplified form of TensorFlow Privacy's reports):

* **loss threshold**: the membership score is ``-loss`` (members tend to have a
  lower loss); the attack is summarised by the AUROC of that score (members are
  positives) and by the **attacker advantage** ``max_t (TPR(t) - FPR(t))`` over
  thresholds ``t`` ("member" when ``score >= t``);
* **logistic regression** ("shadow model" trained on the attack features): a
  scikit-learn ``LogisticRegression`` on per-example features (loss, log of the
  loss, confidence, entropy, margin between the two largest probabilities) is fit
  on a random,
  stratified half of members and non-members and evaluated (AUROC, advantage)
  on the other half.

For an ``(epsilon, delta)``-DP training algorithm, any attack has
``TPR <= e^epsilon FPR + delta`` at every threshold, hence an advantage at most
``(e^epsilon - 1 + 2 delta) / (e^epsilon + 1)``, Kairouz et al. 2015. A low
measured AUROC or advantage does **not** prove privacy (other attacks may do
better, and the numbers have sampling error); a high one on a model claimed
private is a red flag worth investigating.

These attacks read the model's outputs on the *training* data: they touch
private data and their results must not be released as part of a DP pipeline
(they are an audit tool for the data owner).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import keras
import numpy as np

from lipdp.evaluation.outputs import class_indices, log_softmax, logit_scale, predict_logits

logger = logging.getLogger(__name__)

FEATURE_NAMES = ("loss", "log_loss", "confidence", "entropy", "margin")


@dataclass(frozen=True)
class AttackResult:
    """AUROC and attacker advantage of one attack (``n_*``: evaluation set sizes)."""

    attack: str
    auroc: float
    advantage: float
    n_members: int
    n_nonmembers: int
    slice: str = "entire dataset"


# --------------------------------------------------------------------------- scores
def _as_scores(members, nonmembers):
    members = np.asarray(members, dtype=np.float64).reshape(-1)
    nonmembers = np.asarray(nonmembers, dtype=np.float64).reshape(-1)
    if len(members) == 0 or len(nonmembers) == 0:
        raise ValueError("both members and non-members are needed.")
    return members, nonmembers


def roc_auc(member_scores, nonmember_scores) -> float:
    """AUROC of a membership score (higher = member): the probability that a random
    member scores above a random non-member, ties counting 1/2."""
    from sklearn.metrics import roc_auc_score

    pos, neg = _as_scores(member_scores, nonmember_scores)
    truth = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    return float(roc_auc_score(truth, np.r_[pos, neg]))


def attacker_advantage(member_scores, nonmember_scores) -> float:
    """``max_t (TPR(t) - FPR(t))`` over thresholds ("member" iff score >= t)."""
    from sklearn.metrics import roc_curve

    pos, neg = _as_scores(member_scores, nonmember_scores)
    truth = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    fpr, tpr, _ = roc_curve(truth, np.r_[pos, neg], drop_intermediate=False)
    return float(max(0.0, np.max(tpr - fpr)))


def dp_advantage_bound(epsilon: float, delta: float = 0.0) -> float:
    """Largest advantage ``TPR - FPR`` of any attack on an ``(epsilon, delta)``-DP
    algorithm: ``(e^epsilon - 1 + 2 delta) / (e^epsilon + 1)``."""
    e = np.exp(float(epsilon))
    return float(min(1.0, (e - 1.0 + 2.0 * delta) / (e + 1.0)))


# ------------------------------------------------------------------------- features
def per_example_loss(probs, labels, eps: float = 1e-300) -> np.ndarray:
    """Cross-entropy ``-log p_y`` of each example (probabilities floored at ``eps``)."""
    probs = np.asarray(probs, dtype=np.float64)
    labels = class_indices(labels)
    return -np.log(np.maximum(probs[np.arange(len(labels)), labels], eps))


def attack_features_from_log_probs(log_probs, labels) -> np.ndarray:
    """``(n, 5)`` attack features (:data:`FEATURE_NAMES`) from log-probabilities:
    loss ``-log p_y``, its logarithm (losses of confidently fit examples span many
    orders of magnitude: ``1e-20`` vs ``1e-3`` is a strong membership signal that a
    linear model sees only on a log scale), confidence ``max p``, entropy, and the
    gap between the two largest probabilities."""
    log_probs = np.asarray(log_probs, dtype=np.float64)
    labels = class_indices(labels)
    loss = -log_probs[np.arange(len(labels)), labels]
    probs = np.exp(log_probs)
    entropy = -np.sum(np.where(probs > 0, probs * log_probs, 0.0), axis=1)
    top2 = np.sort(probs, axis=1)[:, -2:] if probs.shape[1] > 1 else np.c_[probs, probs]
    log_loss = np.log(np.maximum(loss, 1e-300))
    return np.c_[loss, log_loss, top2[:, 1], entropy, top2[:, 1] - top2[:, 0]]


def attack_features(probs, labels) -> np.ndarray:
    """:func:`attack_features_from_log_probs` of ``log(probs)`` (prefer log-probabilities
    computed from logits: probabilities round the smallest losses to 0)."""
    with np.errstate(divide="ignore"):
        return attack_features_from_log_probs(np.log(np.asarray(probs, np.float64)), labels)


# -------------------------------------------------------------------------- attacks
def loss_threshold_attack(loss_members, loss_nonmembers, slice_name="entire dataset"):
    """Threshold attack on ``-loss``: AUROC and advantage (module docstring)."""
    pos, neg = _as_scores(loss_members, loss_nonmembers)
    return AttackResult(
        "loss threshold",
        roc_auc(-pos, -neg),
        attacker_advantage(-pos, -neg),
        len(pos),
        len(neg),
        slice_name,
    )


def logistic_regression_attack(
    features_members, features_nonmembers, seed: int = 0, slice_name="entire dataset"
):
    """Logistic regression on attack features, trained on half of the examples.

    Members and non-members are split in two stratified halves (``seed``); a
    ``StandardScaler`` + ``LogisticRegression(class_weight="balanced")`` pipeline is
    fit on the first half and its predicted membership probability scored
    (AUROC, advantage) on the second.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    pos = np.asarray(features_members, dtype=np.float64)
    neg = np.asarray(features_nonmembers, dtype=np.float64)
    pos, neg = (a.reshape(len(a), -1) for a in (pos, neg))
    if len(pos) < 2 or len(neg) < 2:
        raise ValueError("the attack needs at least 2 members and 2 non-members.")
    features = np.r_[pos, neg]
    truth = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
    f_fit, f_eval, t_fit, t_eval = train_test_split(
        features, truth, test_size=0.5, random_state=seed, stratify=truth
    )
    attack = make_pipeline(
        StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=1000)
    )
    attack.fit(f_fit, t_fit)
    score = attack.predict_proba(f_eval)[:, 1]
    members, nonmembers = score[t_eval == 1], score[t_eval == 0]
    return AttackResult(
        "logistic regression",
        roc_auc(members, nonmembers),
        attacker_advantage(members, nonmembers),
        len(members),
        len(nonmembers),
        slice_name,
    )


@dataclass
class MembershipReport:
    """All attack results; ``summary()`` gives the largest AUROC/advantage."""

    results: list = field(default_factory=list)

    def _best(self, slice_filter):
        chosen = [r for r in self.results if slice_filter(r.slice)]
        if not chosen:
            return float("nan"), float("nan")
        return max(r.auroc for r in chosen), max(r.advantage for r in chosen)

    def summary(self) -> dict:
        auc, adv = self._best(lambda s: s == "entire dataset")
        out = {"mia_auc_entire_dataset": auc, "mia_adv_entire_dataset": adv}
        if any(r.slice.startswith("class") for r in self.results):
            auc_c, adv_c = self._best(lambda s: s.startswith("class"))
            out.update(mia_auc_per_class=auc_c, mia_adv_per_class=adv_c)
        return out

    def result(self, attack: str, slice_name: str = "entire dataset") -> AttackResult:
        for r in self.results:
            if r.attack == attack and r.slice == slice_name:
                return r
        raise KeyError((attack, slice_name))

    def format(self) -> str:
        lines = [f"{'attack':<20} {'slice':<16} {'AUROC':>7} {'advantage':>9}  n (in/out)"]
        for r in self.results:
            lines.append(
                f"{r.attack:<20} {r.slice:<16} {r.auroc:7.4f} {r.advantage:9.4f}  "
                f"{r.n_members}/{r.n_nonmembers}"
            )
        return "\n".join(lines)


def membership_inference_from_log_probs(
    log_probs_members,
    labels_members,
    log_probs_nonmembers,
    labels_nonmembers,
    by_class: bool = False,
    seed: int = 0,
) -> MembershipReport:
    """Both attacks from predicted log-probabilities (optionally also per true class).

    Per-class slices are small (tens of non-members per class on small test sets):
    their AUROC and advantage have a large sampling error, and their maximum over
    classes is biased upwards.
    """
    lab_in, lab_out = class_indices(labels_members), class_indices(labels_nonmembers)
    feat_in = attack_features_from_log_probs(log_probs_members, lab_in)
    feat_out = attack_features_from_log_probs(log_probs_nonmembers, lab_out)
    slices = [("entire dataset", np.ones(len(lab_in), bool), np.ones(len(lab_out), bool))]
    if by_class:
        for c in np.union1d(lab_in, lab_out):
            slices.append((f"class {c}", lab_in == c, lab_out == c))
    report = MembershipReport()
    for name, m_in, m_out in slices:
        if m_in.sum() < 2 or m_out.sum() < 2:
            continue
        report.results.append(loss_threshold_attack(feat_in[m_in, 0], feat_out[m_out, 0], name))
        if m_in.sum() >= 4 and m_out.sum() >= 4:
            report.results.append(
                logistic_regression_attack(feat_in[m_in], feat_out[m_out], seed, name)
            )
    return report


def membership_inference_from_probs(
    probs_members, labels_members, probs_nonmembers, labels_nonmembers, by_class=False, seed=0
) -> MembershipReport:
    """:func:`membership_inference_from_log_probs` on ``log(probs)``."""
    with np.errstate(divide="ignore"):
        log_in = np.log(np.asarray(probs_members, np.float64))
        log_out = np.log(np.asarray(probs_nonmembers, np.float64))
    return membership_inference_from_log_probs(
        log_in, labels_members, log_out, labels_nonmembers, by_class, seed
    )


def membership_inference(
    model,
    x_train,
    y_train,
    x_test,
    y_test,
    scale: float | None = None,
    by_class: bool = False,
    seed: int = 0,
    batch_size: int = 512,
) -> MembershipReport:
    """Run both attacks on ``model`` with members ``(x_train, y_train)`` and
    non-members ``(x_test, y_test)``.

    Log-probabilities are ``log_softmax(scale * model(x))``; ``scale`` defaults to the
    ``tau`` of the compiled loss (:func:`lipdp.evaluation.outputs.logit_scale`).
    Touches private data (module docstring).
    """
    if scale is None:
        scale = logit_scale(model)
    log_in = log_softmax(predict_logits(model, x_train, batch_size), scale)
    log_out = log_softmax(predict_logits(model, x_test, batch_size), scale)
    return membership_inference_from_log_probs(log_in, y_train, log_out, y_test, by_class, seed)


class PrivacyMetrics(keras.callbacks.Callback):
    """Runs the membership-inference attacks at the end of training.

    An empirical audit that reads the training data (not a proof of privacy, and its
    results are not covered by the DP guarantee: module docstring). Not added by
    default to any training.

    Args:
        np_dataset: ``(x_train, y_train, x_test, y_test)`` numpy arrays (members,
            non-members); labels as integers or one-hot.
        log_fn: ``"logging"`` (default, ``logging.info``), ``"print"``, ``"wandb"``
            (imported lazily), ``"all"`` (logging, and wandb if it is installed), or a
            callable receiving the summary dict.
        scale: logit scale of the probabilities (default: ``tau`` of the loss).
        by_class: also attack each class separately (``mia_*_per_class``).
        seed: split of the logistic-regression attack.

    After training, ``attack_results`` holds the :class:`MembershipReport`, and
    ``log_report()`` logs (and returns) its summary.
    """

    def __init__(self, np_dataset, log_fn="logging", scale=None, by_class=True, seed=0):
        super().__init__()
        x_train, y_train, x_test, y_test = np_dataset
        self.x_train, self.y_train = x_train, y_train
        self.x_test, self.y_test = x_test, y_test
        self.log_fn = self._resolve_log_fn(log_fn)
        self.scale = scale
        self.by_class = bool(by_class)
        self.seed = seed
        self.attack_results = None

    @staticmethod
    def _resolve_log_fn(log_fn):
        if callable(log_fn):
            return log_fn
        if log_fn == "logging":
            return lambda summary: logger.info("membership inference: %s", summary)
        if log_fn == "print":
            return print
        if log_fn == "wandb":
            import wandb

            return wandb.log
        if log_fn == "all":
            try:
                import wandb
            except ImportError:
                wandb = None
            info = PrivacyMetrics._resolve_log_fn("logging")

            def log_all(summary):
                info(summary)
                if wandb is not None:
                    wandb.log(summary)

            return log_all
        raise ValueError(
            f"log_fn must be callable, 'logging', 'print', 'wandb' or 'all'; got {log_fn!r}."
        )

    def run(self) -> MembershipReport:
        self.attack_results = membership_inference(
            self.model,
            self.x_train,
            self.y_train,
            self.x_test,
            self.y_test,
            scale=self.scale,
            by_class=self.by_class,
            seed=self.seed,
        )
        return self.attack_results

    def on_train_end(self, logs=None):
        self.run()
        summary = self.log_report()
        if logs is not None:
            logs.update(summary)

    def log_report(self) -> dict:
        if self.attack_results is None:
            raise RuntimeError("no attack results yet: train the model (or call run()).")
        summary = self.attack_results.summary()
        self.log_fn(summary)
        return summary


__all__ = [
    "FEATURE_NAMES",
    "AttackResult",
    "MembershipReport",
    "roc_auc",
    "attacker_advantage",
    "dp_advantage_bound",
    "per_example_loss",
    "attack_features",
    "attack_features_from_log_probs",
    "loss_threshold_attack",
    "logistic_regression_attack",
    "membership_inference_from_log_probs",
    "membership_inference_from_probs",
    "membership_inference",
    "PrivacyMetrics",
]
