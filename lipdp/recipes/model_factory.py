"""The compiled model of a :class:`~lipdp.recipes.recipe_config.ModelRecipe`: what
``lipdp train`` trains, built without the command line.

:func:`build_model` compiles the recipe's network for the training set's
:func:`run_metadata`: clipless methods, :func:`architecture`'s zoo network in a
``DP_Sequential``; ``dp-sgd``, :func:`keras_layers` in a ``DPSGD_Sequential``. Its pieces
are functions of the recipe: :func:`dp_parameters`, :func:`optimizer`, :func:`clipping`,
:func:`ascent`, :func:`adversarial`. The benchmarks and the tests that study "the CLI's
model" build it here (or with :func:`lipdp.recipes.runs.model_and_arrays`).

TensorFlow and the families are imported by the functions that build a model, not by this
module.
"""

from __future__ import annotations

import math

from lipdp.recipes import defaults as D
from lipdp.recipes.recipe_config import ModelRecipe


def run_metadata(recipe: ModelRecipe, data):
    """The :class:`~lipdp.foundation.metadata.DatasetMetadata` of ``recipe`` on ``data``: the
    public input bound of the data set; with ``sampling="shuffle"`` only whole batches
    (the remainder is dropped, rule S5); Poisson batches use every training example."""
    from lipdp.foundation.metadata import DatasetMetadata

    recipe = recipe.resolved()
    n_train = len(data.x_train)
    if recipe.batch_size > n_train:
        raise ValueError(f"batch_size {recipe.batch_size} exceeds the {n_train} training examples.")
    if recipe.sampling == "shuffle":
        n_train -= n_train % recipe.batch_size
    return DatasetMetadata(
        input_shape=data.x_train.shape[1:],
        nb_classes=data.nb_classes,
        nb_samples_train=n_train,
        nb_samples_test=len(data.x_test),
        class_names=data.class_names,
        batch_size=recipe.batch_size,
        max_norm=D.INPUT_BOUNDS[recipe.dataset],
        sampling=recipe.sampling,
    )


def dp_parameters(recipe: ModelRecipe):
    """The :class:`~lipdp.core.parameters.DPParameters` of ``recipe``."""
    from lipdp.core.parameters import DPParameters

    recipe = recipe.resolved()
    sigma = 0.0 if recipe.non_private else recipe.noise_multiplier
    return DPParameters(recipe.strategy, sigma, recipe.delta, non_private=recipe.non_private)


def optimizer(recipe: ModelRecipe):
    """Adam, or SGD with ``momentum``, at the recipe's learning rate. The noise is added
    before the optimiser, so either is post-processing."""
    import keras

    recipe = recipe.resolved()
    if recipe.optimizer == "sgd":
        return keras.optimizers.SGD(recipe.learning_rate, momentum=recipe.momentum)
    return keras.optimizers.Adam(recipe.learning_rate)


def clipping(recipe: ModelRecipe):
    """The :class:`~lipdp.clipped.model.Clipping` of a dp-sgd recipe (``None`` for the
    clipless methods: their sensitivities are the layers' bounds)."""
    from lipdp.clipped.clipping import Clipping

    if recipe.method != "dp-sgd":
        return None
    threshold = recipe.clip_threshold if recipe.clipping == "global" else None
    return Clipping(recipe.clipping, recipe.clip_norm, threshold=threshold)


def ascent(recipe: ModelRecipe):
    """The BAM or DP-SAT :class:`~lipdp.clipped.model.SharpnessAscent` (or ``None``)."""
    from lipdp.clipped.sharpness import SharpnessAscent

    if recipe.bam is not None:
        return SharpnessAscent("bam", recipe.bam)
    return None if recipe.dp_sat is None else SharpnessAscent("dp-sat", recipe.dp_sat)


def adversarial(recipe: ModelRecipe):
    """The :class:`~lipdp.core.adversarial.PGD` of adversarial training (or ``None``),
    its examples kept in the data set's public value range
    (:data:`~lipdp.recipes.defaults.FEATURE_RANGES`)."""
    from lipdp.core.adversarial import PGD

    if recipe.adversarial_radius is None:
        return None
    return PGD(
        recipe.adversarial_radius,
        recipe.adversarial_norm,
        steps=recipe.adversarial_steps,
        mix=recipe.adversarial_mix,
        clip_values=D.FEATURE_RANGES[recipe.dataset],
        trades_beta=recipe.trades,
    )


def _scattering_groups(group_norm, channels) -> int:
    return group_norm or D.SCATTERING_GROUPS_PER_CHANNEL * channels


def architecture(recipe: ModelRecipe) -> tuple[str, dict]:
    """``(zoo name, builder options)`` of a clipless recipe's network: on images
    :func:`~lipdp.recipes.zoo.pooled_cnn` (:data:`~lipdp.recipes.defaults.CNN_WIDTHS`), or
    the same network with norm balls (:func:`~lipdp.recipes.zoo.lip_convnet`) when the
    method, ``weight_norm_bound`` or ``group_norm`` ask for them; on breast cancer
    :func:`~lipdp.recipes.zoo.lip_mlp` with the data set's ``hidden_layers`` (0: a linear
    classifier; at least 1 with ``group_norm``); with ``scattering``
    :func:`~lipdp.recipes.zoo.scattering_net`."""
    recipe = ModelRecipe.coerce(recipe).resolved()
    adaptive = recipe.method == "lip-dp-sgd"
    if recipe.scattering:
        return "scattering_net", dict(
            weight_norm_bound=recipe.weight_norm_bound,
            adaptive_norm=adaptive,
            constraint="spectral",
            groups=_scattering_groups(recipe.group_norm, 1),
        )
    ball = dict(
        weight_norm_bound=recipe.weight_norm_bound,
        adaptive_norm=adaptive,
        constraint="spectral" if adaptive else "orthogonal",
        group_norm=recipe.group_norm,
        alpha=recipe.group_norm_alpha,
    )
    if recipe.dataset == "breast_cancer":
        depth = D.clipless_defaults(recipe.dataset, False).hidden_layers
        if recipe.group_norm is not None:  # a group normalisation follows a hidden layer
            depth = max(depth, 1)
        return "lip_mlp", dict(width=D.MLP_WIDTH, depth=depth, **ball)
    widths = D.CNN_WIDTHS[recipe.dataset]
    if not adaptive and recipe.weight_norm_bound == 1.0 and recipe.group_norm is None:
        return "pooled_cnn", dict(widths=widths)
    # The same network as pooled_cnn, with norm balls (and group normalisation).
    return "lip_convnet", dict(widths=widths, dense=None, activation="groupsort", **ball)


def keras_layers(recipe: ModelRecipe, input_shape, nb_classes) -> list:
    """The network of ``method="dp-sgd"``: ordinary Keras layers of the same size as the
    Lipschitz networks (tanh, as the tempered-sigmoid CNNs of DP-SGD; no batch norm), or
    with ``scattering`` the weightless scattering front-end and a Dense head."""
    import keras

    from lipdp.foundation import compat

    recipe = ModelRecipe.coerce(recipe).resolved()
    if recipe.scattering:
        return _keras_scattering_layers(recipe, input_shape, nb_classes)
    stack = [compat.input_layer(input_shape)]
    if recipe.dataset == "breast_cancer":
        return [
            *stack,
            keras.layers.Dense(D.MLP_WIDTH, activation="relu"),
            keras.layers.Dense(nb_classes),
        ]
    for width in D.CNN_WIDTHS[recipe.dataset]:
        stack += [
            keras.layers.Conv2D(width, 3, padding="same", activation="tanh"),
            keras.layers.MaxPool2D(2),
        ]
    return stack + [keras.layers.Flatten(), keras.layers.Dense(nb_classes)]


def _keras_scattering_layers(recipe, input_shape, nb_classes) -> list:
    import keras

    from lipdp.clipless import layers
    from lipdp.foundation import compat
    from lipdp.recipes import zoo

    groups = _scattering_groups(recipe.group_norm, input_shape[-1])
    return [
        compat.input_layer(input_shape),
        layers.DP_ScatteringTransform(padding="zeros", name="scattering"),
        layers.DP_GroupNormalization(groups, zoo.SCATTERING_ALPHA),
        keras.layers.Flatten(),
        keras.layers.Dense(nb_classes),
    ]


def build_model(recipe: ModelRecipe, metadata, layers=None):
    """The compiled model of ``recipe`` for the training set ``metadata``
    (:func:`run_metadata`); ``layers``: these layers instead of the recipe's network (the
    head of the feature cache of :func:`lipdp.recipes.runs.fit`, or the network rebuilt
    from its trained layers).

    Clipless methods: :func:`architecture`'s zoo network (``DP_ClipGradient(c)`` after the
    logits with ``gradient_clip=c``) in a ``DP_Sequential``, loss
    ``DP_TauCategoricalCrossentropy(tau)``. ``dp-sgd``: :func:`keras_layers` in a
    ``DPSGD_Sequential`` with :func:`clipping`, :func:`ascent` and ``gradient_method``,
    loss cross-entropy on the logits. Either family trains on :func:`adversarial`'s PGD
    examples when ``adversarial_radius`` is set; optimiser :func:`optimizer`; metric
    accuracy.
    """
    import keras

    from lipdp.clipless import losses

    recipe = ModelRecipe.coerce(recipe).resolved()
    if recipe.method == "dp-sgd":
        model = _clipped_model(recipe, metadata, layers)
        loss = keras.losses.CategoricalCrossentropy(from_logits=True)
    else:
        model = _clipless_model(recipe, metadata, layers)
        loss = losses.DP_TauCategoricalCrossentropy(tau=recipe.tau)
    model.compile(loss=loss, optimizer=optimizer(recipe), metrics=["accuracy"])
    return model


def _clipped_model(recipe, metadata, layers=None):
    from lipdp.clipped.model import DPSGD_Sequential

    if layers is None:
        layers = keras_layers(recipe, metadata.input_shape, metadata.nb_classes)
    return DPSGD_Sequential(
        layers,
        dp_parameters=dp_parameters(recipe),
        clipping=clipping(recipe),
        dataset_metadata=metadata,
        ascent=ascent(recipe),
        gradient_method=recipe.gradient_method,
        adversarial=adversarial(recipe),
        physical_batch_size=recipe.physical_batch_size,
    )


def _clipless_model(recipe, metadata, layers=None):
    from lipdp.clipless.model import DP_Sequential

    stack = _clipless_layers(recipe, metadata) if layers is None else layers
    model = DP_Sequential(
        stack,
        dp_parameters=dp_parameters(recipe),
        dataset_metadata=metadata,
        physical_batch_size=recipe.physical_batch_size,
    )
    model.adversarial = adversarial(recipe)
    return model


def _clipless_layers(recipe, metadata) -> list:
    from lipdp.clipless.layers import DP_ClipGradient
    from lipdp.recipes import zoo

    name, options = architecture(recipe)
    stack = zoo.ZOO[name](metadata, **options)  # looked up now: the registry can be patched
    if recipe.gradient_clip is not None and recipe.gradient_clip != math.inf:
        stack.append(DP_ClipGradient(recipe.gradient_clip))
    return stack


__all__ = [
    "run_metadata",
    "dp_parameters",
    "optimizer",
    "clipping",
    "ascent",
    "adversarial",
    "architecture",
    "keras_layers",
    "build_model",
]
