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
    """The hyper-parameters a run takes when none is given."""

    batch_size: int
    noise_multiplier: float
    learning_rate: float


#: Per data set, the default batch size, noise multiplier and learning rate.
DEFAULTS = {
    "digits": DatasetDefaults(512, 6.0, 0.02),
    "fashion_mnist": DatasetDefaults(2048, 2.0, 0.01),
    "breast_cancer": DatasetDefaults(64, 2.0, 0.01),
}

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
#: probabilities are ``softmax(tau * logits)``).
TAU = 8.0

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
    "SAMPLINGS",
    "NOISE_STRATEGIES",
    "CLIPPING_MODES",
    "GRADIENT_METHODS",
    "OPTIMIZERS",
    "ADVERSARIAL_NORMS",
    "ACCOUNTANTS",
    "TAU",
    "SCATTERING_GROUPS_PER_CHANNEL",
]
