"""DP models: Keras models whose training step is Clipless DP-SGD.

One training step (:meth:`lipdp.core.private_model.PrivateModel.train_step`, shared with
the clipped family; this module gives its hooks):

1. forward and backward pass on the batch (loss = sum of the per-example losses divided
   by the loss normaliser of the metadata; a row with an unusable label counts 0, S9);
2. sensitivities ``Delta_v`` of the averaged gradient of every trainable variable,
   from the one bound pass of :mod:`lipdp.clipless.bounds` (in-graph: the Python loop runs once,
   at tracing time, and leaves a handful of scalar ops);
3. Gaussian noise by the one noise rule of :mod:`lipdp.core.noise` — ``"global"``: one
   isotropic noise of standard deviation ``sigma * sqrt(sum_v Delta_v^2)`` on every
   coordinate; ``"per-layer"``: ``sigma * c_v * Delta_v`` on variable ``v`` (``c_v``
   the layer's ``nm_coef``);
4. the optimizer step on the noisy gradient (post-processing: any first-order
   Keras optimizer);
5. projection of every constrained weight onto its feasible set.

The model's privacy plan (:meth:`DP_Model.privacy_plan`, :mod:`lipdp.accounting.plan`)
lists every mechanism a run releases: the noisy steps and the dynamic-clipping updates
declared in :class:`DPParameters`. ``get_eps_delta``, ``get_max_epochs``, the accountant
callback and the privacy report all read it.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import tensorflow as tf

from lipdp.clipless import layers as dp_layers
from lipdp.clipless.bounds import bound_pass, parameterized_variables
from lipdp.clipless.dynamic import dynamic_clip_layers
from lipdp.clipless.layers import DP_BoundedInput, DP_InputLayer, DPLayer
from lipdp.clipless.layers.fused import fused_kernels, no_fused_kernels
from lipdp.core.batch_independence import refuse_coupling_layers
from lipdp.core.noise import ROUNDOFF_SLACK
from lipdp.core.parameters import DPParameters
from lipdp.core.private_base import check_reduction
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import children
from lipdp.foundation.variables import variable_key

logger = logging.getLogger(__name__)

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


#: lipdp's own DP layers, which treat each example on its own: they run on the whole batch
#: under row isolation (:mod:`lipdp.core.isolation`). ``DP_Lambda`` (a user function) and
#: subclasses (which may change ``call``) are isolated.
_OWN_LAYERS = frozenset(
    getattr(dp_layers, name)
    for name in dp_layers.__all__
    if isinstance(getattr(dp_layers, name), type)
    and issubclass(getattr(dp_layers, name), keras.layers.Layer)
    and getattr(dp_layers, name) is not dp_layers.DP_Lambda
)


def runs_per_example(layer) -> bool:
    """Whether ``layer`` is one of lipdp's own DP layers (exact class, :data:`_OWN_LAYERS`)
    whose sub-layers (a residual block) all are: code of lipdp's that reduces over the
    non-batch axes only, run on the batch under row isolation."""
    return type(layer) in _OWN_LAYERS and all(runs_per_example(c) for c in children(layer))


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
            fix = _REPLACEMENTS.get(name, "a layer of lipdp.clipless.layers")
            raise TypeError(
                f"Layer {_describe(layer)} is not a DP layer: its sensitivity is unknown. "
                f"Use {fix} instead."
            )
    refuse_coupling_layers(layers)  # Keras layers nested in DP layers, at any depth (S2)
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
            "unknown. Use a loss of lipdp.clipless.losses, e.g. "
            "DP_TauCategoricalCrossentropy(tau=...)."
        )
    check_reduction(loss)


class CliplessFacts:
    """What the clipless family knows whatever the backend (a mixin of :class:`DP_Model`
    before its trainer): the layer and loss checks, the one bound pass and the
    sensitivities, the noise coefficients, the dynamic-clipping releases of the plan, the
    projections. Host code only (Python floats and the layers' own methods): the
    TensorFlow trainer (:class:`lipdp.core.private_model.PrivateModel`) evaluates it in its
    graph, the JAX trainer (:class:`lipdp.clipless.jax.trainer.CliplessJaxTrainer`) on the
    host when it makes its step."""

    _layers_key = "dp_layers"
    #: What the layers are checked with (the clipped family, :mod:`lipdp.clipped.model`, accepts
    #: ordinary Keras layers).
    _check_layers = staticmethod(check_dp_layers)

    def _all_layers(self):
        return list(_with_wrapped_blocks(self.dp_layers))

    def _runs_batched(self, layer) -> bool:
        """lipdp's own DP layers run on the batch under row isolation; ``DP_Lambda``, a
        user's DP layer and subclasses run one row at a time (:func:`runs_per_example`)."""
        return runs_per_example(layer)

    def isolated_layer_call(self, layer, h, training, kwargs):
        """The trainer's row-by-row call (TensorFlow) with the layers' fused XLA kernels
        off: ``pfor`` cannot vectorise them (:mod:`lipdp.clipless.layers.fused`)."""
        with no_fused_kernels():
            return super().isolated_layer_call(layer, h, training, kwargs)

    def _check_loss(self, loss) -> None:
        check_loss(loss)

    def _check_adversarial(self, pgd) -> None:
        if pgd.trades_beta is not None:
            raise ValueError(
                "TRADES is not available for clipless models: the gradient of its KL term with "
                "respect to the clean logits, p_k (log p_k - log q_k - KL), has no bound. Use "
                "PGD(..., mix=w) (adversarial loss), or the clipped family (DPSGD_Sequential)."
            )

    # ------------------------------------------------------------------ bounds
    def bounds(self):
        """The one bound pass (:func:`lipdp.clipless.bounds.bound_pass`) from the compiled loss."""
        if not self.built:
            raise ValueError("Build the model (call it on data) before computing bounds.")
        check_loss(self.loss)
        return bound_pass(self.dp_layers, self.loss.get_L())

    def input_bounds(self):
        """Bound on the input norm of each layer (forward order) and on the output norm."""
        bounds = bound_pass(self.dp_layers)
        return bounds.input_bounds, bounds.output_bound

    def per_example_sensitivities(self):
        """``[(variable, bound, nm_coef)]``: bound on one example's gradient norm."""
        return [(e.variable, e.bound, e.nm_coef) for e in self.bounds().variables]

    def sensitivities(self):
        """``[(VariableBound, Delta)]`` of the averaged gradient, checked complete
        (:meth:`lipdp.clipless.bounds.Bounds.sensitivities`)."""
        result = self.bounds().sensitivities(self.batch_size)
        covered = {variable_key(entry.variable) for entry, _ in result}
        missing = [v.name for v in self.trainable_variables if variable_key(v) not in covered]
        if missing:
            raise ValueError(
                f"No sensitivity bound for trainable variables {missing}: only DP layers "
                "may own trainable variables."
            )
        return result

    def _noise_coefficients(self) -> list[float]:
        """``nm_coef`` of the layer owning each trainable variable, forward order (the
        order of :meth:`sensitivities`), without the bound pass."""
        return [float(layer.nm_coef) for layer, _ in parameterized_variables(self.dp_layers)]

    def _noised_variables(self, entries) -> list[list]:
        """One variable per sensitivity entry."""
        return [[entry.variable] for entry, _ in entries]

    # ----------------------------------------------------------------- privacy
    def _other_releases(self, metadata) -> tuple:
        """The dynamic-clipping updates declared in ``dp_parameters.dynamic_clipping``. A
        model with dynamic clip layers that declared nothing is refused: its plan would
        silently leave the clipping releases out."""
        params = self.dp_parameters
        spec = params.dynamic_clipping
        dynamic_layers = dynamic_clip_layers(self.dp_layers)
        if dynamic_layers and spec is None and not self._noiseless:
            names = ", ".join(repr(layer.name) for _, layer in dynamic_layers)
            raise ValueError(
                f"DP_ClipGradient layer(s) {names} have mode='dynamic': their clip values are "
                "data-dependent releases the privacy plan must count. Declare the callback "
                "that updates them: DPParameters(..., dynamic_clipping="
                "LaplaceAdaptiveLossGradientClipping(...) or AdaptiveQuantileClipping(...)), "
                "or use mode='fixed'."
            )
        if spec is None:
            return ()
        return (spec.release(len(dynamic_layers), metadata.sampling_rate),)

    @property
    def dynamic_clipping(self):
        """The declared :class:`~lipdp.clipless.dynamic.DynamicClippingSpec` (or ``None``)."""
        return self.dp_parameters.dynamic_clipping

    def project(self):
        """Project every constrained weight onto its feasible set."""
        for layer in self.dp_layers:
            layer.project()


class _TensorFlowSteps:
    """The TensorFlow step's clipless hooks (:meth:`PrivateModel.train_step`): the
    gradient of the batch loss by one ``GradientTape``."""

    def _neutralised_rows(self, x, y, usable):
        """Rule S9 without zeroing in the step: ``DP_BoundedInput`` zeroes inputs with a
        NaN or an infinity and :meth:`per_example_losses` gives unusable labels
        (non-finite, class index out of range) a zero loss; no DP layer reads ids."""
        return x, y

    def _private_gradients(self, x, y, kept) -> StepGradients:
        """The gradient of ``sum_i loss_i / n`` (:meth:`_clean_loss`), or of the
        adversarial loss (:meth:`adversarial_loss_rows`), by one backward pass: every
        example's part is within the bounds of :meth:`sensitivities` (a variable the
        loss does not reach gets a zero gradient)."""
        x_adv = None if self.adversarial is None else self.adversarial_examples(x, y)
        # The layers run on the batch here, no pfor around them: their fused XLA kernels
        # may run (lipdp.clipless.layers.fused).
        with tf.GradientTape() as tape, fused_kernels():
            if x_adv is None:
                loss, y_pred = self._clean_loss(x, y)
            else:
                loss, y_pred = self._adversarial_loss(x, x_adv, y)
        variables = self.trainable_variables
        gradients = tape.gradient(loss, variables)
        gradients = [tf.zeros_like(v) if g is None else g for g, v in zip(gradients, variables)]
        return StepGradients(gradients, y_pred, x_adv)

    def _clean_loss(self, x, y):
        """``(sum_i loss_i / n, predictions)``, ``n`` the loss normaliser: the number the
        sensitivities and the clip layers are computed for (rule S5). Summed over the
        local rows and divided by the global ``n``, so that the replicas' gradients sum
        to the one of the global batch; an empty batch gives 0. Each row's loss is the
        loss's per-example value (whatever its reduction), 0 for an unusable label
        (:meth:`per_example_losses`, rule S9)."""
        y_pred = self(x, training=True)
        self.refuse_data_dependent_losses()
        rows = self.per_example_losses(y, y_pred)
        return tf.reduce_sum(rows) / float(self.dataset_metadata.loss_normalizer), y_pred

    def adversarial_loss_rows(self, x, x_adv, y):
        """Each row's share of the adversarial training loss,
        ``((1 - w) loss(x_i) + w loss(x'_i)) / n`` (``w``: the PGD's ``mix``), and the
        predictions on ``x'``. Each pass runs with its weight, so that cotangent clipping
        clips it at its share of the clip value (:mod:`lipdp.core.adversarial`)."""
        w = self.adversarial.mix
        normalizer = float(self.dataset_metadata.loss_normalizer)
        y_adv = self.forward(x_adv, training=True, loss_weight=w)
        self.refuse_data_dependent_losses()
        rows = w * self.per_example_losses(y, y_adv)
        if w < 1.0:
            y_clean = self.forward(x, training=True, loss_weight=1.0 - w)
            rows += (1.0 - w) * self.per_example_losses(y, y_clean)
        return rows / normalizer, y_adv

    def _adversarial_loss(self, x, x_adv, y):
        rows, y_adv = self.adversarial_loss_rows(x, x_adv, y)
        return tf.reduce_sum(rows), y_adv


if compat.keras_backend() != compat.JAX_BACKEND:  # the TensorFlow trainer (Keras 2 and 3)
    from lipdp.core.private_model import (  # noqa: F401  (the guards: public here too)
        PrivateModel,
        StepGradients,
        _check_poisson_pipeline,
        _refuse_mixed_precision,
        _refuse_non_finite,
    )


def _trainer_bases() -> tuple:
    """The trainer of :class:`DP_Model` for the Keras backend of this process: TensorFlow's
    :class:`~lipdp.core.private_model.PrivateModel` (Keras 2 and 3), or on Keras 3's JAX
    backend :class:`lipdp.clipless.jax.trainer.CliplessJaxTrainer` (imported only there)."""
    if compat.keras_backend() == compat.JAX_BACKEND:
        from lipdp.clipless.jax.trainer import CliplessJaxTrainer

        return (CliplessJaxTrainer,)
    return (_TensorFlowSteps, PrivateModel)


class DP_Model(CliplessFacts, *_trainer_bases()):
    """A Keras model trained with Clipless DP-SGD.

    ``dp_layers`` are applied in order; residual blocks pass pairs between layers
    (:func:`lipdp.clipless.layers.make_residuals`). What is not about bounds (privacy state, plan,
    noise, guards) is the trainer's: :class:`lipdp.core.private_model.PrivateModel` on
    TensorFlow (Keras 2 and 3), :class:`lipdp.clipless.jax.trainer.CliplessJaxTrainer` under
    ``KERAS_BACKEND=jax`` (chosen when this module is imported, by the Keras backend; the
    clipless facts, :class:`CliplessFacts`, are the same on both).

    Args:
        dp_layers: list of DP layers, the first being :class:`DP_BoundedInput`.
        dp_parameters: :class:`DPParameters`.
        dataset_metadata: :class:`lipdp.foundation.metadata.DatasetMetadata` (the batch size
            ``b`` and ``N``); required for training.
        debug: run eagerly and log every step's sensitivities and noise levels.
        row_isolation: ``True`` (default): ``DP_Lambda`` functions, DP layers that are not
            lipdp's own and the loss computed one row at a time, forward and backward
            (lipdp's own DP layers, :func:`runs_per_example`, run on the batch;
            :mod:`lipdp.core.isolation`): rule S2 by construction, at the cost of the
            batched step (1.01x on the clipless digits CNN,
            ``benchmarks/row_isolation_cost.py``), and without the batch-independence
            probe. ``False``: every layer and the loss on the batch, checked by the probe.
            Other arguments: :class:`~lipdp.core.private_model.PrivateModel`.
    """

    def __init__(
        self,
        dp_layers,
        *,
        dp_parameters,
        dataset_metadata=None,
        debug=False,
        row_isolation=True,
        **kwargs,
    ):
        super().__init__(
            dp_layers,
            dp_parameters=dp_parameters,
            dataset_metadata=dataset_metadata,
            debug=debug,
            row_isolation=row_isolation,
            **kwargs,
        )
        _check_dynamic_declaration(self.dp_layers, dp_parameters)


class DP_Sequential(DP_Model):
    """``DP_Sequential(layers, dp_parameters=..., dataset_metadata=...)``: a stack of DP layers."""

    _layers_key = "layers"

    def __init__(
        self,
        layers,
        *,
        dp_parameters,
        dataset_metadata=None,
        debug=False,
        row_isolation=True,
        **kwargs,
    ):
        super().__init__(
            layers,
            dp_parameters=dp_parameters,
            dataset_metadata=dataset_metadata,
            debug=debug,
            row_isolation=row_isolation,
            **kwargs,
        )


keras.utils.register_keras_serializable(package="lipdp")(DP_Model)
keras.utils.register_keras_serializable(package="lipdp")(DP_Sequential)


def compute_gradient_bounds(model) -> dict:
    """Sensitivity of the *averaged* minibatch gradient of each trainable variable.

    Returns ``{"<layer name>/<variable>": Delta}`` with
    ``Delta = per-example bound * (1 + ROUNDOFF_SLACK) / b``
    (:meth:`lipdp.clipless.bounds.Bounds.sensitivities`). Keys are qualified by the owning DP
    layer because Keras does not keep variable names unique across save/load.
    """
    return {entry.key: delta for entry, delta in model.sensitivities()}


def global_sensitivity(model) -> float:
    """``sqrt(sum_v Delta_v^2)``: the sensitivity of the whole averaged gradient."""
    return float(np.sqrt(sum(float(d) ** 2 for d in compute_gradient_bounds(model).values())))


def _check_dynamic_declaration(layers, dp_parameters) -> None:
    """A declared dynamic clipping needs a layer to update (the converse is checked when
    a privacy plan is made: a model may be built for inference without declaring)."""
    if dp_parameters.dynamic_clipping is not None and not dynamic_clip_layers(layers):
        raise ValueError(
            "DPParameters(dynamic_clipping=...) declares clip-value updates but the model has "
            "no DP_ClipGradient(..., mode='dynamic') layer to update: add one or remove the "
            "declaration."
        )


__all__ = [
    "DPParameters",
    "DP_Model",
    "DP_Sequential",
    "ROUNDOFF_SLACK",
    "compute_gradient_bounds",
    "global_sensitivity",
]
