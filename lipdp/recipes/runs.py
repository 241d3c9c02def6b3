"""Run recipes: ``lipdp train`` and ``lipdp evaluate`` without the command line.

A run is described by two frozen, validated configurations (:class:`lipdp.core.config.Config`:
``to_config`` / ``from_config`` round-trip through plain dicts):

* :class:`ModelRecipe`, everything the compiled model reads: the data set (its public input
  bound :data:`~lipdp.recipes.defaults.INPUT_BOUNDS`), the method, the privacy parameters,
  the network's options, the optimiser, clipping and adversarial training;
* :class:`RunConfig`, a model recipe and the run around it: the budget ``epsilon``, the
  epochs, the accountant, weight averaging, the seed and where the data lives.

Every field is named after the ``lipdp train`` option of the same name (``--clip-norm`` is
``clip_norm``) and has its default; ``None`` for ``batch_size``, ``noise_multiplier``,
``learning_rate``, ``optimizer``, ``momentum``, ``weight_norm_bound``, ``scattering``,
``gradient_clip`` and ``tau`` means the default of the data set and the network for the
method (:data:`~lipdp.recipes.defaults.DEFAULTS`,
:data:`~lipdp.recipes.defaults.CLIPLESS_DEFAULTS`; :meth:`ModelRecipe.resolved`).
A setting that the recipe's network would not read is refused in one line when it differs
from its default (``clip_norm=2`` with ``method="lipdp"``): a recipe never silently drops
a choice.

:func:`train` is what ``lipdp train`` does: :func:`prepare` (seed, data, compiled model,
epochs within the budget), :func:`fit` (Poisson batches, the accountant callback) and
:func:`metrics_on_test_set`; :func:`evaluate_model` is what ``lipdp evaluate`` reports. The
benchmarks and the tests that study "the CLI's model" build it with :func:`build_model`
(or :func:`model_and_arrays`).

TensorFlow is imported by the functions that build or train a model, not by this module:
the command line validates its arguments and answers ``--help`` without it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from lipdp.core import validation
from lipdp.core.config import Config
from lipdp.recipes import defaults as D


def _optional(check, name, value):
    """``check(name, value)`` unless ``value`` is ``None`` (the setting is off)."""
    return None if value is None else check(name, value)


def _positive_count(name, value) -> int:
    return validation.count(name, value, 1)


def _decay(name, value) -> float:
    """A number in ``[0, 1)``: a momentum or an averaging decay."""
    return validation.real(name, value, low=0.0, high=1.0, low_open=False)


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelRecipe(Config):
    """The compiled model of a run (module docstring; each field is the ``lipdp train``
    option of the same name).

    Attributes:
        dataset: one of :data:`~lipdp.recipes.defaults.DATASETS`.
        method: ``"lipdp"``, ``"lip-dp-sgd"`` or ``"dp-sgd"``
            (:data:`~lipdp.recipes.defaults.METHODS`).
        batch_size: expected batch size ``b``; ``None``: the data set's default.
        noise_multiplier: ``sigma > 0``; ``None``: the data set's default.
        delta: the ``delta`` of the guarantee, in ``(0, 1)``.
        strategy: ``"global"`` (one Gaussian mechanism) or ``"per-layer"``.
        sampling: ``"poisson"`` (batches of rate ``b / N``, what the accountant analyses) or
            ``"shuffle"`` (fixed-size batches; the remainder is dropped, rule S5).
        non_private: a noiseless reference (``noise_multiplier`` must then be unset).
        learning_rate: step of the optimiser; ``None``: the default of the network
            (clipless, :func:`~lipdp.recipes.defaults.clipless_defaults`; an SGD network's
            rate is not Adam's: give one with ``optimizer="adam"``) or of the data set
            (dp-sgd).
        optimizer: ``"adam"`` or ``"sgd"``; ``momentum`` in ``[0, 1)`` (SGD only); ``None``:
            the network's default (clipless), Adam (dp-sgd); momentum: the network's with
            its own optimiser, else 0.
        weight_norm_bound: ``C``, the radius of every kernel's ball (clipless methods);
            ``None``: the network's default.
        group_norm, group_norm_alpha: groups and ``alpha`` of a group normalisation after
            each hidden layer (clipless; with ``scattering``, the groups of its
            normalisation, whose alpha is fixed).
        scattering: a scattering front-end (images only); ``None``: the data set's default
            for the method (:func:`~lipdp.recipes.defaults.default_scattering`).
        gradient_clip: clip each example's logit gradient at this norm (clipless); ``None``:
            the network's default (:data:`~lipdp.recipes.defaults.CLIPLESS_DEFAULTS`),
            ``math.inf``: no clipping.
        tau: temperature of the clipless loss ``DP_TauCategoricalCrossentropy(tau)``;
            ``None``: the network's default.
        clipping, clip_norm, clip_threshold, gradient_method, bam, dp_sat: clipped DP-SGD's
            per-example clipping (:class:`lipdp.clipped.model.Clipping`), its gradient
            norms and its ascent step (:class:`lipdp.clipped.model.SharpnessAscent`).
        adversarial_radius, adversarial_norm, adversarial_steps, adversarial_mix, trades:
            PGD adversarial training (:class:`lipdp.core.adversarial.PGD`), off when the
            radius is ``None``.
    """

    argument_name = "model"
    optional = False

    dataset: str = "digits"
    method: str = "lipdp"
    batch_size: int | None = None
    noise_multiplier: float | None = None
    delta: float = 1e-5
    strategy: str = "global"
    sampling: str = "poisson"
    non_private: bool = False
    learning_rate: float | None = None
    optimizer: str | None = None
    momentum: float | None = None
    weight_norm_bound: float | None = None
    group_norm: int | None = None
    group_norm_alpha: float = 1.0
    scattering: bool | None = None
    gradient_clip: float | None = None
    tau: float | None = None
    clipping: str = "flat"
    clip_norm: float = 1.0
    clip_threshold: float | None = None
    gradient_method: str = "ghost"
    bam: float | None = None
    dp_sat: float | None = None
    adversarial_radius: float | None = None
    adversarial_norm: str = "l2"
    adversarial_steps: int = 10
    adversarial_mix: float = 1.0
    trades: float | None = None

    def __post_init__(self):
        self._check_choices()
        self._check_numbers()
        self._check_adversarial_numbers()
        self._check_combinations()
        _refuse_unused_settings(self)

    def _check_choices(self):
        validation.choice("dataset", self.dataset, D.DATASETS)
        validation.choice("method", self.method, D.METHODS)
        validation.choice("strategy", self.strategy, D.NOISE_STRATEGIES)
        validation.choice("sampling", self.sampling, D.SAMPLINGS)
        if self.optimizer is not None:
            validation.choice("optimizer", self.optimizer, D.OPTIMIZERS)
        validation.choice("clipping", self.clipping, D.CLIPPING_MODES)
        validation.choice("gradient_method", self.gradient_method, D.GRADIENT_METHODS)
        validation.choice("adversarial_norm", self.adversarial_norm, D.ADVERSARIAL_NORMS)
        self._set("non_private", bool(self.non_private))
        if self.scattering is not None:
            self._set("scattering", bool(self.scattering))

    def _check_numbers(self):
        self._set("batch_size", _optional(_positive_count, "batch_size", self.batch_size))
        sigma = _optional(validation.positive, "noise_multiplier", self.noise_multiplier)
        self._set("noise_multiplier", sigma)
        self._set("delta", validation.delta(self.delta))
        rate = _optional(validation.positive, "learning_rate", self.learning_rate)
        self._set("learning_rate", rate)
        self._set("momentum", _optional(_decay, "momentum", self.momentum))
        bound = _optional(validation.positive, "weight_norm_bound", self.weight_norm_bound)
        self._set("weight_norm_bound", bound)
        self._set("group_norm", _optional(_positive_count, "group_norm", self.group_norm))
        self._set(
            "group_norm_alpha", validation.positive("group_norm_alpha", self.group_norm_alpha)
        )
        if self.gradient_clip != math.inf:  # math.inf: no clipping (off, not a bound)
            clip = _optional(validation.positive, "gradient_clip", self.gradient_clip)
            self._set("gradient_clip", clip)
        self._set("tau", _optional(validation.positive, "tau", self.tau))
        self._set("clip_norm", validation.positive("clip_norm", self.clip_norm))
        threshold = _optional(validation.positive, "clip_threshold", self.clip_threshold)
        self._set("clip_threshold", threshold)
        self._set("bam", _optional(validation.positive, "bam", self.bam))
        self._set("dp_sat", _optional(validation.positive, "dp_sat", self.dp_sat))

    def _check_adversarial_numbers(self):
        radius = _optional(validation.positive, "adversarial_radius", self.adversarial_radius)
        self._set("adversarial_radius", radius)
        self._set("adversarial_steps", _positive_count("adversarial_steps", self.adversarial_steps))
        mix = validation.real(
            "adversarial_mix", self.adversarial_mix, low=0.0, high=1.0, high_open=False
        )
        self._set("adversarial_mix", mix)
        self._set("trades", _optional(validation.positive, "trades", self.trades))

    def _check_combinations(self):
        if self.scattering and self.dataset not in D.IMAGE_DATASETS:
            raise ValueError(f"scattering needs images; {self.dataset} is tabular.")
        if self.non_private and self.noise_multiplier is not None:
            raise ValueError(
                "non_private=True is a noiseless reference: leave noise_multiplier unset."
            )
        if self.bam is not None and self.dp_sat is not None:
            raise ValueError("bam and dp_sat are two ascent steps: give one of them.")
        needs_threshold = self.method == "dp-sgd" and self.clipping == "global"
        if needs_threshold and self.clip_threshold is None:
            raise ValueError(
                "clipping='global' needs clip_threshold=Z (the norm above which an example's "
                "gradient is dropped)."
            )

    def resolved(self) -> ModelRecipe:
        """This recipe with the defaults in place of ``None``: the network (scattering or
        not), the batch size, the noise multiplier (still ``None`` for a non-private
        reference, whose noise is 0), the optimiser, its learning rate and momentum and,
        for the clipless methods, the kernels' radius, the logit-gradient clip and the
        temperature (:func:`~lipdp.recipes.defaults.clipless_defaults` of the network,
        then the data set's :data:`~lipdp.recipes.defaults.DEFAULTS`). Idempotent."""
        scattering = _scattering(self)
        if self.method == "dp-sgd":
            default = D.DEFAULTS[self.dataset]
            return self._filled(scattering, default, "adam", 0.0, default.learning_rate)
        net = D.clipless_defaults(self.dataset, scattering)
        clip = net.gradient_clip if self.gradient_clip is None else self.gradient_clip
        own = self.optimizer in (None, net.optimizer)
        # An SGD rate scales the (tiny) clipped gradients; Adam's step ignores their scale,
        # so the published SGD rate of 16 would be a step of 16 per coordinate: refused.
        # (An Adam network's rate has always served SGD as well.)
        if self.learning_rate is None and net.optimizer == "sgd" and not own:
            raise ValueError(
                f"learning_rate: the default {net.learning_rate:g} is for optimizer "
                f"{net.optimizer!r} of this network on {self.dataset}; give learning_rate "
                f"with optimizer={self.optimizer!r}."
            )
        filled = self._filled(
            scattering, net, net.optimizer, net.momentum if own else 0.0, net.learning_rate
        )
        bound = self.weight_norm_bound or net.weight_norm_bound
        return dataclasses.replace(
            filled, weight_norm_bound=bound, gradient_clip=clip, tau=self.tau or net.tau
        )

    def _filled(self, scattering, default, optimizer, momentum, learning_rate) -> ModelRecipe:
        """The settings both families resolve: ``default`` holds ``batch_size`` and
        ``noise_multiplier`` (``None``: the data set's)."""
        dataset = D.DEFAULTS[self.dataset]
        sigma = self.noise_multiplier or default.noise_multiplier or dataset.noise_multiplier
        optimizer = self.optimizer or optimizer
        sgd = optimizer == "sgd"
        return dataclasses.replace(
            self,
            scattering=scattering,
            batch_size=self.batch_size or default.batch_size or dataset.batch_size,
            noise_multiplier=None if self.non_private else sigma,
            optimizer=optimizer,
            momentum=(momentum if self.momentum is None else self.momentum) if sgd else None,
            learning_rate=self.learning_rate or learning_rate,
        )


def _scattering(recipe) -> bool:
    """The recipe's ``scattering``, or its data set's default for its method."""
    if recipe.scattering is not None:
        return recipe.scattering
    return D.default_scattering(recipe.dataset, recipe.method)


def _optimizer(recipe, scattering) -> str:
    """The recipe's optimiser, or its network's default (Adam for dp-sgd)."""
    return recipe.optimizer or D.default_optimizer(recipe.dataset, recipe.method, scattering)


def _unused_settings(recipe) -> dict:
    """``{field: why}`` for the settings that the recipe's network does not read."""
    unused = {}
    scattering = _scattering(recipe)
    if recipe.method == "dp-sgd":
        clipless = "applies to the clipless methods (lipdp, lip-dp-sgd) only"
        unused.update(weight_norm_bound=clipless, gradient_clip=clipless, tau=clipless)
        if not scattering:
            unused["group_norm"] = "applies to the clipless methods, or to dp-sgd with scattering"
    else:
        why = f"applies to method='dp-sgd' only (method {recipe.method!r} clips no gradient)"
        for name in ("clipping", "clip_norm", "clip_threshold", "gradient_method", "bam", "dp_sat"):
            unused[name] = why
    if recipe.method == "dp-sgd" and recipe.clipping != "global":
        unused["clip_threshold"] = "applies to clipping='global' only"
    if scattering or recipe.method == "dp-sgd" or recipe.group_norm is None:
        unused["group_norm_alpha"] = "applies to the group normalisation of group_norm only"
    if _optimizer(recipe, scattering) != "sgd":
        unused["momentum"] = "applies to optimizer='sgd' only (Adam keeps its own moments)"
    if recipe.adversarial_radius is None:
        for name in ("adversarial_norm", "adversarial_steps", "adversarial_mix", "trades"):
            unused[name] = "needs adversarial_radius (without it there is no adversarial training)"
    elif recipe.trades is not None:
        unused["adversarial_mix"] = "does not apply with trades (its loss replaces the mix)"
    return unused


def _refuse_unused_settings(recipe) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(recipe)}
    for name, why in _unused_settings(recipe).items():
        value = getattr(recipe, name)
        if value != defaults[name]:
            raise ValueError(f"{name}={value!r} {why}.")


# ----------------------------------------------------------------------------- the run
@dataclass(frozen=True)
class RunConfig(Config):
    """A training run: a :class:`ModelRecipe` and what the training loop reads.

    Attributes:
        model: the :class:`ModelRecipe` (or its config dict).
        epsilon: the budget; training stops before exceeding it (``DP_Accountant``).
        epochs: ``None``: the most epochs within the budget (``get_max_epochs``).
        accountant: ``"rdp"``, ``"pld"`` or ``"gdp"`` (the last is an approximation).
        averaging: decay of an exponential moving average of the weights, evaluated at
            the end (post-processing); ``None``: none.
        seed: the seed of the initial weights (Python, NumPy and TensorFlow); the noise and
            the Poisson batches draw from the operating system's entropy regardless.
        data_dir: ``fashion_mnist`` only: the directory of its IDX files.
        cache_features: a network that opens with a fixed front-end (the scattering
            transform and its per-example normalisation: no weights, no statistic of the
            data) trains its head on the front-end's outputs, computed once, instead of
            recomputing them at every step (:func:`fit`); the same mechanism, the same
            model. Not with adversarial training (its attack needs the whole network).
    """

    argument_name = "run"
    optional = False

    model: ModelRecipe = field(default_factory=ModelRecipe)
    epsilon: float = 3.0
    epochs: int | None = None
    accountant: str = "rdp"
    averaging: float | None = None
    seed: int = 0
    data_dir: str | None = None
    cache_features: bool = True

    def __post_init__(self):
        self._set("model", ModelRecipe.coerce(self.model))
        self._set("epsilon", validation.positive("epsilon", self.epsilon))
        self._set("epochs", _optional(_positive_count, "epochs", self.epochs))
        validation.choice("accountant", self.accountant, D.ACCOUNTANTS)
        self._set("averaging", _optional(_decay, "averaging", self.averaging))
        self._set("seed", validation.count("seed", self.seed, 0))
        self._set("cache_features", bool(self.cache_features))
        if self.data_dir is not None and self.model.dataset != "fashion_mnist":
            raise ValueError(
                f"data_dir applies to dataset='fashion_mnist' only ({self.model.dataset} is "
                "bundled)."
            )


# ------------------------------------------------------------------------- the pieces
def set_seed(seed: int) -> None:
    """Seed Python, NumPy and TensorFlow (the initial weights of a run)."""
    import keras

    keras.utils.set_random_seed(seed)


def load_data(dataset: str, data_dir=None):
    """The :class:`~lipdp.data.sources.ArrayDataset` of ``dataset`` (``data_dir``:
    fashion_mnist's IDX files; default: where :mod:`lipdp.data.sources` looks)."""
    from lipdp.data import sources

    validation.choice("dataset", dataset, D.DATASETS)
    if dataset == "digits":
        return sources.load_digits()
    if dataset == "breast_cancer":
        return sources.load_breast_cancer()
    return sources.load_fashion_mnist(data_dir)


def one_hot(labels, nb_classes):
    """Class indices as float32 one-hot rows (what the losses of both families take)."""
    import numpy as np

    return np.eye(nb_classes, dtype="float32")[labels]


def run_metadata(recipe: ModelRecipe, data):
    """The :class:`~lipdp.core.metadata.DatasetMetadata` of ``recipe`` on ``data``: the
    public input bound of the data set; with ``sampling="shuffle"`` only whole batches
    (the remainder is dropped, rule S5); Poisson batches use every training example."""
    from lipdp.core.metadata import DatasetMetadata

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


def training_arrays(metadata, data):
    """``(x, y)``: the first ``metadata.nb_samples_train`` training examples, labels
    one-hot."""
    n_train = metadata.nb_samples_train
    return data.x_train[:n_train], one_hot(data.y_train[:n_train], data.nb_classes)


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

    from lipdp.core import compat

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
    from lipdp.core import compat
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
    head of :func:`fit`'s feature cache, or the network rebuilt from its trained layers).

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
    )


def _clipless_model(recipe, metadata, layers=None):
    from lipdp.clipless.model import DP_Sequential

    stack = _clipless_layers(recipe, metadata) if layers is None else layers
    model = DP_Sequential(stack, dp_parameters=dp_parameters(recipe), dataset_metadata=metadata)
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


def model_and_arrays(recipe: ModelRecipe, data):
    """``(compiled model, x_train, y_train)`` of ``recipe`` on ``data``: :func:`run_metadata`,
    :func:`build_model` and :func:`training_arrays` in one call."""
    metadata = run_metadata(recipe, data)
    return (build_model(recipe, metadata), *training_arrays(metadata, data))


# ---------------------------------------------------------------------------- training
@dataclass
class PreparedRun:
    """A run ready to train (:func:`prepare`): its data, its compiled model, the training
    arrays, the number of epochs and ``front_end``, the number of leading layers of the
    model whose outputs :func:`fit` computes once (0: none; ``RunConfig.cache_features``)."""

    run: RunConfig
    data: object
    model: object
    x_train: object
    y_train: object
    epochs: int
    front_end: int = 0


class TrainedRun(NamedTuple):
    """What :func:`train` returns: the trained model, the Keras ``History`` (``epsilon``
    logged every epoch by ``DP_Accountant``) and the test metrics (:func:`metrics_on_test_set`)."""

    model: object
    history: object
    test_metrics: dict


def prepare(run: RunConfig, data=None, strategy=None) -> PreparedRun:
    """Seed, data (``load_data`` unless given), the compiled model under ``strategy``
    (a ``tf.distribute`` strategy; default: TensorFlow's current one) and the epochs:
    ``run.epochs``, or the most within ``run.epsilon`` (``get_max_epochs``)."""
    import tensorflow as tf

    from lipdp.accounting.budget import get_max_epochs

    run = RunConfig.coerce(run)
    set_seed(run.seed)
    if data is None:
        data = load_data(run.model.dataset, run.data_dir)
    with (strategy or tf.distribute.get_strategy()).scope():
        model, x_train, y_train = model_and_arrays(run.model, data)
    epochs = run.epochs or get_max_epochs(run.epsilon, model, accountant=run.accountant)
    return PreparedRun(run, data, model, x_train, y_train, epochs, _cached_front_end(run, model))


def _cached_front_end(run: RunConfig, model) -> int:
    """The leading layers :func:`fit` computes once (``RunConfig.cache_features``)."""
    from lipdp.clipless.features import fixed_front_end

    if not run.cache_features or getattr(model, "adversarial", None) is not None:
        return 0
    return fixed_front_end(list(model.layers))


def training_callbacks(run: RunConfig) -> list:
    """``DP_Accountant`` (epsilon in the logs, the budget enforced) and, with ``averaging``,
    ``ParameterAveraging``."""
    from lipdp.core.callbacks import DP_Accountant, ParameterAveraging

    callbacks = [DP_Accountant(epsilon_budget=run.epsilon, accountant=run.accountant)]
    if run.averaging is not None:
        callbacks.append(ParameterAveraging(decay=run.averaging))
    return callbacks


def fit(prepared: PreparedRun, callbacks=(), verbose=0):
    """Train ``prepared.model`` for ``prepared.epochs``: on Poisson batches of rate
    ``b / N`` (the mechanism the accountant analyses) or, with ``sampling="shuffle"``, on
    fixed-size batches of a shuffle. ``callbacks`` come after :func:`training_callbacks`.
    Returns the Keras ``History``.

    With ``prepared.front_end`` (a fixed front-end, ``RunConfig.cache_features``) the
    model's head is trained instead, on the front-end's outputs computed once
    (:func:`_fit_on_features`), and ``prepared.model`` is then the whole network rebuilt
    from the trained layers; ``callbacks`` see the head."""
    if prepared.front_end:
        return _fit_on_features(prepared, callbacks, verbose)
    return _fit_model(prepared, prepared.model, prepared.x_train, callbacks, verbose)


def _fit_model(prepared: PreparedRun, model, x, callbacks, verbose):
    from lipdp.data.sampling import poisson_batches

    y = prepared.y_train
    every = training_callbacks(prepared.run) + list(callbacks)
    options = dict(epochs=prepared.epochs, verbose=verbose, callbacks=every)
    metadata = model.dataset_metadata
    if metadata.sampling == "poisson":
        rate, steps = metadata.sampling_rate, metadata.nb_steps_per_epochs
        return model.fit(poisson_batches(x, y, rate, steps), **options)
    return model.fit(x, y, batch_size=metadata.batch_size, **options)


def _fit_on_features(prepared: PreparedRun, callbacks, verbose):
    """Train the layers after the fixed front-end on its outputs, computed once.

    Why it is the same mechanism: the front-end maps each record to its features by a
    fixed function (:func:`lipdp.clipless.features.fixed_front_end`: no weights, no
    statistic of the data), so neighbouring training sets give feature sets that differ
    in one row, and the head's training is the whole network's training -- the same
    layers, the same batches, the same per-variable sensitivities (the head opens with
    ``DP_BoundedInput`` at the front-end's public output bound, the bound the whole
    network's bound pass has there; checked below) and the same noise. The whole network
    is then rebuilt from the trained layers: it shares the head's privacy ledger
    (:func:`lipdp.core.ledger.inherited_ledger`) and step count.
    """
    model, recipe = prepared.model, prepared.run.model
    head, features = feature_head(prepared)
    history = _fit_model(prepared, head, features, callbacks, verbose)
    with model.distribute_strategy.scope():
        whole = build_model(recipe, model.dataset_metadata, _with_input(model))
    whole.noisy_steps.assign(head.noisy_steps)
    prepared.model = whole
    return history


def feature_head(prepared: PreparedRun):
    """``(head, features)``: the compiled model of the layers after ``prepared``'s fixed
    front-end (sharing them with ``prepared.model``), opened by :func:`_head_input`, and
    the front-end's outputs on the training set, which it trains on (:func:`fit`). Its
    sensitivities are checked against the whole network's first."""
    from lipdp.clipless.features import apply_front_end

    if not prepared.front_end:
        raise ValueError("this run has no fixed front-end (PreparedRun.front_end is 0).")
    model = prepared.model
    front, rest = model.layers[: prepared.front_end], model.layers[prepared.front_end :]
    features = apply_front_end(front, prepared.x_train)
    with model.distribute_strategy.scope():
        layers = _head_input(front, features) + list(rest)
        head = build_model(prepared.run.model, model.dataset_metadata, layers)
    _refuse_smaller_sensitivities(head, model)
    return head, features


def _head_input(front, features) -> list:
    """The input layer of the head: ``DP_BoundedInput`` at the front-end's output bound
    (clipless), a plain input layer (dp-sgd: its sensitivity is its clipping norm)."""
    from lipdp.clipless.features import front_end_bound
    from lipdp.clipless.layers import DP_BoundedInput
    from lipdp.core import compat

    shape = features.shape[1:]
    if isinstance(front[0], DP_BoundedInput):
        return [DP_BoundedInput(shape, front_end_bound(front))]
    return [compat.input_layer(shape)]


def _with_input(model) -> list:
    """The layers of ``model``, with an input layer first when Keras keeps it out of
    ``model.layers`` (Keras 3's ``Sequential``)."""
    import keras

    from lipdp.clipless.layers import DP_BoundedInput
    from lipdp.core import compat

    layers = list(model.layers)
    if isinstance(layers[0], (keras.layers.InputLayer, DP_BoundedInput)):
        return layers
    return [compat.input_layer(model.dataset_metadata.input_shape), *layers]


def _refuse_smaller_sensitivities(head, model) -> None:
    """The head's sensitivities are the whole network's (clipless: its layers' bounds;
    dp-sgd: its clipping norms): a smaller one would under-state the noise the head needs."""
    whole = {entry.key: float(delta) for entry, delta in model.sensitivities()}
    for entry, delta in head.sensitivities():
        if float(delta) < whole[entry.key] * (1 - 1e-6):
            raise RuntimeError(
                f"the head trained on cached features bounds {entry.key} by {float(delta):g}, "
                f"below the whole network's {whole[entry.key]:g}: train without the cache "
                "(RunConfig(cache_features=False)) and report this."
            )


def metrics_on_test_set(model, data) -> dict:
    """``{"loss": ..., "accuracy": ...}`` of ``model`` on ``data``'s test set."""
    y_test = one_hot(data.y_test, data.nb_classes)
    return model.evaluate(data.x_test, y_test, verbose=0, return_dict=True)


def train(run: RunConfig, data=None, strategy=None, callbacks=(), verbose=0) -> TrainedRun:
    """``lipdp train`` without the printing: :func:`prepare`, :func:`fit`,
    :func:`metrics_on_test_set`. Returns ``(model, history, test_metrics)``."""
    prepared = prepare(run, data, strategy)
    history = fit(prepared, callbacks, verbose)
    return TrainedRun(prepared.model, history, metrics_on_test_set(prepared.model, prepared.data))


__all__ = [
    "ModelRecipe",
    "RunConfig",
    "PreparedRun",
    "TrainedRun",
    "set_seed",
    "load_data",
    "one_hot",
    "run_metadata",
    "training_arrays",
    "dp_parameters",
    "optimizer",
    "clipping",
    "ascent",
    "adversarial",
    "architecture",
    "keras_layers",
    "build_model",
    "model_and_arrays",
    "prepare",
    "feature_head",
    "training_callbacks",
    "fit",
    "metrics_on_test_set",
    "train",
]
