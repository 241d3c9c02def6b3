r"""Clipped DP-SGD on Keras 3's JAX backend: :class:`DPSGD_JaxModel`.

A Keras model (the *network*: a ``Sequential``, a functional or a subclassed model of
ordinary Keras layers) wrapped in a model whose ``train_step`` is Keras 3's stateless JAX
step (``train_step(state, data) -> (logs, state)``, compiled by ``jax.jit``):

1. rows with a NaN or an infinity (input or floating label) are zeroed and get weight 0;
   every row's weight is its sample weight clipped to ``[0, 1]`` -- the 0/1 row mask of
   padded Poisson batches (:mod:`lipdp.core.jax.batches`), 1 without one (rule S9);
2. per-example gradients of the per-example losses, ``jax.vmap(jax.grad(...))`` over the
   network's ``stateless_call`` on one row at a time (rule S2), flat-clipped to ``R``
   and summed (:mod:`lipdp.clipped.jax.per_example`, where the sensitivity is derived);
   with ``gradient_method="ghost"`` (the default), the same norms, clip factors and
   clipped sum from each layer's inputs and output cotangents, without per-example
   gradients (:mod:`lipdp.clipped.jax.ghost`): when every trainable variable is the
   kernel or bias of a ``Dense`` or ``Conv2D`` used only through its layer's call; any
   other model takes the ``vmap`` path for the whole step (logged at INFO), never a mix;
3. the sum divided by the loss normaliser ``b`` plus Gaussian noise of standard
   deviation ``sigma R (1 + ROUNDOFF_SLACK) / b`` on every coordinate, drawn from a key
   seeded by the operating system that moves at every step (rule S8,
   :mod:`lipdp.core.jax.keys`);
4. the optimizer's update; the step count ``noisy_steps`` and the privacy ledger
   (:mod:`lipdp.core.jax.ledger`) are updated inside the step, model variables saved
   in ``.keras`` files (rule S10).

The privacy surface is the TensorFlow models' own, written once in
:class:`lipdp.core.private_base.PrivateModelBase`: sigma, the noise standard deviation (by
:func:`lipdp.core.noise.noise_stddevs`), the privacy plan (one subsampled Gaussian of
multiplier ``sigma`` per step, rate ``q = b / N``: the epsilon planned is the epsilon
logged, rule S11), the ledger row, and the guards of ``compile``, ``fit``, ``save``,
``set_weights`` and ``load_weights`` with their messages; ``DP_Accountant``,
``privacy_report`` and ``calibrate_noise_multiplier`` are shared too.

**Rows isolated by construction** (rule S2, :mod:`lipdp.core.jax.isolation`): both
paths compute each row's loss on that row alone (``jax.vmap`` of a batch of one), so a
layer or a loss that reads the batch cannot move another row's term; a ``custom_vmap``
rule, a host callback or a foreign function in the forward pass or the loss (which could)
is refused when the step is traced.

**Refused** (one line naming the fix): the layers the TensorFlow models refuse, by the
same walk and with the same messages (:func:`lipdp.clipped.layer_support.check_keras_layers`:
a trainable batch normalisation of any Keras class at any depth, a layer declaring
``couples_examples = True``, a stateful recurrent layer, ``SpectralNormalization``,
activity regularisers); at the first step any layer that updates non-trainable state in
a training call (``Dropout``'s and other random layers' seed state, a running
statistic): under ``vmap`` that state would be shared or coupled between the rows, and
saved with the model without noise; weight regularisers and ``add_loss`` (terms outside
the clipped per-example losses); any floating compute dtype but float32; per-layer
clipping and noise, dynamic clipping, declared hyper-parameter searches, sharpness-aware
and adversarial training (the TensorFlow backend has them). Fixed-size batches must have
exactly ``b`` rows (rule S5).

**Data parallelism.** Under ``keras.distribution.DataParallel`` Keras shards each batch
over the devices and ``jit`` compiles the same program for the global batch: the clipped
sum is over the global batch (XLA adds the devices' partial sums) and the noise, drawn
from the replicated key, is added once to it.
"""

from __future__ import annotations

import logging

import keras

from lipdp.clipped.clipping import Clipping
from lipdp.clipped.jax import ghost, per_example
from lipdp.clipped.layer_support import check_keras_layers
from lipdp.core.jax import isolation
from lipdp.core.jax.trainer import JaxPrivateTrainer, per_row_loss
from lipdp.core.private_base import (
    one_target_per_output,
    other_backend_class,
)
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import children

compat.require_supported_keras(compat.JAX_BACKEND)
logger = logging.getLogger(__name__)

#: Clipping modes of the JAX step (per-layer clipping: TensorFlow backend).
JAX_CLIPPING_MODES = ("flat", "automatic", "global")
#: How the step gets each row's gradient norm and the clipped sum: ``"vmap"`` (per-example
#: gradients, :mod:`~lipdp.clipped.jax.per_example`) or ``"ghost"`` (ghost norms,
#: :mod:`~lipdp.clipped.jax.ghost`; models of Dense and Conv2D layers only, others take
#: ``"vmap"``).
JAX_GRADIENT_METHODS = ("vmap", "ghost")


def check_network(network) -> None:
    """Refuse, before any step, what the JAX step cannot bound (module docstring): the
    TensorFlow models' walk of the layers (:func:`lipdp.clipped.layer_support.check_keras_layers`,
    same messages), then the weight regularisers the JAX step does not add."""
    if not isinstance(network, keras.Model):
        raise TypeError(f"DPSGD_JaxModel wraps a keras.Model, got {type(network).__name__}.")
    compat.refuse_foreign_layers([network])
    check_keras_layers([network])
    for variable in network.trainable_variables:
        if getattr(variable, "regularizer", None) is not None:
            raise ValueError(
                f"Variable {compat.variable_path(variable)!r} has a regularizer, which the "
                "JAX step does not add yet. Remove it (or train on KERAS_BACKEND=tensorflow, "
                "where the penalty's gradient is added after the noise)."
            )


def _check_parameters(dp_parameters, clipping) -> None:
    if dp_parameters.noisify_strategy != "global":
        raise ValueError(
            "The JAX backend adds one Gaussian to the whole clipped gradient: use "
            "noisify_strategy='global' (per-layer noise runs on KERAS_BACKEND=tensorflow)."
        )
    if dp_parameters.dynamic_clipping is not None:
        raise ValueError("dynamic_clipping applies to the clipless family (TensorFlow).")
    if dp_parameters.hyperparameter_search is not None:
        raise ValueError(
            "A declared hyper-parameter search is recorded by the TensorFlow models only: "
            "train on KERAS_BACKEND=tensorflow, or price the search with "
            "lipdp.accounting.calibrate_noise_multiplier(search=...)."
        )
    if clipping.mode not in JAX_CLIPPING_MODES:
        raise ValueError(
            f"{clipping.mode!r} clipping is not available on the JAX backend: use one of "
            f"{JAX_CLIPPING_MODES} (per-layer clipping runs on KERAS_BACKEND=tensorflow)."
        )


class DPSGD_JaxModel(JaxPrivateTrainer):
    """A Keras model trained with clipped DP-SGD on the JAX backend (module docstring).

    The privacy surface it shares with the TensorFlow models (sigma, the noise multipliers
    and standard deviation, the plan, the ledger view and row, the guards of compile, fit,
    save and the weights, the configuration) is
    :class:`lipdp.core.private_base.PrivateModelBase`'s; this class holds the JAX step,
    its noise keys and its ledger variables (:mod:`lipdp.core.jax.ledger`).

    Args:
        network: the ``keras.Model`` to train (built: give it an input shape).
        dp_parameters: :class:`~lipdp.core.parameters.DPParameters` (``"global"`` noise).
        clipping: a :class:`~lipdp.clipped.clipping.Clipping` (``"flat"``, ``"automatic"`` or
            ``"global"``), or its config dict.
        dataset_metadata: :class:`~lipdp.foundation.metadata.DatasetMetadata`, required for
            training (``b``, ``N``, the sampling).
        gradient_method: ``"ghost"`` (default: ghost norms, :mod:`lipdp.clipped.jax.ghost`)
            or ``"vmap"`` (per-example gradients). Ghost norms cover models whose
            trainable variables all belong to ``Dense`` and ``Conv2D`` layers (rows or
            sequences); a model with any other trainable layer, or a weight read outside
            its layer's call, falls back to ``"vmap"`` for the whole step (logged at INFO;
            :attr:`gradient_method_used` says which ran).
        physical_batch_size: the step computed ``P`` rows at a time, the logical batch
            noised once (:attr:`~lipdp.core.private_base.PrivateModelBase.physical_batch_size`).
    """

    def __init__(
        self, network, *, dp_parameters, clipping=Clipping(), dataset_metadata=None,
        gradient_method="ghost", physical_batch_size=None, **kwargs,
    ):  # fmt: skip
        super().__init__(**kwargs)
        self.physical_batch_size = physical_batch_size
        if gradient_method not in JAX_GRADIENT_METHODS:
            raise ValueError(
                f"gradient_method must be one of {JAX_GRADIENT_METHODS}, got {gradient_method!r}."
            )
        self.gradient_method = gradient_method
        #: The method the last traced step used (``"ghost"`` may fall back to ``"vmap"``).
        self.gradient_method_used = None
        clipping = Clipping.coerce(clipping)
        self._set_privacy_configuration(dp_parameters, dataset_metadata)
        _check_parameters(dp_parameters, clipping)
        check_network(network)
        if dataset_metadata is not None and dataset_metadata.multiplicity:
            raise ValueError("Augmentation multiplicity is not supported on the JAX backend.")
        self.network = network
        self.clipping = clipping
        self._init_private_state()
        if network.built:
            self.built = True
            self._claim_layers()

    def _lineage_layers(self) -> list:
        """The network (its layers at any depth hold the weights the ledger prices)."""
        return [self.network]

    def call(self, inputs, training=None):
        return self.network(inputs, training=training)

    def _all_layers(self) -> list:
        """The network's layers (as the TensorFlow models' ``dp_layers``: the refusals name
        them by the same paths); nested ones are walked by the refusals."""
        return children(self.network) or [self.network]

    # ------------------------------------------------------------- privacy
    def _noise_coefficients(self) -> list[float]:
        """``[1]``: one Gaussian mechanism per step (``"global"`` noise only)."""
        return [1.0]

    def sensitivities(self):
        """``[(ClippedGradientBound, R (1 + ROUNDOFF_SLACK) / b)]``: one entry for the whole
        gradient (:meth:`Clipping.sensitivities`, the rule of both backends)."""
        return self.clipping.sensitivities(self.batch_size)

    def noise_stddev(self) -> float:
        """The standard deviation of the noise on every coordinate of the averaged
        gradient: ``sigma R (1 + ROUNDOFF_SLACK) / b`` (0 for a non-private run), by the
        one noise rule (:func:`lipdp.core.noise.noise_stddevs`, on the host)."""
        return self._entry_stddevs(self.sensitivities())[0]

    # ------------------------------------------------------------ training
    def _check_before_training(self) -> None:
        super()._check_before_training()
        check_network(self.network)  # again: a layer may have been unfrozen since

    def _private_gradients(self, trainable, non_trainable, x, y, weights):
        """The clipped sum of the per-example gradients over ``b`` (module docstring), by
        ghost norms or per-example gradients, with the per-row losses and predictions."""
        self._refuse_cross_row_primitives(trainable, non_trainable, x, y)
        ghosted = None
        if self.gradient_method == "ghost":
            ghosted = self._ghost_clipped_sum(trainable, non_trainable, x, y, weights)
        if ghosted is not None:
            summed, losses, y_pred = ghosted
            object.__setattr__(self, "gradient_method_used", "ghost")
        else:
            summed, losses, y_pred = self._vmap_clipped_sum(trainable, non_trainable, x, y, weights)
            object.__setattr__(self, "gradient_method_used", "vmap")
        return [s / self._step_plan.normalizer for s in summed], losses, y_pred

    def _refuse_cross_row_primitives(self, trainable, non_trainable, x, y) -> None:
        """Rule S2 (:mod:`lipdp.core.jax.isolation`): one row's loss and gradient,
        unbatched, use no primitive whose batching could see other rows. Python, when the
        step is traced (one more trace of one row, no cost per step)."""
        import jax

        def one_row(t):
            return jax.ShapeDtypeStruct(t.shape[1:], t.dtype)

        row_loss = self._row_loss_function(non_trainable)
        isolation.refuse_cross_row_primitives(
            jax.value_and_grad(row_loss, has_aux=True),
            [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in trainable],
            keras.tree.map_structure(one_row, x),
            keras.tree.map_structure(one_row, y),
        )

    def _vmap_clipped_sum(self, trainable, non_trainable, x, y, weights):
        """``(clipped sum, losses, y_pred)`` from per-example gradients."""
        row_loss = self._row_loss_function(non_trainable)
        grads, (losses, y_pred) = per_example.per_example_gradients(row_loss, trainable, x, y)
        norms = per_example.row_norms(grads)
        factors = self.clipping.factors(norms)
        return per_example.clipped_sum(grads, norms, factors, weights), losses, y_pred

    def _ghost_row_function(self, layers, non_trainable, calls):
        """``(scope_params, tap_params, probes, x_i, y_i) -> (loss_i, aux)``: row ``i``'s
        forward (a batch of one) with the taps on (:mod:`lipdp.clipped.jax.ghost`); the
        trainable variables read ``scope_params`` outside the taps, the taps
        ``tap_params``. ``calls`` receives the layer of every tapped call, in order."""
        import jax.numpy as jnp

        loss_fn = per_row_loss(self.loss)
        trainable_ids = [id(v) for v in self.trainable_variables]
        others = list(zip(self.non_trainable_variables, non_trainable))

        def row(scope_params, tap_params, probes, x_row, y_row):
            by_id = dict(zip(trainable_ids, tap_params))
            by_id.update((id(v), value) for v, value in others)

            def value_of(variable):
                return None if variable is None else by_id[id(variable)]

            values = {
                id(lr): tuple(value_of(v) for v in ghost.kernel_and_bias(lr)) for lr in layers
            }
            tap = ghost.Tap(values, probes)
            batch = keras.tree.map_structure(lambda t: t[None], x_row)
            with ghost.tapped(layers, tap):
                y_pred = self._stateless_forward(scope_params, non_trainable, batch)
            calls[:] = [layer for layer, _ in tap.inputs]
            value = loss_fn(one_target_per_output(y_row[None], y_pred), y_pred)
            value = jnp.reshape(value, (1, -1)).mean(axis=1)[0]
            return value, (value, y_pred[0], [a for _, a in tap.inputs], tap.outputs)

        return row

    def _ghost_clipped_sum(self, trainable, non_trainable, x, y, weights):
        """``(clipped sum, losses, y_pred)`` by ghost norms, or ``None`` when the model is
        outside their scope (decided when the step is traced; logged)."""
        import jax.numpy as jnp

        found = self._ghost_norms(trainable, non_trainable, x, y)
        if found is None:
            return None
        layers, recorded, norms, losses, y_pred = found
        factors = self.clipping.factors(norms)
        usable = per_example.usable_rows(norms, factors, weights)
        scale = jnp.where(usable, weights * factors, 0.0)
        sums = {}
        for layer, f in zip(layers, recorded):
            own = ghost.own_variables(layer)
            parts = f.sums(usable, scale) if f is not None else [jnp.zeros(v.shape) for v in own]
            sums.update((id(v), part) for v, part in zip(own, parts))
        return [sums[id(v)] for v in self.trainable_variables], losses, y_pred

    def _ghost_norms(self, trainable, non_trainable, x, y):
        """``(layers, factors per layer, row norms, losses, y_pred)``, or ``None`` outside
        the scope of ghost norms (:mod:`lipdp.clipped.jax.ghost`)."""
        import jax
        import jax.numpy as jnp

        trainable = list(trainable)
        layers, reason = ghost.ghost_layers(self.network, self.trainable_variables)
        calls = []
        if layers is not None:
            row = self._ghost_row_function(layers, non_trainable, calls)

            def forward(scope_params, tap_params, xs, ys):
                return jax.vmap(lambda xr, yr: row(scope_params, tap_params, None, xr, yr))(xs, ys)

            if not ghost.uses_only_taps(forward, trainable, trainable, x, y):
                layers, reason = None, "a trainable weight is read outside its layer's call"
        if layers is None:
            logger.info("gradient_method='ghost' falls back to 'vmap': %s.", reason)
            return None
        shapes = jax.eval_shape(forward, trainable, trainable, x, y)[1][3]
        probes = [jnp.zeros(s.shape, s.dtype) for s in shapes]

        def total(probes):
            losses, aux = jax.vmap(row, in_axes=(None, None, 0, 0, 0))(
                trainable, trainable, probes, x, y
            )
            return jnp.sum(losses), aux

        cotangents, (losses, y_pred, inputs, _) = jax.grad(total, has_aux=True)(probes)
        recorded = ghost.factors(layers, list(zip(calls, inputs)), cotangents)
        pieces = [n for f in recorded if f is not None for n in f.norms()]
        if not pieces:  # no tapped layer is called: nothing to bound by ghost norms
            return None
        norms = per_example.row_norms([jnp.stack(pieces, axis=1)])
        return layers, recorded, norms, losses, y_pred

    def _row_loss_function(self, non_trainable):
        """``(params, x_i, y_i) -> (loss_i, y_pred_i)``: the forward pass of one row (a
        batch of one) and its loss; refuses, when traced, a call that updates
        non-trainable state or adds a loss."""
        import jax.numpy as jnp

        loss_fn = per_row_loss(self.loss)

        def row_loss(params, x_row, y_row):
            batch = keras.tree.map_structure(lambda t: t[None], x_row)
            y_pred = self._stateless_forward(params, non_trainable, batch)
            value = loss_fn(one_target_per_output(y_row[None], y_pred), y_pred)
            value = jnp.reshape(value, (1, -1)).mean(axis=1)[0]
            return value, (value, y_pred[0])

        return row_loss

    def _stateless_forward(self, params, non_trainable, batch):
        mapping = list(zip(self.trainable_variables, params)) + list(
            zip(self.non_trainable_variables, non_trainable)
        )
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            given = dict(scope.state_mapping)
            y_pred = self.network(batch, training=True)
            added = list(scope.losses)
        for variable in self.non_trainable_variables:
            if scope.state_mapping[id(variable)] is not given[id(variable)]:
                raise ValueError(
                    f"A training call updates {compat.variable_path(variable)!r} (non-trainable "
                    "state, e.g. a Dropout or random layer's seed, a stateful RNN): under the "
                    "per-example vmap it would be shared between rows. Remove that layer or "
                    "train on KERAS_BACKEND=tensorflow."
                )
        if added:
            raise ValueError(
                "A layer adds a loss in its call (add_loss): a term outside the clipped "
                "per-example losses. Remove it."
            )
        return y_pred

    # ------------------------------------------------------- serialisation
    def _model_config(self) -> dict:
        return {
            "network": keras.saving.serialize_keras_object(self.network),
            "clipping": self.clipping.to_config(),  # its dict: Clipping.coerce takes it
            "gradient_method": self.gradient_method,
        }

    @classmethod
    def _network_from_config(cls, config, custom_objects):
        return keras.saving.deserialize_keras_object(
            config.pop("network"), custom_objects=custom_objects
        )


keras.utils.register_keras_serializable(package="lipdp")(DPSGD_JaxModel)
# The TensorFlow clipped models' files: refused in one line (other_backend_class).
for _name in ("DPSGD_Model", "DPSGD_Sequential"):
    keras.utils.register_keras_serializable(package="lipdp")(
        other_backend_class(
            _name,
            "TensorFlow",
            "load it with KERAS_BACKEND=tensorflow (a clipped model's file loads on the "
            "backend that wrote it)",
        )
    )


__all__ = ["JAX_CLIPPING_MODES", "JAX_GRADIENT_METHODS", "DPSGD_JaxModel", "check_network"]
