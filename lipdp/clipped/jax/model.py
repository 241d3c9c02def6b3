r"""Clipped DP-SGD on Keras 3's JAX backend: :class:`DPSGD_JaxModel`.

A Keras model (the *network*: a ``Sequential``, a functional or a subclassed model of
ordinary Keras layers) wrapped in a model whose ``train_step`` is Keras 3's stateless JAX
step (``train_step(state, data) -> (logs, state)``, compiled by ``jax.jit``):

1. rows with a NaN or an infinity (input or floating label) are zeroed and get weight 0;
   every row's weight is its sample weight clipped to ``[0, 1]`` -- the 0/1 row mask of
   padded Poisson batches (:mod:`lipdp.clipped.jax.batches`), 1 without one (rule S9);
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
   :mod:`lipdp.clipped.jax.keys`);
4. the optimizer's update; the step count ``noisy_steps`` and the privacy ledger
   (:mod:`lipdp.clipped.jax.ledger`) are updated inside the step, model variables saved
   in ``.keras`` files (rule S10).

The privacy surface is the TensorFlow models' own, written once in
:class:`lipdp.core.private_base.PrivateModelBase`: sigma, the noise standard deviation (by
:func:`lipdp.core.noise.noise_stddevs`), the privacy plan (one subsampled Gaussian of
multiplier ``sigma`` per step, rate ``q = b / N``: the epsilon planned is the epsilon
logged, rule S11), the ledger row, and the guards of ``compile``, ``fit``, ``save``,
``set_weights`` and ``load_weights`` with their messages; ``DP_Accountant``,
``privacy_report`` and ``calibrate_noise_multiplier`` are shared too.

**Rows isolated by construction** (rule S2, :mod:`lipdp.clipped.jax.isolation`): both
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

import dataclasses
import logging

import keras
import numpy as np

from lipdp.clipped.clipping import Clipping
from lipdp.clipped.jax import ghost, isolation, keys, ledger, per_example
from lipdp.clipped.jax.batches import PoissonBatches
from lipdp.clipped.layer_support import check_keras_layers
from lipdp.core import noise
from lipdp.core.private_base import (
    PrivateModelBase,
    one_target_per_output,
    refuse_mixed_precision,
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


@dataclasses.dataclass(frozen=True)
class _StepPlan:
    """What a compiled step bakes in (decided on the host before training)."""

    stddev: float  # of the noise on the averaged gradient
    normalizer: float  # b
    rows: int | None  # the rows of a fixed-size batch (None: Poisson, padded)
    #: The ledger row of the mechanism the step releases (float64 values); where its run
    #: is counted is decided in the step, from the table it gets (ledger.recorded).
    ledger_row: tuple


class DPSGD_JaxModel(PrivateModelBase, keras.Model):
    """A Keras model trained with clipped DP-SGD on the JAX backend (module docstring).

    The privacy surface it shares with the TensorFlow models (sigma, the noise multipliers
    and standard deviation, the plan, the ledger view and row, the guards of compile, fit,
    save and the weights, the configuration) is
    :class:`lipdp.core.private_base.PrivateModelBase`'s; this class holds the JAX step,
    its noise keys and its ledger variables (:mod:`lipdp.clipped.jax.ledger`).

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
    """

    def __init__(
        self, network, *, dp_parameters, clipping=Clipping(), dataset_metadata=None,
        gradient_method="ghost", **kwargs,
    ):  # fmt: skip
        super().__init__(**kwargs)
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
        #: Rule S8: the key of the next step's noise (keys module; zeroed in saved files).
        self.noise_key = keras.Variable(
            np.zeros(keys.KEY_WORDS, np.uint32), dtype="uint32", trainable=False, name="noise_key"
        )
        #: Rule S10: noisy steps taken, counted inside the step, saved with the weights.
        self.noisy_steps = keras.Variable(0, dtype="int32", trainable=False, name="noisy_steps")
        self.privacy_ledger_table, self.privacy_ledger_counts = ledger.create_variables()
        #: Rule S9: rows neutralised for a NaN or an infinity (statistics for the owner of
        #: the data, in the logs as the loss is; not part of the release).
        self.non_finite_examples = keras.metrics.Sum(name="non_finite_examples")
        object.__setattr__(self, "_step_plan", None)
        object.__setattr__(self, "_traced_with", None)
        object.__setattr__(self, "_key_seed", None)
        if network.built:
            self.built = True

    #: The standard deviation is a constant of the compiled step, computed on the host.
    _noise_on_host = True
    _poisson_batches_hint = "lipdp.private_batches(model, x, y)"

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

    @staticmethod
    def _ledger_view(table, counts):
        """The ledger read exactly from the JAX variables (:mod:`lipdp.clipped.jax.ledger`)."""
        return ledger.ledger_view(table, counts)

    # -------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
        self._check_compile_arguments(loss, kwargs)
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    # ------------------------------------------------------------ training
    def make_train_function(self, force=False):
        """Before every ``fit``/``train_on_batch``: the noise key (rule S8) and the step's
        constants (the noise, the normaliser, the ledger row of its mechanism); traced
        again when they changed. Keras' JAX ``fit`` calls it before ``on_train_begin``
        (where ``BackupAndRestore`` restores the ledger), so nothing here may depend on
        the ledger's contents: the step places its run itself (``ledger.recorded``)."""
        self._refuse_nothing_trainable()
        refuse_mixed_precision(self._all_layers())
        check_network(self.network)  # again: a layer may have been unfrozen since
        self._set_noise_key()
        plan = self._plan_step()
        configuration = (plan, tuple(id(v) for v in self.trainable_variables))
        if configuration != self._traced_with:
            force = True
        object.__setattr__(self, "_step_plan", plan)
        object.__setattr__(self, "_traced_with", configuration)
        return super().make_train_function(force)

    def _set_noise_key(self) -> None:
        seed = noise.reproducible_noise_seed()
        if seed is None:
            self.noise_key.assign(keys.entropy_key())
            object.__setattr__(self, "_key_seed", None)
        elif seed != self._key_seed:  # reproducible: seeded once, then moves step by step
            self.noise_key.assign(keys.seeded_key(seed))
            object.__setattr__(self, "_key_seed", seed)

    def _plan_step(self) -> _StepPlan:
        metadata = self._metadata_for("training")
        return _StepPlan(
            stddev=float(self.noise_stddev()),
            normalizer=float(metadata.loss_normalizer),
            rows=None if metadata.sampling == "poisson" else metadata.rows_per_batch,
            ledger_row=tuple(float(v) for v in self._step_row()),
        )

    def train_step(self, state, data):
        """One private step (module docstring), stateless: ``(logs, state)``."""
        import jax.numpy as jnp

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        plan = self._step_plan
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        rows = _rows(x)
        if plan.rows is not None and rows != plan.rows:
            raise ValueError(
                f"DP training needs every batch to have exactly {plan.rows} rows (the "
                f"declared batch size; the sensitivity is computed for it), got {rows}: drop "
                "the partial last batch."
            )
        finite = _finite_rows(x) & _finite_rows(y)
        x, y = _zeroed(finite, x), _zeroed(finite, y)
        weights = jnp.ones((rows,), "float32")
        if sample_weight is not None:
            weights = jnp.clip(jnp.reshape(sample_weight, (rows,)).astype("float32"), 0.0, 1.0)
        weights = jnp.where(finite, weights, 0.0)
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

        next_key, draw = keys.next_key_and_draw(self._own(non_trainable, self.noise_key))
        averaged = [s / plan.normalizer for s in summed]
        if plan.stddev > 0:
            averaged = [
                a + n for a, n in zip(averaged, keys.gaussian_like(draw, averaged, plan.stddev))
            ]
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, averaged, trainable
        )
        non_trainable = self._after_step(non_trainable, next_key)

        counted = weights > 0
        logs, metrics_variables = self._logged(
            metrics_variables, x, y, y_pred, losses, counted, jnp.sum(~finite)
        )
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    def _refuse_cross_row_primitives(self, trainable, non_trainable, x, y) -> None:
        """Rule S2 (:mod:`lipdp.clipped.jax.isolation`): one row's loss and gradient,
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

        loss_fn = _per_row_loss(self.loss)
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

        loss_fn = _per_row_loss(self.loss)

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

    def _own(self, non_trainable, variable):
        """The value of one of this model's own non-trainable variables in the state."""
        return non_trainable[self._index(variable)]

    def _index(self, variable) -> int:
        return next(i for i, v in enumerate(self.non_trainable_variables) if v is variable)

    def _after_step(self, non_trainable, next_key):
        """The state after one step: the next key, one more step, one more run of the
        step's mechanism in the ledger, placed from the table the step was given (which
        a restore or a callback may have changed since the step was compiled)."""
        plan = self._step_plan
        non_trainable = list(non_trainable)
        table_at = self._index(self.privacy_ledger_table)
        counts_at = self._index(self.privacy_ledger_counts)
        non_trainable[table_at], non_trainable[counts_at] = ledger.recorded(
            non_trainable[table_at], non_trainable[counts_at], np.asarray(plan.ledger_row)
        )
        non_trainable[self._index(self.noise_key)] = next_key
        steps_at = self._index(self.noisy_steps)
        non_trainable[steps_at] = non_trainable[steps_at] + 1
        return non_trainable

    def _logged(self, metrics_variables, x, y, y_pred, losses, counted, non_finite):
        """The logs (loss and metrics of the rows that entered the step, rows neutralised):
        statistics of the private data for its owner, not part of the release."""
        import jax.numpy as jnp

        kept = counted.astype("float32")
        count = jnp.sum(kept)
        mean_loss = jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(count, 1.0)
        mapping = list(zip(self.metrics_variables, metrics_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._loss_tracker.update_state(mean_loss, sample_weight=count)
            self.non_finite_examples.update_state(non_finite.astype("float32"))
            logs = self.compute_metrics(x, y, y_pred, sample_weight=kept)
        return logs, [scope.get_current_value(v) for v in self.metrics_variables]

    # -------------------------------------------------------------- guards
    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._check_fit_arguments(x, y, batch_size, kwargs)
        if isinstance(x, PoissonBatches):
            kwargs.setdefault("shuffle", False)
        elif batch_size is None and not isinstance(x, keras.utils.PyDataset):
            batch_size = self.batch_size
        return super().fit(x, y, batch_size, *args, **kwargs)

    def _poisson_batches_facts(self, x):
        """The rate and steps of padded Poisson batches (:mod:`lipdp.clipped.jax.batches`),
        or ``None`` for other data."""
        return (x.sampling_rate, len(x)) if isinstance(x, PoissonBatches) else None

    def _checked_data_source(self, x) -> bool:
        if isinstance(x, PoissonBatches):
            raise ValueError(
                "Poisson batches given to a model declared with sampling='shuffle': declare "
                "DatasetMetadata(sampling='poisson')."
            )
        return False

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        if class_weight is not None:
            raise ValueError("class_weight is not supported: it changes the sensitivity.")
        if sample_weight is not None and self._metadata_for("training").sampling != "poisson":
            raise ValueError("sample_weight is not supported: it changes the sensitivity.")
        return super().train_on_batch(x, y, sample_weight=sample_weight, return_dict=return_dict)

    # ------------------------------------------------------- privacy state
    def save_own_variables(self, store):
        """Every variable but the noise key, written as zeros (rule S8: a file never holds
        a key; a reloaded model draws a fresh one before it trains)."""
        own = self._trainable_variables + self._non_trainable_variables
        for i, variable in enumerate(own):  # the layout of Keras' own save_own_variables
            key = variable is self.noise_key
            store[f"{i}"] = np.zeros(keys.KEY_WORDS, np.uint32) if key else variable

    def _own_state(self):
        """Loaded or set weights never bring a noise key: it stays this model's own (rule
        S8: another model's key would replay its noise)."""
        key = np.array(self.noise_key.numpy())
        return lambda: self.noise_key.assign(key)

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


# ---------------------------------------------------------------------- helpers
def _rows(x) -> int:
    return int(keras.tree.flatten(x)[0].shape[0])


def _finite_rows(values):
    """``(rows,)``: no NaN and no infinity in the row of any floating leaf."""
    import jax.numpy as jnp

    result = None
    for leaf in keras.tree.flatten(values):
        if leaf is None or not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
            continue
        leaf = jnp.asarray(leaf)
        ok = jnp.all(jnp.isfinite(jnp.reshape(leaf, (leaf.shape[0], -1))), axis=1)
        result = ok if result is None else result & ok
    if result is None:
        return jnp.ones((_rows(values),), bool)
    return result


def _zeroed(finite, values):
    """``values`` with the floating leaves of the rows not ``finite`` set to 0."""
    import jax.numpy as jnp

    def zero(leaf):
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        mask = jnp.reshape(finite, (-1,) + (1,) * (leaf.ndim - 1))
        return jnp.where(mask, leaf, jnp.zeros_like(leaf))

    return keras.tree.map_structure(zero, values)


def _per_row_loss(loss):
    """The compiled loss as ``(y_true, y_pred) -> per-row values`` (no reduction)."""
    loss = keras.losses.get(loss)
    return loss.call if isinstance(loss, keras.losses.Loss) else loss


__all__ = ["JAX_CLIPPING_MODES", "JAX_GRADIENT_METHODS", "DPSGD_JaxModel", "check_network"]
