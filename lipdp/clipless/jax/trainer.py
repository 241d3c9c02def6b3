r"""The JAX trainer of the clipless family on Keras 3's JAX backend: :class:`CliplessJaxTrainer`.

:class:`lipdp.clipless.model.DP_Model` / ``DP_Sequential`` (the clipless facts: layer
checks, the bound pass, the noise coefficients) train on it when Keras runs on JAX. It is
a :class:`lipdp.core.jax.trainer.JaxPrivateTrainer` (the step skeleton shared with the
clipped family's ``DPSGD_JaxModel``: rule S9 rows, the noise key, the ledger, the stateless
``train_step`` compiled by ``jax.jit``) whose hooks are the clipless step:

1. the gradient of ``sum_i w_i loss_i / n`` by ONE ``jax.grad`` of the batched forward
   (no per-example gradient: the bound pass bounds every row's part of it);
2. the sensitivities ``Delta_v = B_v (1 + ROUNDOFF_SLACK) / b`` of the one bound pass
   (:func:`lipdp.clipless.bounds.bound_pass`, the TensorFlow model's) and the noise
   standard deviations of the one noise rule (:func:`lipdp.core.noise.noise_stddevs`),
   on the host in float64: constants of the compiled step;
3. after the optimizer, every trainable constrained kernel (and ``DP_AddBias``) projected
   onto its set by its layer's pure ``projected_values``, as ``project()`` after every
   TensorFlow step.

What runs under ``jax.jit`` is listed here (:data:`JAX_READY_LAYERS`,
:data:`JAX_READY_LOSSES`); the rest is refused in one line naming the way out
(:func:`refuse_not_ported`, :func:`loss_rows_function`). This module is imported under the
JAX backend only (by :func:`lipdp.clipless.model._trainer_bases`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras

from lipdp.clipless import layers as dp_layers
from lipdp.clipless import losses as dp_losses
from lipdp.clipless.layers.constrained import ConstrainedKernelLayer
from lipdp.core import noise
from lipdp.core.jax.trainer import JaxPrivateTrainer
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import nested_layers
from lipdp.foundation.variables import variable_key

# ------------------------------------------------------------ what is ported
#: The layer classes whose ``call`` and projection run under ``jax.jit`` on the JAX
#: backend: every layer of :mod:`lipdp.clipless.layers`, written once with
#: :func:`lipdp.foundation.compat.array_ops` (exact classes: a subclass may change ``call``
#: with TensorFlow code, and is refused on JAX in one line, :func:`refuse_not_ported`).
JAX_READY_LAYERS = (
    dp_layers.DP_InputLayer,
    dp_layers.DP_BoundedInput,
    dp_layers.DP_SpectralDense,
    dp_layers.DP_QuickSpectralDense,
    dp_layers.DP_QuickFrobeniusDense,
    dp_layers.DP_SpectralConv2D,
    dp_layers.DP_QuickSpectralConv2D,
    dp_layers.DP_GroupSort,
    dp_layers.DP_ReLU,
    dp_layers.DP_ScaledL2NormPooling2D,
    dp_layers.DP_ScaledGlobalL2NormPooling2D,
    dp_layers.DP_MaxPool2D,
    dp_layers.DP_Flatten,
    dp_layers.DP_Reshape,
    dp_layers.DP_Permute,
    dp_layers.DP_LayerCentering,
    dp_layers.DP_GroupNormalization,
    dp_layers.DP_ScatteringTransform,
    dp_layers.DP_AddBias,
    dp_layers.DP_ClipGradient,
    dp_layers.DP_Lambda,
    dp_layers.DP_SplitResidual,
    dp_layers.DP_WrappedResidual,
    dp_layers.DP_MergeResidual,
)

#: What every refusal ends with.
_WAY_OUT = "train on KERAS_BACKEND=tensorflow"


def refuse_not_ported(layers, dp_parameters) -> None:
    """Refuse, before any step, what the clipless JAX step does not cover yet (one line
    naming the way out): a layer (at any depth) whose class is not in
    :data:`JAX_READY_LAYERS`, a declared hyper-parameter search. (Kernels with
    ``adaptive_norm=True`` run: their float64 certificate is computed on the host in the
    step, :func:`lipdp.clipless.projections.certified_operator_norm`; dynamic clip values
    are read from the step's state, :mod:`lipdp.clipless.jax.dynamic`.)"""
    for path, layer in nested_layers(list(layers)):
        if type(layer) not in JAX_READY_LAYERS:
            raise TypeError(
                f"Layer {path!r} ({type(layer).__name__}) does not run under jax.jit yet: "
                f"{_WAY_OUT}."
            )
    if dp_parameters.hyperparameter_search is not None:
        raise ValueError(
            f"A declared hyper-parameter search is recorded on TensorFlow only: {_WAY_OUT}, "
            "or price it with lipdp.accounting.calibrate_noise_multiplier(search=...)."
        )


#: The losses whose ``call`` runs under ``jax.jit``: every loss of
#: :mod:`lipdp.clipless.losses`, written once with
#: :func:`~lipdp.foundation.compat.array_ops` (exact classes, as :data:`JAX_READY_LAYERS`).
JAX_READY_LOSSES = tuple(
    getattr(dp_losses, name) for name in dp_losses.__all__ if name != "DP_Loss"
)


def loss_rows_function(loss):
    """``(y_true, y_pred) -> per-row losses`` of ``loss`` under ``jax.jit`` (its ``call``),
    or a one-line refusal for a loss not ported (another class, a subclass)."""
    if type(loss) not in JAX_READY_LOSSES:
        raise TypeError(
            f"The loss {type(loss).__name__} does not run under jax.jit yet: {_WAY_OUT}."
        )
    return loss.call


class CliplessJaxTrainer(JaxPrivateTrainer):
    """The JAX trainer of :class:`lipdp.clipless.model.DP_Model` (which adds the clipless
    facts: the layer checks, the bound pass, the noise coefficients, ``project``).

    The step's hooks (:mod:`lipdp.core.jax.trainer` for the skeleton):

    * :meth:`_private_gradients`: ONE ``jax.grad`` of ``sum_i w_i loss_i / n`` over the
      batched forward of the layers in the step's ``StatelessScope`` (``n`` the loss
      normaliser, ``w_i`` 0 for a padded Poisson row or a non-finite one, 1 otherwise; a
      clip layer gets ``loss_normalizer=n``). No per-example gradient: the bound pass bounds
      every row's part of it, and a row of weight 0 contributes exactly 0 (its loss term is
      multiplied by 0, its gradient by 0).
    * the noise: the sensitivities ``Delta_v = B_v (1 + ROUNDOFF_SLACK) / b`` of the one bound
      pass (:meth:`~lipdp.clipless.model.DP_Model.sensitivities`, the TensorFlow model's)
      and the standard deviations of the one noise rule, on the host in float64
      (``"global"``: ``sigma sqrt(sum Delta_v^2)``; ``"per-layer"``: ``sigma c_v Delta_v``),
      constants of the compiled step (every bound of the ported layers is a Python float or
      a fixed clip value read when the step is made) -- except when a bound reads the
      step's state: norm-adaptive kernels (``adaptive_norm=True``, bounds ``min(C,
      certified ||M||)`` of the weights the gradient is taken at; the certificate is the
      float64 one, computed on the host by ``jax.pure_callback``,
      :mod:`lipdp.clipless.projections`) and dynamic clip values (set by a callback of
      :mod:`lipdp.clipless.dynamic` between steps, without a new trace):
      :meth:`_stddev_in_step` then runs the same bound pass in the step, on the state
      (``StatelessScope``), and the noise rule in float32 as the TensorFlow graph does.
      The multiplier ``sigma``, hence the ledger, does not depend on the state.
    * :meth:`_projected`: every trainable constrained kernel projected onto its set by the
      pure ``projected_values`` of its layer after the optimizer (the power vector of an
      orthogonal kernel in the non-trainable state), as ``project()`` after every
      TensorFlow step; a frozen layer is not projected.

    Refused on JAX (one line, :func:`refuse_not_ported`, :func:`loss_rows_function`):
    layers and losses not ported yet, adversarial training, a declared
    hyper-parameter search.
    """

    _layers_key = "dp_layers"

    def __init__(
        self, dp_layers, *, dp_parameters, dataset_metadata=None, adversarial=None,
        debug=False, independence_probe=True, row_isolation=True, physical_batch_size=None,
        **kwargs,
    ):  # fmt: skip
        super().__init__(**kwargs)
        self.physical_batch_size = physical_batch_size
        compat.refuse_foreign_layers(dp_layers)
        self._check_layers(dp_layers)
        if adversarial is not None:
            raise ValueError(f"Adversarial training is not ported to JAX yet: {_WAY_OUT}.")
        if not isinstance(row_isolation, bool):
            raise TypeError(f"row_isolation must be True or False, got {row_isolation!r}.")
        self._set_privacy_configuration(dp_parameters, dataset_metadata)
        self.dp_layers = list(dp_layers)
        refuse_not_ported(self._all_layers(), dp_parameters)
        self.debug = bool(debug)
        self.independence_probe = bool(independence_probe)
        # Every ported layer is lipdp's own and row-wise (the step runs it on the batch);
        # kept for the configuration, which is the same on every backend.
        self.row_isolation = row_isolation
        self._init_private_state()
        if dataset_metadata is not None and dataset_metadata.multiplicity:
            raise ValueError(f"Augmentation multiplicity is not ported to JAX: {_WAY_OUT}.")
        input_shape = compat.declared_batch_shape(self.dp_layers[0])
        if input_shape is not None:
            self.build(input_shape)
        self._claim_layers()

    @property
    def adversarial(self):
        """``None``: adversarial training is not ported to JAX (refused)."""
        return None

    # ---------------------------------------------------------------- structure
    def build(self, input_shape):
        """Build every layer by the forward loop on symbolic inputs (as the TensorFlow
        model on Keras 3)."""
        self.forward(keras.KerasTensor(tuple(input_shape)))
        self.built = True

    def call(self, inputs, training=None):
        return self.forward(inputs, training=training)

    def forward(self, inputs, training=None, observe=None):
        """The layers in order; a layer that clips cotangents gets the loss normaliser
        (:meth:`lipdp.core.private_model.PrivateModel.forward`). ``observe(index, output)``,
        if given, is called after every layer (``index`` in :meth:`layers_forward_order`)
        and returns the array to continue with (how :mod:`lipdp.clipless.dynamic` adds its
        probes)."""
        metadata = self.dataset_metadata
        normalizer = {"loss_normalizer": None if metadata is None else metadata.loss_normalizer}
        h = inputs
        for index, layer in enumerate(self.dp_layers):
            if not isinstance(layer, keras.layers.InputLayer):  # Keras 3's cannot be called
                kwargs = normalizer if getattr(layer, "uses_loss_normalizer", False) else {}
                h = layer(h, training=training, **kwargs)
            if observe is not None:
                h = observe(index, h)
        return h

    def layers_forward_order(self):
        return list(self.dp_layers)

    # ----------------------------------------------------------------- training
    def _check_before_training(self) -> None:
        super()._check_before_training()
        refuse_not_ported(self._all_layers(), self.dp_parameters)
        loss_rows_function(self.loss)

    def noise_stddevs(self, sensitivities=None) -> dict:
        """``{variable key: standard deviation of its noise}`` (float64, on the host), as
        :meth:`lipdp.core.private_model.PrivateModel.noise_stddevs` on TensorFlow:
        ``sigma sqrt(sum Delta^2)`` (``"global"``) or ``sigma c_v Delta_v``
        (``"per-layer"``); 0 for a non-private model."""
        entries = self.sensitivities() if sensitivities is None else sensitivities
        stddevs = self._entry_stddevs(entries)
        groups = self._noised_variables(entries)
        return {variable_key(v): float(s) for group, s in zip(groups, stddevs) for v in group}

    def _variable_stddevs(self) -> list[float]:
        """``sigma c_v Delta_v`` of every trainable variable (``"per-layer"`` noise), by the
        one noise rule on the host, in the order of ``trainable_variables``."""
        by_key = self.noise_stddevs()
        return [by_key[variable_key(v)] for v in self.trainable_variables]

    def _state_dependent_bounds(self) -> bool:
        """Whether a bound reads the step's state: a kernel (at any depth) with
        ``adaptive_norm=True`` (its current weights) or a ``DP_ClipGradient(mode="dynamic")``
        (its clip value, which a callback changes between steps)."""
        return any(
            getattr(layer, "adaptive_norm", False) or getattr(layer, "mode", "fixed") == "dynamic"
            for _, layer in nested_layers(list(self._all_layers()))
        )

    def _step_stddev(self):
        """``None`` (the noise computed in the step, :meth:`_stddev_in_step`) for a noisy
        model whose bounds read the state; else the host's constants."""
        if self._state_dependent_bounds() and not self._noiseless:
            return None
        return super()._step_stddev()

    def _stddev_in_step(self, trainable, non_trainable):
        """The one bound pass and the one noise rule on the step's state (float32, the
        TensorFlow graph's operations): one scalar (``"global"``) or one per trainable
        variable (``"per-layer"``); the plan's constant when no bound reads the state."""
        if self._step_plan.stddev is not None:  # no bound reads the state
            return super()._stddev_in_step(trainable, non_trainable)
        with keras.StatelessScope(state_mapping=self._state_mapping(trainable, non_trainable)):
            entries = self.sensitivities()
            stddevs = noise.noise_stddevs(
                self.dp_parameters.noisify_strategy,
                self._sigma(),
                [delta for _, delta in entries],
                [entry.nm_coef for entry, _ in entries],
                on_host=False,
            )
        if self.dp_parameters.noisify_strategy == "global":
            return stddevs[0] if stddevs else 0.0
        groups = self._noised_variables(entries)
        by_key = {variable_key(v): s for group, s in zip(groups, stddevs) for v in group}
        return [by_key[variable_key(v)] for v in self.trainable_variables]

    def _stateless_forward(self, trainable, non_trainable, x, observe=None):
        with keras.StatelessScope(state_mapping=self._state_mapping(trainable, non_trainable)):
            return self.forward(x, training=True, observe=observe)

    def _state_mapping(self, trainable, non_trainable):
        return list(zip(self.trainable_variables, trainable)) + list(
            zip(self.non_trainable_variables, non_trainable)
        )

    def _private_gradients(self, trainable, non_trainable, x, y, weights):
        """The gradient of ``sum_i w_i loss_i / n`` (class docstring), the per-row losses
        and the predictions."""
        loss_rows = loss_rows_function(self.loss)
        normalizer = float(self._step_plan.normalizer)

        def total(params):
            y_pred = self._stateless_forward(params, non_trainable, x)
            rows = loss_rows(y, y_pred)
            return jnp.sum(weights * rows) / normalizer, (rows, y_pred)

        gradients, (rows, y_pred) = jax.grad(total, has_aux=True)(list(trainable))
        return gradients, rows, y_pred

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """The (weighted) mean of the per-row losses by :func:`loss_rows_function` (Keras'
        evaluation step and its symbolic build call it; the training step does not)."""
        rows = loss_rows_function(self.loss)(y, y_pred)
        if sample_weight is None:
            return jnp.mean(rows)
        weights = jnp.reshape(jnp.asarray(sample_weight, rows.dtype), rows.shape)
        return jnp.sum(weights * rows) / jnp.maximum(jnp.sum(weights), 1.0)

    def _projected(self, trainable, non_trainable):
        """Every trainable constrained kernel projected onto its set, as a pure function of
        the state (class docstring)."""
        position = {id(v): i for i, v in enumerate(self.trainable_variables)}
        state = {id(v): i for i, v in enumerate(self.non_trainable_variables)}
        for layer in self._all_layers():  # a frozen layer's weights are not trainable here
            if isinstance(layer, ConstrainedKernelLayer) and id(layer.kernel) in position:
                at, u_at = position[id(layer.kernel)], state[id(layer.power_vector)]
                trainable[at], non_trainable[u_at] = layer.projected_values(
                    trainable[at], non_trainable[u_at]
                )
            elif isinstance(layer, dp_layers.DP_AddBias) and id(layer.bias) in position:
                at = position[id(layer.bias)]
                trainable[at] = layer.projected_values(trainable[at])
        return trainable, non_trainable

    # ------------------------------------------------------------ serialisation
    def _model_config(self) -> dict:
        """The TensorFlow model's entries (same configuration on both backends)."""
        return self._layers_config()

    @classmethod
    def _network_from_config(cls, config, custom_objects):
        return cls._layers_from_config(config, custom_objects)
