"""What ``lipdp evaluate`` measures on a run's model, without the command line.

:func:`evaluate_model` computes, on a trained model (:func:`lipdp.recipes.runs.train`) or a
saved one (:func:`load_private_model`): the test accuracy; for a Lipschitz (clipless) model
the Lipschitz constant of its bound pass w.r.t. the raw input, each test example's certified
radius (local for a network with a group normalisation:
:func:`lipdp.evaluation.model_certified_radius`) and the certified accuracy at each radius
(a clipped DP-SGD network has no bound: none); the accuracy under PGD at the same radii (an
upper bound on robust accuracy); the calibration errors; and the AUROC of
membership-inference attacks (:mod:`lipdp.evaluation`).

Membership inference reads the training data: it is an empirical audit for the data owner,
not part of the DP release. Like :mod:`lipdp.recipes.runs`, this module imports TensorFlow
only when it evaluates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lipdp.foundation import validation
from lipdp.foundation.config import Config
from lipdp.recipes import defaults as D


@dataclass(frozen=True)
class EvaluationConfig(Config):
    """The measurements of :func:`evaluate_model` (each field is the ``lipdp evaluate``
    option of the same name).

    Attributes:
        radii: radii (``>= 0``) of the certified (``l2``) and PGD accuracy.
        bins: confidence bins of the ECE.
        attack_steps: PGD steps at each radius (0: no attack).
        attack_restarts: PGD restarts, the first from the clean point.
        attack_norms: balls of the PGD attack, ``"l2"`` and/or ``"linf"`` (the radii are
            the same numbers).
        attack_examples: test examples attacked (the first ones).
        seed: the seed of the attacks' random starts and of membership inference.
    """

    argument_name = "evaluation"
    optional = False

    radii: tuple = (0.0, 0.05, 0.1, 0.2, 0.5)
    bins: int = 15
    attack_steps: int = 20
    attack_restarts: int = 1
    attack_norms: tuple = ("l2",)
    attack_examples: int = 1000
    seed: int = 0

    def __post_init__(self):
        radii = tuple(validation.non_negative("radius", r) for r in self.radii)
        if not radii:
            raise ValueError("radii must hold at least one radius.")
        self._set("radii", radii)
        self._set("bins", validation.count("bins", self.bins, 1))
        self._set("attack_steps", validation.count("attack_steps", self.attack_steps, 0))
        self._set("attack_restarts", validation.count("attack_restarts", self.attack_restarts, 1))
        norms = tuple(
            validation.choice("attack norm", n, D.ADVERSARIAL_NORMS) for n in self.attack_norms
        )
        self._set("attack_norms", norms)
        self._set("attack_examples", validation.count("attack_examples", self.attack_examples, 1))
        self._set("seed", validation.count("seed", self.seed, 0))


@dataclass(frozen=True)
class EvaluationResults:
    """What :func:`evaluate_model` measured.

    Attributes:
        accuracy: test accuracy (of the calibration's probabilities' argmax).
        test_examples: the number of test examples.
        lipschitz: the Lipschitz constant from the layers, w.r.t. the raw input (the
            space of ``data.x_test``); ``None`` for a clipped DP-SGD network (no bound).
        certified: certified accuracy at each radius (``None`` as ``lipschitz``).
        certificate: ``"local"`` (a group normalisation's slope around each example,
            :mod:`lipdp.evaluation.local_certificates`) or ``"global"`` (``margin /
            (sqrt(2) lipschitz)``); ``None`` as ``lipschitz``.
        radius: each test example's certified ``l2`` radius in that space (``None`` as
            ``lipschitz``).
        median_radius: the median of ``radius`` over the correctly classified test
            examples (0 when there is none; ``None`` as ``lipschitz``).
        calibration: the :class:`~lipdp.evaluation.calibration.CalibrationReport`.
        membership: the membership-inference report (train vs test).
        robustness: :func:`~lipdp.evaluation.robustness_curves` on the first
            ``attack_examples`` test examples; ``None`` with ``attack_steps=0``.
        attacked: the number of test examples attacked.
    """

    accuracy: float
    test_examples: int
    lipschitz: float | None
    certified: list | None
    calibration: object
    membership: object
    robustness: dict | None
    attacked: int
    certificate: str | None = None
    radius: object = None
    median_radius: float | None = None


def is_lipschitz(model) -> bool:
    """Whether ``model`` has a Lipschitz bound (the clipless family; a clipped DP-SGD
    network has none, hence no certificate)."""
    from lipdp.clipped.model import DPSGD_Model

    return not isinstance(model, DPSGD_Model)


def evaluate_model(model, data, x_train, y_train, config=None) -> EvaluationResults:
    """The measurements of ``config`` (:class:`EvaluationConfig`, default its defaults) of
    ``model`` on ``data``'s test set; ``(x_train, y_train)`` (labels one-hot) are the members
    of the membership-inference attacks."""
    import numpy as np

    from lipdp import evaluation

    config = EvaluationConfig.coerce(config or EvaluationConfig())
    x_test, y_test = data.x_test, data.y_test
    lipschitz = certified = certificate = radius = median_radius = None
    if is_lipschitz(model):
        lipschitz = evaluation.lipschitz_constant(model)
        logits = evaluation.predict_logits(model, x_test)
        radius, certificate = evaluation.model_certified_radius(model, x_test, logits=logits)
        certified = evaluation.certified_accuracy_from_radius(
            logits, y_test, list(config.radii), radius
        )
        correct = np.argmax(logits, axis=1) == evaluation.class_indices(y_test)
        median_radius = float(np.median(radius[correct])) if correct.any() else 0.0
    probs = evaluation.predict_probabilities(model, x_test)
    calibration = evaluation.calibration_report(probs, y_test, config.bins)
    membership = evaluation.membership_inference(
        model, x_train, y_train, x_test, y_test, seed=config.seed
    )
    attacked = min(config.attack_examples, len(x_test))
    robustness = _robustness(model, x_test, y_test, config) if config.attack_steps else None
    return EvaluationResults(
        calibration.accuracy,
        len(x_test),
        lipschitz,
        certified,
        calibration,
        membership,
        robustness,
        attacked,
        certificate,
        radius,
        median_radius,
    )


def _robustness(model, x, y, config) -> dict:
    """Accuracy under PGD (and certified, for Lipschitz models) at each radius, on the
    first ``attack_examples`` test examples."""
    from lipdp.evaluation import robustness_curves

    return robustness_curves(
        model,
        x[: config.attack_examples],
        y[: config.attack_examples],
        list(config.radii),
        norms=list(config.attack_norms),
        steps=config.attack_steps,
        restarts=config.attack_restarts,
        seed=config.seed,
        certified=is_lipschitz(model),
    )


def load_private_model(path):
    """The lipdp DP model saved at ``path`` (``.keras``, with its privacy ledger). One-line
    ``ValueError`` if the file is not a loadable model, or not a lipdp one."""

    import keras  # (imported on use: the CLI imports this module before TensorFlow)

    import lipdp.clipless.layers  # noqa: F401  (registers the layers for load_model)
    import lipdp.clipless.losses  # noqa: F401
    import lipdp.clipless.model  # noqa: F401
    from lipdp.core.private_model import PrivateModel

    _refuse_non_keras_file(path)
    try:
        model = keras.models.load_model(path)
    except Exception as error:  # any reason a file is not a loadable model
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"cannot load a model from {path!r} ({reason[:200]})") from None
    if not isinstance(model, PrivateModel):
        raise ValueError(f"{path!r} holds a {type(model).__name__}, not a lipdp DP model.")
    return model


#: The first bytes of an HDF5 file (Keras' legacy ``.h5`` format).
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _refuse_non_keras_file(path) -> None:
    """A one-line ``ValueError`` naming ``path`` when it is a file in neither of the
    formats Keras saves models in: a ``.keras`` file (a zip archive holding
    ``config.json``) or a legacy HDF5 ``.h5`` file. (Keras itself reports a corrupt
    ``.keras`` file as "File not found".) A directory is left to Keras (Keras 2's
    SavedModel)."""
    import zipfile

    if not os.path.isfile(path):
        return
    with open(path, "rb") as file:
        if file.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE:
            return
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path!r} is not a Keras file (neither a .keras zip archive nor an HDF5 .h5 "
            "file): give a model saved by lipdp train --save or model.save('name.keras')."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError) as error:
        reason = f"a damaged zip archive: {error}"
        raise ValueError(f"{path!r} is not a Keras file ({reason}).") from None
    if "config.json" not in names:
        raise ValueError(
            f"{path!r} is not a Keras file (a zip archive without the config.json of a "
            "saved model): give a model saved by lipdp train --save or model.save(...)."
        )


def input_signature(model) -> tuple[tuple, int]:
    """``(input shape, classes)`` of ``model``: its metadata's, else its layers' (a model
    saved without metadata)."""
    metadata = model.dataset_metadata
    if metadata is not None:
        return tuple(metadata.input_shape), metadata.nb_classes
    return tuple(model.input_shape[1:]), model.output_shape[-1]


def saved_training_arrays(model, data):
    """``(x, y)`` (labels one-hot): the training examples a saved model was trained on,
    the first ``nb_samples_train`` of its metadata (all of them without metadata)."""
    from lipdp.recipes.runs import one_hot

    metadata = model.dataset_metadata
    n_train = len(data.x_train) if metadata is None else metadata.nb_samples_train
    return data.x_train[:n_train], one_hot(data.y_train[:n_train], data.nb_classes)


def privacy_report_of(model, accountant="rdp"):
    """:func:`lipdp.core.report.privacy_report` of ``model``, or ``None`` when it has no
    optimizer state or no metadata (nothing to account)."""
    from lipdp.core.report import privacy_report

    if getattr(model, "optimizer", None) is None or model.dataset_metadata is None:
        return None
    return privacy_report(model, accountant=accountant)


__all__ = [
    "EvaluationConfig",
    "EvaluationResults",
    "is_lipschitz",
    "evaluate_model",
    "load_private_model",
    "input_signature",
    "saved_training_arrays",
    "privacy_report_of",
]
