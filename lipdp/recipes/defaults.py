"""The public per-data-set constants of a run (``lipdp train``, :mod:`lipdp.recipes.runs`).

Everything here is a constant chosen without looking at the private data: a bound or a
range computed from the data would itself be a release (rule S6). Plain Python, no
TensorFlow: the command line reads these tables for its help and its choices before
it imports anything heavy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: Public input-norm bounds per data set. They are constants, never computed from the
#: private data (a data-dependent bound would itself leak, rule S6). Breast cancer: 30
#: features mapped to [-1, 1] by public ranges (:func:`lipdp.data.sources.load_breast_cancer`),
#: hence ``sqrt(30)``.
INPUT_BOUNDS = {"digits": 5.0, "fashion_mnist": 10.0, "breast_cancer": math.sqrt(30.0)}

#: The data sets of a run: digits and breast_cancer ship with scikit-learn, fashion_mnist
#: is read from local IDX files.
DATASETS = tuple(sorted(INPUT_BOUNDS))

#: The data sets whose examples are images (a scattering front-end needs one).
IMAGE_DATASETS = ("digits", "fashion_mnist")

#: Channels of the convolution blocks of the run's CNN (:func:`lipdp.recipes.zoo.pooled_cnn`).
CNN_WIDTHS = {"digits": (16,), "fashion_mnist": (32, 64)}

#: Hidden units of the tabular network (:func:`lipdp.recipes.zoo.lip_mlp`, or its Keras
#: counterpart for dp-sgd).
MLP_WIDTH = 32

#: Training methods: ``lipdp`` keeps every kernel at norm C (orthogonal kernels times C;
#: the original method, "Fix-Lip-DP-SGD" for C != 1); ``lip-dp-sgd`` keeps kernels in
#: spectral balls of radius C and computes the bounds from their current norms (Barczewski
#: & Ramon; :mod:`lipdp.clipless.layers.constrained`); ``dp-sgd`` clips per-example gradients
#: of an ordinary Keras network (:mod:`lipdp.clipped.model`).
METHODS = ("lipdp", "lip-dp-sgd", "dp-sgd")

#: Public value ranges of the features (pixels in [0, 1]; breast cancer mapped to
#: [-1, 1]): adversarial examples are kept in them.
FEATURE_RANGES = {"digits": (0.0, 1.0), "fashion_mnist": (0.0, 1.0), "breast_cancer": (-1.0, 1.0)}


class DatasetDefaults(NamedTuple):
    """The hyper-parameters a run takes when none is given (``learning_rate``: dp-sgd's; the
    clipless methods read :data:`CLIPLESS_DEFAULTS`)."""

    batch_size: int
    noise_multiplier: float
    learning_rate: float


#: Per data set, the default batch size, noise multiplier and (dp-sgd) learning rate.
DEFAULTS = {
    "digits": DatasetDefaults(512, 6.0, 0.02),
    "fashion_mnist": DatasetDefaults(2048, 2.0, 0.01),
    "breast_cancer": DatasetDefaults(64, 4.0, 0.01),
}


class CliplessDefaults(NamedTuple):
    """What the clipless methods (``lipdp``, ``lip-dp-sgd``) take when none is given.

    Attributes:
        scattering: the network: the scattering front-end and a linear head
            (:func:`lipdp.recipes.zoo.scattering_net`) rather than the CNN or the MLP.
        gradient_clip: ``C`` of the ``DP_ClipGradient(C)`` after the logits (``None``: no
            clipping, the loss's own bound ``sqrt(2)``).
        learning_rate: of Adam (or SGD).
        hidden_layers: tabular data: hidden layers of the MLP
            (:func:`lipdp.recipes.zoo.lip_mlp`; 0: a Lipschitz linear classifier, whose
            kernel gradient ``x g^T`` reaches its bound ``X C`` for every example at the
            input bound). A group normalisation (``group_norm``) needs one.
    """

    scattering: bool
    gradient_clip: float | None
    learning_rate: float
    hidden_layers: int = 1


#: Per data set, the clipless methods' network, logit-gradient clip and learning rate.
#: Digits and breast cancer: chosen by the exploration of issue 29 (its size, its
#: optimism and a private search's cost: ``benchmarks/README.md``, "The default commands");
#: Fashion-MNIST keeps the values of the original demo until a search of its own is run.
CLIPLESS_DEFAULTS = {
    "digits": CliplessDefaults(scattering=True, gradient_clip=0.3, learning_rate=0.01),
    "fashion_mnist": CliplessDefaults(scattering=False, gradient_clip=None, learning_rate=0.01),
    "breast_cancer": CliplessDefaults(
        scattering=False, gradient_clip=0.3, learning_rate=0.01, hidden_layers=0
    ),
}


def default_scattering(dataset: str, method: str) -> bool:
    """Whether a run of ``method`` on ``dataset`` has the scattering network when the user
    does not say: the clipless methods' :data:`CLIPLESS_DEFAULTS`; never for dp-sgd (its
    default network is the plain CNN, ``--scattering`` asks for the other)."""
    return method != "dp-sgd" and CLIPLESS_DEFAULTS[dataset].scattering


#: The choices of the other settings of a run. (``CLIPPING_MODES`` and ``GRADIENT_METHODS``
#: are :mod:`lipdp.clipped`'s, repeated here so that reading them imports no TensorFlow;
#: ``tests/cli/test_cli.py`` checks that they agree.)
SAMPLINGS = ("poisson", "shuffle")
NOISE_STRATEGIES = ("global", "per-layer")
CLIPPING_MODES = ("flat", "per-layer", "automatic", "global")
GRADIENT_METHODS = ("ghost", "jacobian")
OPTIMIZERS = ("adam", "sgd")
ADVERSARIAL_NORMS = ("l2", "linf")
ACCOUNTANTS = ("rdp", "pld", "gdp")

#: Loss of the clipless networks: ``DP_TauCategoricalCrossentropy(tau)`` (its
#: probabilities are ``softmax(tau * logits)``), when the run does not set ``tau``: ``TAU``
#: for the CNN and the MLP, ``SCATTERING_TAU`` for the scattering network. The logits of
#: both are bounded by the input bound (1-Lipschitz networks without bias at the logits),
#: so ``tau`` sets how soon an example's loss gradient fades once it is classified; on
#: digits the scattering head learned best at 2, the CNN at 8 (the search above).
TAU = 8.0
SCATTERING_TAU = 2.0

#: Groups of the scattering network's normalisation per input channel: its 81
#: coefficients per channel (J = 2, L = 8) in groups of 3.
SCATTERING_GROUPS_PER_CHANNEL = 27

__all__ = [
    "INPUT_BOUNDS",
    "DATASETS",
    "IMAGE_DATASETS",
    "CNN_WIDTHS",
    "MLP_WIDTH",
    "METHODS",
    "FEATURE_RANGES",
    "DatasetDefaults",
    "DEFAULTS",
    "CliplessDefaults",
    "CLIPLESS_DEFAULTS",
    "default_scattering",
    "SAMPLINGS",
    "NOISE_STRATEGIES",
    "CLIPPING_MODES",
    "GRADIENT_METHODS",
    "OPTIMIZERS",
    "ADVERSARIAL_NORMS",
    "ACCOUNTANTS",
    "TAU",
    "SCATTERING_TAU",
    "SCATTERING_GROUPS_PER_CHANNEL",
]
