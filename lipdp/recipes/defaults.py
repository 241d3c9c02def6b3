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
    """What a clipless network (``lipdp``, ``lip-dp-sgd``) takes on a data set when the run
    does not say.

    Attributes:
        gradient_clip: ``C`` of the ``DP_ClipGradient(C)`` after the logits (``None``: no
            clipping, the loss's own bound ``sqrt(2)``).
        learning_rate: of the optimiser.
        tau: temperature of the loss ``DP_TauCategoricalCrossentropy(tau)``.
        batch_size, noise_multiplier: ``None``: the data set's :data:`DEFAULTS` (those of
            dp-sgd).
        optimizer, momentum: ``"adam"``, or ``"sgd"`` with heavy-ball ``momentum``.
        weight_norm_bound: the radius of every kernel's ball.
        hidden_layers: the MLP only: its hidden layers (:func:`lipdp.recipes.zoo.lip_mlp`;
            0: a Lipschitz linear classifier, whose kernel gradient ``x g^T`` reaches its
            bound ``X C`` for every example at the input bound). A group normalisation
            (``group_norm``) needs one.
    """

    gradient_clip: float | None
    learning_rate: float
    tau: float
    batch_size: int | None = None
    noise_multiplier: float | None = None
    optimizer: str = "adam"
    momentum: float = 0.0
    weight_norm_bound: float = 1.0
    hidden_layers: int = 1


#: The clipless networks of a run: the scattering front-end and a linear head
#: (:func:`lipdp.recipes.zoo.scattering_net`, images), the CNN (images), the MLP (tabular).
NETWORKS = ("scattering", "cnn", "mlp")

#: Per data set, the clipless methods' network when the run does not say (``scattering``
#: unset).
CLIPLESS_NETWORKS = {"digits": "scattering", "fashion_mnist": "scattering", "breast_cancer": "mlp"}

#: Per ``(data set, network)``, what the clipless methods take. How each was chosen (the
#: size of the exploration, its optimism, a private search's cost): ``benchmarks/README.md``,
#: "The default commands". The temperature rises with the logits' scale: the scattering
#: head's logits are bounded by its feature bound (5.4 on digits), the CNN's by the input
#: bound. Fashion-MNIST's scattering head is Tramer & Boneh's published recipe (SGD with
#: momentum 0.9, batches of 8 192, learning rate 16 for gradients clipped at 0.1 / 63, the
#: feature norm; ``tau = 1`` on kernels of norm 16); its CNN keeps the original demo's.
CLIPLESS_DEFAULTS = {
    ("digits", "scattering"): CliplessDefaults(gradient_clip=0.3, learning_rate=0.01, tau=2.0),
    ("digits", "cnn"): CliplessDefaults(gradient_clip=0.3, learning_rate=0.01, tau=8.0),
    ("fashion_mnist", "scattering"): CliplessDefaults(
        gradient_clip=0.1 / 63,
        learning_rate=16.0,
        tau=1.0,
        batch_size=8192,
        noise_multiplier=4.05,
        optimizer="sgd",
        momentum=0.9,
        weight_norm_bound=16.0,
    ),
    ("fashion_mnist", "cnn"): CliplessDefaults(gradient_clip=None, learning_rate=0.01, tau=8.0),
    ("breast_cancer", "mlp"): CliplessDefaults(
        gradient_clip=0.3, learning_rate=0.01, tau=8.0, hidden_layers=0
    ),
}


def clipless_network(dataset: str, scattering: bool | None) -> str:
    """The clipless network of a run: ``"scattering"`` when asked, the CNN or the MLP when
    not, the data set's :data:`CLIPLESS_NETWORKS` when ``scattering`` is ``None``."""
    if scattering is None:
        return CLIPLESS_NETWORKS[dataset]
    if scattering:
        return "scattering"
    return "cnn" if dataset in IMAGE_DATASETS else "mlp"


def clipless_defaults(dataset: str, scattering: bool | None = None) -> CliplessDefaults:
    """:data:`CLIPLESS_DEFAULTS` of the network :func:`clipless_network` picks."""
    return CLIPLESS_DEFAULTS[dataset, clipless_network(dataset, scattering)]


def default_optimizer(dataset: str, method: str, scattering: bool | None = None) -> str:
    """The optimiser of a run that does not name one: Adam for dp-sgd, the clipless
    network's otherwise (Adam for a network the data set cannot have, e.g. scattering on
    tabular data, which the run refuses anyway)."""
    if method == "dp-sgd":
        return "adam"
    defaults = CLIPLESS_DEFAULTS.get((dataset, clipless_network(dataset, scattering)))
    return "adam" if defaults is None else defaults.optimizer


def default_scattering(dataset: str, method: str) -> bool:
    """Whether a run of ``method`` on ``dataset`` has the scattering network when the user
    does not say: the clipless methods' :data:`CLIPLESS_NETWORKS`; never for dp-sgd (its
    default network is the plain CNN, ``--scattering`` asks for the other)."""
    return method != "dp-sgd" and CLIPLESS_NETWORKS[dataset] == "scattering"


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
    "NETWORKS",
    "CLIPLESS_NETWORKS",
    "CLIPLESS_DEFAULTS",
    "clipless_network",
    "clipless_defaults",
    "default_optimizer",
    "default_scattering",
    "SAMPLINGS",
    "NOISE_STRATEGIES",
    "CLIPPING_MODES",
    "GRADIENT_METHODS",
    "OPTIMIZERS",
    "ADVERSARIAL_NORMS",
    "ACCOUNTANTS",
    "SCATTERING_GROUPS_PER_CHANNEL",
]
