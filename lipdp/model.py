"""DP models: Keras models whose training step is Clipless DP-SGD.

One training step (``DP_Model.train_step``):

1. forward and backward pass on the batch (loss = mean of per-example losses);
2. sensitivities ``Delta_v`` of the averaged gradient of every trainable variable,
   from the bound propagation of :mod:`lipdp.layers` (in-graph: the Python loop
   runs once, at tracing time, and leaves a handful of scalar ops);
3. Gaussian noise — ``"global"``: one isotropic noise of standard deviation
   ``sigma * sqrt(sum_v Delta_v^2)`` on every coordinate; ``"per-layer"``:
   ``sigma * c_v * Delta_v`` on variable ``v`` (``c_v`` the layer's ``nm_coef``);
4. the optimizer step on the noisy gradient (post-processing: any first-order
   Keras optimizer);
5. projection of every constrained weight onto its feasible set.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import numpy as np
import tensorflow as tf

from lipdp.layers import DP_BoundedInput, DP_ClipGradient, DP_InputLayer, DPLayer
from lipdp.pipeline import DatasetMetadata

logger = logging.getLogger(__name__)

NOISIFY_STRATEGIES = ("global", "per-layer")

#: Relative slack added to every sensitivity. The bounds are exact for real
#: arithmetic; gradients computed in float32 can exceed them by round-off (relative
#: ~1e-7 to 1e-6 was observed where a bound is tight). The slack covers it.
ROUNDOFF_SLACK = 1e-5

#: DP replacements suggested when a plain Keras or deel-lip layer is found.
_REPLACEMENTS = {
    "Dense": "DP_QuickSpectralDense or DP_SpectralDense (then DP_AddBias for a bias)",
    "SpectralDense": "DP_SpectralDense (trained by projection, rule S3)",
    "FrobeniusDense": "DP_QuickFrobeniusDense",
    "Conv2D": "DP_QuickSpectralConv2D or DP_SpectralConv2D",
    "SpectralConv2D": "DP_SpectralConv2D (trained by projection, rule S3)",
    "ReLU": "DP_ReLU",
    "Activation": "DP_ReLU or DP_GroupSort",
    "GroupSort": "DP_GroupSort",
    "MaxPooling2D": "DP_MaxPool2D",
    "AveragePooling2D": "DP_ScaledL2NormPooling2D",
    "ScaledL2NormPooling2D": "DP_ScaledL2NormPooling2D",
    "GlobalAveragePooling2D": "DP_ScaledGlobalL2NormPooling2D",
    "ScaledGlobalL2NormPooling2D": "DP_ScaledGlobalL2NormPooling2D",
    "Flatten": "DP_Flatten",
    "Reshape": "DP_Reshape",
    "Permute": "DP_Permute",
    "BatchNormalization": "DP_LayerCentering (batch statistics couple examples, rule S2)",
    "LayerNormalization": "DP_LayerCentering (no data-dependent scaling)",
    "InputLayer": "DP_BoundedInput",
    "Lambda": "DP_Lambda with a stated Lipschitz constant",
    "Dropout": "nothing: remove it (the 1/(1-rate) rescaling increases norms)",
    "Add": "make_residuals(...)",
}


@dataclass
class DPParameters:
    """Privacy parameters of a training run.

    Attributes:
        noisify_strategy: ``"global"`` or ``"per-layer"``.
        noise_multiplier: ``sigma > 0``; noise std = sigma x sensitivity.
        delta: target ``delta`` in ``(0, 1)`` of the ``(epsilon, delta)`` guarantee.
        non_private: ``True`` only for a reference run without noise
            (``noise_multiplier`` must then be 0): same network, same projections,
            no privacy.
    """

    noisify_strategy: str
    noise_multiplier: float
    delta: float
    non_private: bool = False

    def __post_init__(self):
        if self.noisify_strategy not in NOISIFY_STRATEGIES:
            raise ValueError(
                f"noisify_strategy must be one of {NOISIFY_STRATEGIES}, "
                f"got {self.noisify_strategy!r}."
            )
        self.noise_multiplier = float(self.noise_multiplier)
        if self.non_private:
            if self.noise_multiplier != 0:
                raise ValueError(
                    "non_private=True is for a noiseless reference: set noise_multiplier=0."
                )
        elif not self.noise_multiplier > 0:
            raise ValueError(
                f"noise_multiplier must be > 0, got {self.noise_multiplier}. For a "
                "non-private reference run pass non_private=True and noise_multiplier=0."
            )
        if not 0 < float(self.delta) < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}.")


def _describe(layer) -> str:
    return f"{layer.name!r} ({type(layer).__name__})"


def check_dp_layers(layers) -> None:
    """Refuse what the bound propagation cannot handle, with the fix in the message."""
    layers = list(layers)
    if not layers:
        raise ValueError("A DP model needs at least one layer.")
    for layer in layers:
        if not isinstance(layer, DPLayer):
            name = type(layer).__name__
            fix = _REPLACEMENTS.get(name, "a layer of lipdp.layers")
            raise TypeError(
                f"Layer {_describe(layer)} is not a DP layer: its sensitivity is unknown. "
                f"Use {fix} instead."
            )
    seen = set()
    for layer in _with_wrapped_blocks(layers):
        if id(layer) in seen:
            raise ValueError(
                f"Layer {_describe(layer)} appears twice: shared weights receive the sum of "
                "both gradients, which the per-layer bounds do not cover. Use two layers."
            )
        seen.add(id(layer))
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"Layer {_describe(layer)} has an activity_regularizer: a data-dependent loss "
                "term whose gradient is not bounded. Remove it."
            )
    first = 0
    while first < len(layers) and isinstance(layers[first], DP_InputLayer):
        first += 1
    if first == len(layers) or not isinstance(layers[first], DP_BoundedInput):
        got = _describe(layers[first]) if first < len(layers) else "nothing"
        raise ValueError(
            "The first layer of a DP model must be DP_BoundedInput(input_shape=..., "
            f"upper_bound=...) (optionally after DP_InputLayer); got {got}. The input norm "
            "bound is where every sensitivity bound starts."
        )


def _with_wrapped_blocks(layers):
    for layer in layers:
        yield layer
        block = getattr(layer, "block", None)
        if block is not None:
            yield block


def check_loss(loss) -> None:
    """The loss must state its Lipschitz constant and be a batch mean."""
    if not callable(getattr(loss, "get_L", None)):
        raise TypeError(
            f"The loss {loss!r} has no get_L(): its Lipschitz constant w.r.t. the logits is "
            "unknown. Use a loss of lipdp.losses, e.g. DP_TauCategoricalCrossentropy(tau=...)."
        )
    reduction = getattr(loss, "reduction", None)
    allowed = (tf.keras.losses.Reduction.AUTO, tf.keras.losses.Reduction.SUM_OVER_BATCH_SIZE)
    if reduction not in allowed:
        raise ValueError(
            f"Loss reduction {reduction!r} is not supported: sensitivities are computed for "
            "the mean over the batch. Use reduction=SUM_OVER_BATCH_SIZE (the default)."
        )


class DP_Model(tf.keras.Model):
    """A Keras model trained with Clipless DP-SGD.

    ``dp_layers`` are applied in order; residual blocks pass pairs between layers
    (:func:`lipdp.layers.make_residuals`).

    Args:
        dp_layers: list of DP layers, the first being :class:`DP_BoundedInput`.
        dp_parameters: :class:`DPParameters`.
        dataset_metadata: :class:`lipdp.pipeline.DatasetMetadata` (the batch size
            ``b`` and ``N``); required for training.
        debug: run eagerly and log every step's sensitivities and noise levels.
    """

    _layers_key = "dp_layers"

    def __init__(self, dp_layers, *, dp_parameters, dataset_metadata=None, debug=False, **kwargs):
        super().__init__(**kwargs)
        check_dp_layers(dp_layers)
        if not isinstance(dp_parameters, DPParameters):
            raise TypeError(f"dp_parameters must be a DPParameters, got {type(dp_parameters)}.")
        if dataset_metadata is not None and not isinstance(dataset_metadata, DatasetMetadata):
            raise TypeError("dataset_metadata must be a lipdp.pipeline.DatasetMetadata.")
        self.dp_layers = list(dp_layers)
        self.dp_parameters = dp_parameters
        self.dataset_metadata = dataset_metadata
        self.debug = bool(debug)
        #: Set by the callbacks of :mod:`lipdp.dynamic`; the accountant composes its cost.
        self.dynamic_clipping = None
        if dataset_metadata is not None:
            if dataset_metadata.sampling == "poisson" and dataset_metadata.multiplicity:
                raise ValueError(
                    "Augmentation multiplicity is not supported with Poisson sampling; "
                    "use sampling='shuffle' or multiplicity=0."
                )
            # The loss divides by the rows of a batch (b originals x m augmented copies),
            # so cotangents are clipped at C / rows: each copy's gradient at C.
            for layer in _with_wrapped_blocks(self.dp_layers):
                if isinstance(layer, DP_ClipGradient):
                    layer.batch_normalizer = dataset_metadata.rows_per_batch
        input_shape = getattr(self.dp_layers[0], "_batch_input_shape", None)
        if input_shape is not None:
            self.build(input_shape)

    # ----------------------------------------------------------------- structure
    def call(self, inputs, training=None):
        x = inputs
        for layer in self.dp_layers:
            x = layer(x, training=training)
        return x

    def layers_forward_order(self):
        return list(self.dp_layers)

    def layers_backward_order(self):
        return list(reversed(self.dp_layers))

    @property
    def batch_size(self) -> int:
        if self.dataset_metadata is None:
            raise ValueError(
                f"{type(self).__name__} needs dataset_metadata=DatasetMetadata(...) to train: "
                "the sensitivity depends on the batch size."
            )
        return int(self.dataset_metadata.batch_size)

    # ---------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
        check_loss(loss)
        if kwargs.get("loss_weights") is not None:
            raise ValueError("loss_weights is not supported: it rescales the sensitivity.")
        if self.debug:
            kwargs["run_eagerly"] = True
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    # ------------------------------------------------------------------ bounds
    def input_bounds(self):
        """Bound on the input norm of each layer (forward order) and on the output norm."""
        bounds, bound = [], None
        for layer in self.dp_layers:
            bounds.append(bound)
            bound = layer.propagate_inputs(bound)
        return bounds, bound

    def per_example_sensitivities(self):
        """``[(variable, bound, nm_coef)]``: bound on one example's gradient norm.

        The backward pass of bounds starts from ``get_L()`` of the compiled loss.
        """
        if not self.built:
            raise ValueError("Build the model (call it on data) before computing bounds.")
        check_loss(self.loss)
        input_bounds, _ = self.input_bounds()
        gradient_bound = self.loss.get_L()
        result = []
        for layer, input_bound in zip(reversed(self.dp_layers), reversed(input_bounds)):
            if layer.has_parameters():
                bounds = layer.backpropagate_params(input_bound, gradient_bound)
                bounds = list(bounds) if isinstance(bounds, (list, tuple)) else [bounds]
                variables = layer.trainable_variables
                if len(bounds) != len(variables):
                    raise RuntimeError(
                        f"{_describe(layer)} returned {len(bounds)} bounds for "
                        f"{len(variables)} trainable variables."
                    )
                result += [(v, b, layer.nm_coef) for v, b in zip(variables, bounds)]
            gradient_bound = layer.backpropagate_inputs(input_bound, gradient_bound)
        return result

    def _sensitivities(self):
        """``[(variable, Delta, nm_coef)]`` for the averaged gradient, checked complete.

        ``Delta = per-example bound * (1 + ROUNDOFF_SLACK) / b``.
        """
        scale = (1.0 + ROUNDOFF_SLACK) / self.batch_size
        result = [(v, bound * scale, c) for v, bound, c in self.per_example_sensitivities()]
        covered = {v.ref() for v, _, _ in result}
        missing = [v.name for v in self.trainable_variables if v.ref() not in covered]
        if missing:
            raise ValueError(
                f"No sensitivity bound for trainable variables {missing}: only DP layers "
                "may own trainable variables."
            )
        return result

    def noise_multipliers(self) -> list[float]:
        """Noise multipliers of the Gaussian mechanisms of one step, for the accountant.

        ``"global"``: one mechanism, ``[sigma]``. ``"per-layer"``: one mechanism per
        trainable variable, ``sigma * nm_coef`` each (their composition is a single
        Gaussian mechanism with ``sigma_eff = (sum_v sigma_v^-2)^(-1/2)``).
        """
        params = self.dp_parameters
        if params.noisify_strategy == "global":
            return [params.noise_multiplier]
        return [
            params.noise_multiplier * float(layer.nm_coef)
            for layer in self.dp_layers
            if layer.has_parameters()
            for _ in layer.trainable_variables
        ]

    # --------------------------------------------------------------- training
    def noisify(self, gradients, variables):
        """Add the calibrated Gaussian noise to ``gradients`` (aligned with ``variables``)."""
        params = self.dp_parameters
        by_ref = {v.ref(): (delta, coef) for v, delta, coef in self._sensitivities()}
        if params.non_private:
            return list(gradients)
        sigma = params.noise_multiplier
        if params.noisify_strategy == "global":
            total = tf.sqrt(
                tf.add_n([tf.square(tf.cast(d, tf.float32)) for d, _ in by_ref.values()])
            )
            stddevs = [sigma * total] * len(variables)
        else:
            stddevs = [
                sigma * by_ref[v.ref()][1] * tf.cast(by_ref[v.ref()][0], tf.float32)
                for v in variables
            ]
        if self.debug:
            for v, s in zip(variables, stddevs):
                logger.info(
                    "variable %s: sensitivity %.6g, noise std %.6g",
                    v.name,
                    float(by_ref[v.ref()][0]),
                    float(s),
                )
        return [
            g + tf.random.normal(tf.shape(g), stddev=s, dtype=g.dtype)
            for g, s in zip(gradients, stddevs)
        ]

    def project(self):
        """Project every constrained weight onto its feasible set."""
        for layer in self.dp_layers:
            layer.project()

    def train_step(self, data):
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("sample weights are not supported: they change the sensitivity.")
        batch_rows = tf.shape(tf.nest.flatten(x)[0])[0]
        if not self.poisson_sampling:
            # With augmentation multiplicity m a batch holds b originals x m copies; the
            # loss is their mean, so one original moves it by at most G / b still.
            rows = self.dataset_metadata.rows_per_batch
            tf.debugging.assert_equal(
                batch_rows,
                rows,
                message=(
                    f"DP training needs every batch to have exactly {rows} rows (batch_size="
                    f"{self.batch_size} x multiplicity; the sensitivity is computed for it); "
                    "drop the partial last batch (dataset.batch(b, drop_remainder=True))."
                ),
            )
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            self._refuse_extra_losses()
            loss = self.compute_loss(x, y, y_pred)
            if self.poisson_sampling:
                # Random batch sizes: the sum of per-example losses is divided by the
                # *expected* batch size q N (rule S5), the b of the sensitivities;
                # compute_loss divided it by the actual size (and returns 0 if empty).
                loss = loss * tf.cast(batch_rows, loss.dtype) / float(self.batch_size)
        variables = self.trainable_variables
        gradients = tape.gradient(loss, variables)
        gradients = [tf.zeros_like(v) if g is None else g for g, v in zip(gradients, variables)]
        self.optimizer.apply_gradients(zip(self.noisify(gradients, variables), variables))
        self.project()
        return self.compute_metrics(x, y, y_pred, None)

    @property
    def poisson_sampling(self) -> bool:
        return self.dataset_metadata is not None and self.dataset_metadata.sampling == "poisson"

    def _refuse_extra_losses(self):
        if self.losses:
            raise ValueError(
                "Additional losses (add_loss, regularizers) are not supported in DP "
                "training: the sensitivity bounds cover the compiled loss only."
            )

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_fit_arguments(x, batch_size, kwargs)
        # Weights set by hand (load_weights, set_weights) are brought back in the
        # feasible set before the first bound is trusted.
        self.project()
        return super().fit(x, y, batch_size, *args, **kwargs)

    def _check_fit_arguments(self, x, batch_size, kwargs):
        if self.compiled_loss is None:
            raise RuntimeError("Call compile(loss=..., optimizer=...) before fit().")
        b = self.batch_size
        for unsupported in ("sample_weight", "class_weight"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"{unsupported} is not supported: it changes the sensitivity.")
        if self.poisson_sampling:
            if not isinstance(x, tf.data.Dataset):
                raise ValueError(
                    "dataset_metadata.sampling='poisson' needs Poisson-sampled batches: pass "
                    "lipdp.pipeline.poisson_batches(x, y, sampling_rate, steps_per_epoch)."
                )
            return
        metadata = self.dataset_metadata
        if metadata.partial_last_batch:
            raise ValueError(
                "dataset_metadata.partial_last_batch: the last batch of each epoch is partial "
                "and would be refused mid-training. Prepare the data with drop_remainder=True."
            )
        if isinstance(x, tf.data.Dataset):
            static = tf.nest.flatten(x.element_spec)[0].shape[0]
            if static is not None and static != metadata.rows_per_batch:
                raise ValueError(
                    f"The dataset yields batches of {static}, the model expects "
                    f"{metadata.rows_per_batch} (batch_size={b} x multiplicity, "
                    "dataset_metadata)."
                )
            return
        if metadata.multiplicity:
            raise ValueError(
                "dataset_metadata.multiplicity > 0: pass the augmented tf.data pipeline of "
                "lipdp.pipeline.load_and_prepare_images_data, not arrays."
            )
        if x is None or isinstance(x, (tf.keras.utils.Sequence,)) or callable(x):
            return
        n = len(tf.nest.flatten(x)[0])
        if batch_size is not None and batch_size != b:
            raise ValueError(
                f"fit(batch_size={batch_size}) differs from the batch size "
                f"{b} declared in dataset_metadata."
            )
        split = kwargs.get("validation_split") or 0.0
        n_train = int(math.floor(n * (1.0 - split)))
        if n_train % b:
            raise ValueError(
                f"{n_train} training examples are not a multiple of batch_size={b}: the last "
                f"batch would be partial. Use {n_train - n_train % b} examples, or a "
                "tf.data pipeline with drop_remainder=True."
            )
        if kwargs.get("shuffle") is False:
            logger.warning(
                "fit(shuffle=False): batches are not random, so privacy "
                "amplification by subsampling does not apply."
            )

    # ---------------------------------------------------------- serialisation
    def get_compile_config(self):
        return super().get_compile_config()

    def compile_from_config(self, config):
        # Keras skips compile() on load for models overriding it; our compile only
        # adds checks, so the stored configuration is replayed through it.
        config = tf.keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built and isinstance(self.optimizer, tf.keras.optimizers.Optimizer):
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        return {
            self._layers_key: [tf.keras.layers.serialize(layer) for layer in self.dp_layers],
            "dp_parameters": asdict(self.dp_parameters),
            "dataset_metadata": (
                None if self.dataset_metadata is None else self.dataset_metadata.to_config()
            ),
            "debug": self.debug,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        layers = [
            tf.keras.layers.deserialize(c, custom_objects=custom_objects)
            for c in config.pop(cls._layers_key)
        ]
        metadata = config.pop("dataset_metadata")
        return cls(
            layers,
            dp_parameters=DPParameters(**config.pop("dp_parameters")),
            dataset_metadata=None if metadata is None else DatasetMetadata(**metadata),
            **config,
        )


class DP_Sequential(DP_Model):
    """``DP_Sequential(layers, dp_parameters=..., dataset_metadata=...)``: a stack of DP layers."""

    _layers_key = "layers"

    def __init__(self, layers, *, dp_parameters, dataset_metadata=None, debug=False, **kwargs):
        super().__init__(
            layers,
            dp_parameters=dp_parameters,
            dataset_metadata=dataset_metadata,
            debug=debug,
            **kwargs,
        )


tf.keras.utils.register_keras_serializable(package="lipdp")(DP_Model)
tf.keras.utils.register_keras_serializable(package="lipdp")(DP_Sequential)


def compute_gradient_bounds(model) -> dict:
    """Sensitivity of the *averaged* minibatch gradient of each trainable variable.

    Returns ``{"<layer name>/<variable>": Delta}`` with
    ``Delta = per-example bound * (1 + ROUNDOFF_SLACK) / b``.
    Keys are qualified by the owning DP layer because Keras does not keep variable
    names unique across save/load.
    """
    keys = {}
    for layer in model.dp_layers:
        for v in layer.trainable_variables:
            keys[v.ref()] = f"{layer.name}/{v.name.rsplit('/', 1)[-1]}"
    return {keys[v.ref()]: delta for v, delta, _ in model._sensitivities()}


def global_sensitivity(model) -> float:
    """``sqrt(sum_v Delta_v^2)``: the sensitivity of the whole averaged gradient."""
    return float(np.sqrt(sum(float(d) ** 2 for d in compute_gradient_bounds(model).values())))


# Re-exported for the API of the original package (``from lipdp.model import DP_Accountant``).
from lipdp.callbacks import DP_Accountant  # noqa: E402

__all__ = [
    "DPParameters",
    "DP_Model",
    "DP_Sequential",
    "DP_Accountant",
    "compute_gradient_bounds",
    "global_sensitivity",
]
