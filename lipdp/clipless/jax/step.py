r"""A jit-compiled Clipless DP-SGD step on Keras 3's JAX backend (prototype slice).

The step of :class:`lipdp.clipless.model.DP_Model` (TensorFlow), as one pure function of the
state, compiled by ``jax.jit``:

1. rule S9: ``DP_BoundedInput`` zeroes the rows with a NaN or an infinity and clips every row
   to ``X_0``; a row whose label is not finite has loss 0 (:meth:`DP_Loss.call`);
2. the gradient of ``sum_i loss_i / b`` by ONE ``jax.grad`` of the batched
   ``stateless_call`` (no per-example gradient: the bound pass bounds every row's part);
3. the sensitivities ``Delta_v = B_v (1 + ROUNDOFF_SLACK) / b`` from the ONE bound pass
   (:func:`lipdp.clipless.bounds.bound_pass`, the very function the TensorFlow model calls)
   and the noise standard deviations by the one noise rule
   (:func:`lipdp.core.noise.noise_stddevs`, ``on_host=True``), both computed on the host when
   the step is made: in the slice every bound is a Python float (no adaptive norm, no clip
   value variable), so they are constants of the compiled step;
4. Gaussian noise from a key carried in the state (split at every step);
5. ``optimizer.stateless_apply``, then every trainable constrained kernel projected onto its
   set by the pure :meth:`ConstrainedKernelLayer.projected_values` (the power vector of an
   orthogonal kernel carried in the non-trainable state), as ``project()`` does after every
   TensorFlow step.

Not a private model yet (no ledger, no plan, no guards): the design note's step 3 wraps it in
``DP_Model`` through the JAX trainer the clipped family has.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import keras
import numpy as np

from lipdp.clipless import layers as dp_layers
from lipdp.clipless import losses as dp_losses
from lipdp.clipless.bounds import bound_pass
from lipdp.clipless.layers.constrained import ConstrainedKernelLayer
from lipdp.clipless.losses import DP_Loss
from lipdp.core import noise
from lipdp.core.jax.trainer import JaxPrivateTrainer
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import nested_layers
from lipdp.foundation.variables import variable_key

#: The layers of the slice (exact classes).
SLICE_LAYERS = (
    dp_layers.DP_InputLayer,
    dp_layers.DP_BoundedInput,
    dp_layers.DP_SpectralDense,
    dp_layers.DP_QuickSpectralDense,
    dp_layers.DP_QuickFrobeniusDense,
    dp_layers.DP_GroupSort,
    dp_layers.DP_ClipGradient,
)


def check_slice(layers, loss) -> None:
    """Refuse what the prototype slice does not cover (one line naming the way out)."""
    for layer in layers:
        if type(layer) not in SLICE_LAYERS:
            raise TypeError(
                f"Layer {layer.name!r} ({type(layer).__name__}) is not in the JAX slice yet: "
                "train on KERAS_BACKEND=tensorflow."
            )
        if getattr(layer, "mode", "fixed") == "dynamic":
            raise ValueError(
                f"Layer {layer.name!r} is a DP_ClipGradient(mode='dynamic'): train on "
                "KERAS_BACKEND=tensorflow."
            )
        if getattr(layer, "adaptive_norm", False):
            raise ValueError(
                f"Layer {layer.name!r} has adaptive_norm=True (a float64 certificate): train "
                "on KERAS_BACKEND=tensorflow."
            )
    if not isinstance(loss, DP_Loss):
        raise TypeError("The JAX slice trains with a loss of lipdp.clipless.losses only.")


class CliplessJaxStep:
    """The clipless step of ``model`` (a built ``keras.Sequential`` of slice layers).

    Args:
        model: the network; its layers are the DP layers, in order.
        loss: a loss of :mod:`lipdp.clipless.losses`.
        optimizer: a Keras optimizer (built here on the trainable variables).
        noise_multiplier: ``sigma`` (0: no noise drawn).
        batch_size: ``b``, the loss normaliser and the sensitivities' divisor.
        noisify_strategy: ``"global"`` or ``"per-layer"`` (the one noise rule).
        seed: a seed for a reproducible key (tests); ``None`` seeds from the OS.
    """

    def __init__(
        self, model, loss, optimizer, *, noise_multiplier, batch_size,
        noisify_strategy="global", seed=None,
    ):  # fmt: skip
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.layers = list(model.layers)
        check_slice(self.layers, loss)
        self.batch_size = int(batch_size)
        # Every bound of the slice is a constant: a Python float, or a fixed clip value read
        # now (the step is made again if it changes; mode='dynamic' is refused above).
        entries = bound_pass(self.layers, loss.get_L()).sensitivities(self.batch_size)
        self.entries = [(entry, float(delta)) for entry, delta in entries]
        deltas = [delta for _, delta in self.entries]
        self.stddevs = noise.noise_stddevs(
            noisify_strategy,
            float(noise_multiplier),
            deltas,
            [entry.nm_coef for entry, _ in self.entries],
            on_host=True,
        )
        by_id = {id(entry.variable): s for (entry, _), s in zip(self.entries, self.stddevs)}
        trainable = model.trainable_variables
        missing = [v.path for v in trainable if id(v) not in by_id]
        if missing:
            raise ValueError(f"No sensitivity bound for trainable variables {missing}.")
        self._variable_stddevs = [by_id[id(v)] for v in trainable]
        optimizer.build(trainable)
        self._projections = self._projection_plan(trainable, model.non_trainable_variables)
        words = np.frombuffer(os.urandom(8), np.uint32) if seed is None else None
        self.key = jax.random.key(seed) if seed is not None else jax.random.wrap_key_data(words)
        self._step = jax.jit(self.pure_step)

    def sensitivities(self) -> dict:
        """``{"<layer>/<variable>": Delta_v}``, as
        :func:`lipdp.clipless.model.compute_gradient_bounds` gives on TensorFlow."""
        return {entry.key: delta for entry, delta in self.entries}

    def _projection_plan(self, trainable, non_trainable):
        """``[(layer, kernel index in trainable, power vector index in non_trainable)]``."""
        position = {id(v): i for i, v in enumerate(trainable)}
        state = {id(v): i for i, v in enumerate(non_trainable)}
        return [
            (layer, position[id(layer.kernel)], state[id(layer.power_vector)])
            for layer in self.layers
            if isinstance(layer, ConstrainedKernelLayer) and layer.trainable
        ]

    # ------------------------------------------------------------------- the step
    def forward(self, trainable, non_trainable, x):
        """The layers in order on the state's values; a layer that clips cotangents gets the
        loss normaliser ``b`` (:meth:`lipdp.core.private_model.PrivateModel.forward`)."""
        mapping = list(zip(self.model.trainable_variables, trainable)) + list(
            zip(self.model.non_trainable_variables, non_trainable)
        )
        with keras.StatelessScope(state_mapping=mapping):
            h = x
            for layer in self.layers:
                uses = getattr(layer, "uses_loss_normalizer", False)
                kwargs = {"loss_normalizer": self.batch_size} if uses else {}
                h = layer(h, training=True, **kwargs)
        return h

    def loss_rows(self, trainable, non_trainable, x, y):
        """Each row's loss (shape ``(batch,)``) and the predictions."""
        y_pred = self.forward(trainable, non_trainable, x)
        return self.loss.call(y, y_pred), y_pred

    def gradients(self, trainable, non_trainable, x, y):
        """The gradient of ``sum_i loss_i / b`` (the TensorFlow step's ``_clean_loss``)."""

        def total(params):
            rows, y_pred = self.loss_rows(params, non_trainable, x, y)
            return jnp.sum(rows) / float(self.batch_size), y_pred

        return jax.grad(total, has_aux=True)(list(trainable))

    def pure_step(self, trainable, non_trainable, optimizer_variables, key, x, y):
        """``(trainable, non_trainable, optimizer_variables, key, released gradients)``."""
        gradients, _ = self.gradients(trainable, non_trainable, x, y)
        key, draw = jax.random.split(key)
        draws = jax.random.split(draw, len(gradients))
        released = [
            g + s * jax.random.normal(k, g.shape, g.dtype) if s > 0 else g
            for g, s, k in zip(gradients, self._variable_stddevs, draws)
        ]
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, released, trainable
        )
        trainable, non_trainable = list(trainable), list(non_trainable)
        for layer, at, u_at in self._projections:
            trainable[at], non_trainable[u_at] = layer.projected_values(
                trainable[at], non_trainable[u_at]
            )
        return trainable, non_trainable, optimizer_variables, key, released

    def __call__(self, x, y):
        """One step on ``(x, y)``: the variables updated in place; returns the released
        (noisy) gradients, aligned with ``model.trainable_variables``."""
        model = self.model
        trainable, non_trainable, optimizer_variables, self.key, released = self._step(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in self.optimizer.variables],
            self.key,
            jnp.asarray(x),
            jnp.asarray(y),
        )
        for variable, value in zip(model.trainable_variables, trainable):
            variable.assign(value)
        for variable, value in zip(model.non_trainable_variables, non_trainable):
            variable.assign(value)
        for variable, value in zip(self.optimizer.variables, optimizer_variables):
            variable.assign(value)
        return released


# ------------------------------------------------------------------ the trainer
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
    :data:`JAX_READY_LAYERS`, a kernel with ``adaptive_norm=True`` (its float64 norm
    certificate), a declared hyper-parameter search."""
    for path, layer in nested_layers(list(layers)):
        if type(layer) not in JAX_READY_LAYERS:
            raise TypeError(
                f"Layer {path!r} ({type(layer).__name__}) does not run under jax.jit yet: "
                f"{_WAY_OUT}."
            )
        if getattr(layer, "adaptive_norm", False):
            raise ValueError(
                f"Layer {path!r} has adaptive_norm=True (a float64 norm certificate), not "
                f"ported to JAX yet: use adaptive_norm=False or {_WAY_OUT}."
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
      a fixed clip value read when the step is made). With a
      ``DP_ClipGradient(mode="dynamic")``, :meth:`_stddev_in_step` runs the bound pass and
      the noise rule on the step's state instead (float32, as TensorFlow's graph): the
      noise follows the clip values a callback of :mod:`lipdp.clipless.dynamic` sets
      between steps (between epochs of one ``fit``), without a new trace.
    * :meth:`_projected`: every trainable constrained kernel projected onto its set by the
      pure ``projected_values`` of its layer after the optimizer (the power vector of an
      orthogonal kernel in the non-trainable state), as ``project()`` after every
      TensorFlow step; a frozen layer is not projected.

    Refused on JAX (one line, :func:`refuse_not_ported`, :func:`loss_rows_function`):
    layers and losses not ported yet, adaptive norms, adversarial training, a declared
    hyper-parameter search.
    """

    _layers_key = "dp_layers"

    def __init__(
        self, dp_layers, *, dp_parameters, dataset_metadata=None, adversarial=None,
        debug=False, independence_probe=True, row_isolation=True, **kwargs,
    ):  # fmt: skip
        super().__init__(**kwargs)
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

    def _stateless_forward(self, trainable, non_trainable, x, observe=None):
        with keras.StatelessScope(state_mapping=self._state_mapping(trainable, non_trainable)):
            return self.forward(x, training=True, observe=observe)

    def _state_mapping(self, trainable, non_trainable):
        return list(zip(self.trainable_variables, trainable)) + list(
            zip(self.non_trainable_variables, non_trainable)
        )

    def _stddev_in_step(self, trainable, non_trainable):
        """With a ``DP_ClipGradient(mode="dynamic")``, the standard deviation of the noise
        from the clip values in the step's state: the bound pass
        (:meth:`~lipdp.clipless.model.CliplessFacts.sensitivities`) and the one noise rule run
        in the step's ``StatelessScope`` (float32, as TensorFlow's graph computes them), so
        the noise follows a clip value a callback set between steps -- the value the step's
        backward pass clips with -- without a new trace. Otherwise the plan's host constant
        (every bound is a Python float or a fixed clip value)."""
        if not any(getattr(layer, "mode", "fixed") == "dynamic" for layer in self._all_layers()):
            return super()._stddev_in_step(trainable, non_trainable)
        with keras.StatelessScope(state_mapping=self._state_mapping(trainable, non_trainable)):
            entries = self.sensitivities()
            stddevs = noise.noise_stddevs(
                self.dp_parameters.noisify_strategy,
                self._sigma(),
                [delta for _, delta in entries],
                [entry.nm_coef for entry, _ in entries],
                xp=jnp,
            )
        if self.dp_parameters.noisify_strategy == "global":
            return stddevs[0] if stddevs else 0.0
        groups = self._noised_variables(entries)
        by_key = {variable_key(v): s for group, s in zip(groups, stddevs) for v in group}
        return tuple(by_key[variable_key(v)] for v in self.trainable_variables)

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
        return {
            self._layers_key: [keras.layers.serialize(layer) for layer in self.dp_layers],
            "adversarial": None,
            "debug": self.debug,
            "independence_probe": self.independence_probe,
            "row_isolation": self.row_isolation,
        }

    @classmethod
    def _network_from_config(cls, config, custom_objects):
        return [
            keras.layers.deserialize(c, custom_objects=custom_objects)
            for c in config.pop(cls._layers_key)
        ]
