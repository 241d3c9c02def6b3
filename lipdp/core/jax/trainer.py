r"""The private step skeleton of both families on Keras 3's JAX backend: :class:`JaxPrivateTrainer`.

A Keras model whose ``train_step`` is Keras 3's stateless JAX step
(``train_step(state, data) -> (logs, state)``, compiled by ``jax.jit``). What every
family's step does the same way is written here once:

1. **rows** (rule S9): rows with a NaN or an infinity (input or floating label) are zeroed
   and get weight 0; every row's weight is its sample weight clipped to ``[0, 1]`` -- the
   0/1 row mask of padded Poisson batches (:mod:`lipdp.core.jax.batches`), 1 without one;
   a fixed-size batch must have exactly ``b`` rows (rule S5);
2. **the gradient** (family hook :meth:`JaxPrivateTrainer._private_gradients`): the
   averaged gradient whose every row's part is within the family's sensitivity
   (clipped DP-SGD: the clipped per-example sum over ``b``; clipless: the gradient of
   ``sum_i w_i loss_i / n`` whose rows are bounded by the bound pass);
3. **the noise** (rule S8): Gaussian noise of the standard deviations of the one noise
   rule (:func:`lipdp.core.noise.noise_stddevs`, evaluated on the host in float64 and baked
   into the compiled step: one for the whole gradient, ``"global"``, or one per variable,
   ``"per-layer"``; or, when the sensitivities depend on the weights -- norm-adaptive
   kernels --, computed in the step from the state's weights, float32, by the family's
   hook :meth:`JaxPrivateTrainer._stddev_in_step`), drawn from a key held in the state
   that moves at every step (:mod:`lipdp.core.jax.keys`);
4. the optimizer's ``stateless_apply``, then the family's projections as a pure function
   of the state (hook :meth:`JaxPrivateTrainer._projected`; none by default);
5. **the privacy state** (rule S10), inside the step: the next key, ``noisy_steps + 1``, one
   more run of the step's mechanism in the ledger (:mod:`lipdp.core.jax.ledger`, placed
   from the table the step receives); then the logs.

The privacy surface (sigma, the plan, the ledger view and row, the guards of ``compile``,
``fit``, ``save`` and the weights, the configuration) is
:class:`lipdp.core.private_base.PrivateModelBase`'s. A saved file never holds the noise
key, and holds the step count and the ledger in the TensorFlow models' layout (``int64``,
``float64`` table): one ``.keras`` file loads on either backend
(:meth:`JaxPrivateTrainer.save_own_variables`); loaded or set weights never bring a key
(:meth:`JaxPrivateTrainer._own_state`).

This module imports JAX inside functions only; it is imported under the JAX backend only.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from lipdp.core import noise
from lipdp.core.jax import keys, ledger
from lipdp.core.jax.batches import PoissonBatches, data_parallel_devices
from lipdp.core.private_base import (
    PrivateModelBase,
    named_fit_arguments,
    refuse_mixed_precision,
)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a compiled step bakes in (decided on the host before training)."""

    #: The standard deviation of the noise on the averaged gradient: one float for every
    #: coordinate, or a tuple of one float per trainable variable (their order); ``None``:
    #: computed in the step from its state (:meth:`JaxPrivateTrainer._stddev_in_step`).
    stddev: float | tuple | None
    normalizer: float  # the loss normaliser n (b)
    rows: int | None  # the rows of a fixed-size batch (None: Poisson, padded)
    #: The ledger row of the mechanism the step releases (float64 values); where its run
    #: is counted is decided in the step, from the table it gets (ledger.recorded).
    ledger_row: tuple

    @property
    def noisy(self) -> bool:
        if self.stddev is None:  # from the state: a noiseless model bakes 0.0 instead
            return True
        stddevs = self.stddev if isinstance(self.stddev, tuple) else (self.stddev,)
        return any(s > 0 for s in stddevs)


class JaxPrivateTrainer(PrivateModelBase, keras.Model):
    """The JAX private step of both families (module docstring).

    A subclass calls :meth:`_init_private_state` in its constructor (after
    :meth:`_set_privacy_configuration`) and implements the hooks
    :meth:`_private_gradients` (required), :meth:`_step_stddev` (default: the one noise
    rule on :meth:`sensitivities`, one float for ``"global"`` noise), :meth:`_projected`
    and :meth:`_check_before_training`, besides :class:`PrivateModelBase`'s
    (:meth:`sensitivities`, :meth:`_noise_coefficients`, :meth:`_all_layers`,
    :meth:`_model_config`, :meth:`_network_from_config`).
    """

    #: The standard deviation is a constant of the compiled step, computed on the host.
    _noise_on_host = True
    _poisson_batches_hint = "lipdp.private_batches(model, x, y)"

    def _init_private_state(self) -> None:
        """The step's own variables: the noise key (rule S8; never in a saved file), the
        noisy step count and the ledger (rule S10), the count of neutralised rows."""
        #: Rule S8: the key of the next step's noise (keys module; never in a saved file).
        self.noise_key = keras.Variable(
            np.zeros(keys.KEY_WORDS, np.uint32), dtype="uint32", trainable=False, name="noise_key"
        )
        #: Rule S10: noisy steps taken, counted inside the step, saved with the weights.
        self.noisy_steps = keras.Variable(0, dtype="int32", trainable=False, name="noisy_steps")
        #: Rule S10: the ledger -- shared with the private model whose layers these are
        #: (:meth:`PrivateModelBase._lineage_ledger_variables`).
        self.privacy_ledger_table, self.privacy_ledger_counts = self._lineage_ledger_variables()
        #: Rule S9: rows neutralised for a NaN or an infinity (statistics for the owner of
        #: the data, in the logs as the loss is; not part of the release).
        self.non_finite_examples = keras.metrics.Sum(name="non_finite_examples")
        object.__setattr__(self, "_step_plan", None)
        object.__setattr__(self, "_traced_with", None)
        object.__setattr__(self, "_key_seed", None)

    # ------------------------------------------------------------------ hooks
    def _private_gradients(self, trainable, non_trainable, x, y, weights):
        """``(averaged gradient, per-row losses, predictions)`` on the state's values
        (family hook, in the compiled step): ``averaged`` aligned with
        ``trainable_variables``, every row's part within :meth:`sensitivities`; ``weights``
        (``(rows,)``, 0 for a padding or neutralised row, 1 otherwise) must weight the rows."""
        raise NotImplementedError

    def _projected(self, trainable, non_trainable):
        """``(trainable, non_trainable)`` after the optimizer's update, projected onto the
        family's constraint sets (pure; family hook: unchanged by default)."""
        return trainable, non_trainable

    def _check_before_training(self) -> None:
        """Refusals before every ``fit``/``train_on_batch`` (family hook; float32 here)."""
        refuse_mixed_precision(self._all_layers())

    def _step_stddev(self):
        """The :attr:`StepPlan.stddev` of the compiled step (host, float64): one float for
        ``"global"`` noise (:meth:`sensitivities`' entries all get the same), else one per
        trainable variable from :meth:`_variable_stddevs`."""
        if self.dp_parameters.noisify_strategy == "global":
            stddevs = self._entry_stddevs(self.sensitivities())
            return float(stddevs[0]) if stddevs else 0.0
        return tuple(float(s) for s in self._variable_stddevs())

    def _variable_stddevs(self) -> list[float]:
        """One standard deviation per trainable variable (``"per-layer"`` noise; family
        hook)."""
        raise NotImplementedError

    def _stddev_in_step(self, trainable, non_trainable):
        """The standard deviation(s) the compiled step draws with, on the step's state --
        the weights the gradient is taken at, the clip values the backward pass clips with
        (family hook): :attr:`StepPlan.stddev`, a constant of the step, by default; a
        family whose sensitivities read its state (norm-adaptive kernels, dynamic clip
        values) computes them here -- one float32 scalar (``"global"``) or one per
        trainable variable -- and its :meth:`_step_stddev` returns ``None``."""
        return self._step_plan.stddev

    # ---------------------------------------------------------------- privacy
    @staticmethod
    def _ledger_view(table, counts):
        """The ledger read exactly from the JAX variables (:mod:`lipdp.core.jax.ledger`)."""
        return ledger.ledger_view(table, counts)

    @staticmethod
    def _new_ledger_variables() -> tuple:
        """An empty ledger's ``int32`` words and counts (:mod:`lipdp.core.jax.ledger`)."""
        return ledger.create_variables()

    # ---------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
        self._check_compile_arguments(loss, kwargs)
        self._refuse_gradient_accumulation(keras.optimizers.get(optimizer))
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    # --------------------------------------------------------------- training
    def make_train_function(self, force=False):
        """Before every ``fit``/``train_on_batch``: the noise key (rule S8) and the step's
        constants (the noise, the normaliser, the ledger row of its mechanism); traced
        again when they changed. Keras' JAX ``fit`` calls it before ``on_train_begin``
        (where ``BackupAndRestore`` restores the ledger), so nothing here may depend on
        the ledger's contents: the step places its run itself (``ledger.recorded``)."""
        self._refuse_nothing_trainable()
        self._check_before_training()
        self._check_lineage(new_step=self.train_function is None or force)
        self._set_noise_key()
        plan = self._plan_step()
        trainable = tuple(id(v) for v in self.trainable_variables)
        configuration = (plan, trainable, self.physical_batch_size)
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

    def _plan_step(self) -> StepPlan:
        metadata = self._metadata_for("training")
        return StepPlan(
            stddev=self._step_stddev(),
            normalizer=float(metadata.loss_normalizer),
            rows=None if metadata.sampling == "poisson" else metadata.rows_per_batch,
            ledger_row=tuple(float(v) for v in self._step_row()),
        )

    def train_step(self, state, data):
        """One private step (module docstring), stateless: ``(logs, state)``."""
        import jax.numpy as jnp

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, weights, finite = self._neutralised_batch(data)
        released, next_key, losses, y_pred = self._released_gradients(
            trainable, non_trainable, x, y, weights
        )
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, released, trainable
        )
        trainable, non_trainable = self._projected(list(trainable), list(non_trainable))
        non_trainable = self._after_step(non_trainable, next_key)

        counted = weights > 0
        logs, metrics_variables = self._logged(
            metrics_variables, x, y, y_pred, losses, counted, jnp.sum(~finite)
        )
        return logs, (trainable, non_trainable, optimizer_variables, metrics_variables)

    def _neutralised_batch(self, data):
        """``(x, y, weights, finite)``: the batch with its non-finite rows zeroed, each
        row's weight (sample weight clipped to ``[0, 1]``, 0 for a non-finite row) and
        which rows were finite (rule S9); a fixed-size batch of another size refused."""
        import jax.numpy as jnp

        plan = self._step_plan
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        rows = _rows(x)
        if plan.rows is not None and rows != plan.rows:
            raise ValueError(
                f"DP training needs every batch to have exactly {plan.rows} rows (the "
                f"declared batch size; the sensitivity is computed for it), got {rows}: drop "
                "the partial last batch."
            )
        finite = finite_rows(x) & finite_rows(y)
        x, y = zeroed(finite, x), zeroed(finite, y)
        weights = jnp.ones((rows,), "float32")
        if sample_weight is not None:
            weights = jnp.clip(jnp.reshape(sample_weight, (rows,)).astype("float32"), 0.0, 1.0)
        weights = jnp.where(finite, weights, 0.0)
        return x, y, weights, finite

    def _released_gradients(self, trainable, non_trainable, x, y, weights):
        """``(released gradient, next key words, per-row losses, predictions)``: the
        family's averaged gradient (:meth:`_private_gradients`) plus the step's noise,
        drawn from the state's key (pure: the tests call it on a state)."""
        plan = self._step_plan
        averaged, losses, y_pred = self._accumulated_gradients(
            trainable, non_trainable, x, y, weights
        )
        next_key, draw = keys.next_key_and_draw(self._own(non_trainable, self.noise_key))
        if plan.noisy:
            stddev = self._stddev_in_step(trainable, non_trainable)
            averaged = [a + n for a, n in zip(averaged, keys.gaussian_like(draw, averaged, stddev))]
        return averaged, next_key, losses, y_pred

    def _accumulated_gradients(self, trainable, non_trainable, x, y, weights):
        """:meth:`_private_gradients` computed at most :attr:`physical_batch_size` rows at a
        time: the batch padded with rows of weight 0 (zeros: no contribution) to ``k P``
        rows, ``jax.lax.scan`` over the ``k`` micro-batches summing their gradients (each
        its rows' part of the logical batch's ``sum_i w_i C_i g_i / n``), the per-row
        losses and predictions stacked back in order and the padding dropped. A scan
        computes one micro-batch at a time: the memory of ``P`` rows."""
        import jax
        import jax.numpy as jnp

        size, rows = self.physical_batch_size, _rows(x)
        if size is None or rows <= size:
            return self._private_gradients(trainable, non_trainable, x, y, weights)
        chunks = -(-rows // size)
        padding = chunks * size - rows

        def split(t):
            t = jnp.concatenate([t, jnp.zeros((padding, *t.shape[1:]), t.dtype)])
            return jnp.reshape(t, (chunks, size, *t.shape[1:]))

        def body(sums, part):
            averaged, losses, y_pred = self._private_gradients(trainable, non_trainable, *part)
            return [s + g for s, g in zip(sums, averaged)], (losses, y_pred)

        zeros = [jnp.zeros(v.shape, v.dtype) for v in trainable]
        parts = jax.tree_util.tree_map(split, (x, y, weights))
        sums, outputs = jax.lax.scan(body, zeros, parts)

        def joined(t):
            return jnp.reshape(t, (chunks * size, *t.shape[2:]))[:rows]

        losses, y_pred = jax.tree_util.tree_map(joined, outputs)
        return sums, losses, y_pred

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

    # ----------------------------------------------------------------- guards
    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """Keras' ``fit``, privately. Under Poisson sampling, arrays (``fit(x, y,
        batch_size=b, epochs=E)``, ``batch_size`` omitted or the declared ``b``) become
        padded Poisson batches (:class:`~lipdp.core.jax.batches.PoissonBatches`), fresh
        every epoch, from the operating system's entropy
        (:meth:`~lipdp.core.private_base.PrivateModelBase._poisson_fit_data`):
        ``shuffle`` does not apply, ``validation_split`` holds out Keras' last rows exactly
        (the training part must be the declared ``N``), ``validation_data`` works and the
        steps per epoch are the metadata's. A ``PyDataset`` must be lipdp's Poisson
        batches (:func:`lipdp.private_batches`); one whose sampling lipdp cannot know is
        refused. Fixed-size sampling (``"shuffle"``): Keras batches the arrays in
        batches of ``b``."""
        kwargs = named_fit_arguments(args, kwargs)
        self._check_fit_arguments(x, y, batch_size, kwargs)
        x, y, batch_size = self._poisson_fit_data(x, y, batch_size, kwargs)
        self._prepare_weights_for_training()
        if isinstance(x, PoissonBatches):
            kwargs.setdefault("shuffle", False)
        elif batch_size is None and not isinstance(x, keras.utils.PyDataset):
            batch_size = self.batch_size
        return super().fit(x, y, batch_size, **kwargs)

    def _poisson_batches(self, x, y, metadata, seed):
        """:class:`~lipdp.core.jax.batches.PoissonBatches`, padded to a multiple of 8 rows
        per device of a Keras distribution."""
        multiple = 8 * data_parallel_devices()
        rate, steps = metadata.sampling_rate, metadata.nb_steps_per_epochs
        return PoissonBatches(x, y, rate, steps, metadata.batch_size, multiple, seed)

    def _poisson_batches_facts(self, x):
        """The rate and steps of padded Poisson batches (:mod:`lipdp.core.jax.batches`),
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
        self._prepare_weights_for_training()
        return super().train_on_batch(x, y, sample_weight=sample_weight, return_dict=return_dict)

    # ---------------------------------------------------------- privacy state
    def save_own_variables(self, store):
        """The file layout of every backend (the TensorFlow models'): the model's own
        variables in Keras' order without the noise key (rule S8: a file never holds a key;
        a reloaded model draws a fresh one before it trains), the step count as ``int64``,
        the ledger as its ``float64`` table and ``int64`` counts
        (:func:`lipdp.core.jax.ledger.file_entries`, exact). A file saved here loads on
        TensorFlow, and a TensorFlow model's file here (:meth:`load_own_variables`)."""
        table, counts = ledger.file_entries(
            self.privacy_ledger_table.numpy(), self.privacy_ledger_counts.numpy()
        )
        entries = {
            id(self.noisy_steps): np.int64(self.noisy_steps.numpy()),
            id(self.privacy_ledger_table): table,
            id(self.privacy_ledger_counts): counts,
        }
        for i, variable in enumerate(self._file_variables()):
            store[f"{i}"] = entries.get(id(variable), variable)

    def load_own_variables(self, store):
        """Read :meth:`save_own_variables`'s layout (also a TensorFlow model's file), or
        the layout lipdp's JAX models wrote before it (the zeroed key first, an ``int32``
        step count, the ledger's ``int32`` words): the noise key is never read (rule S8),
        the ledger and the step count are converted exactly or the file is refused in one
        line (rule S10: never loaded with an empty or a smaller ledger,
        :func:`lipdp.core.jax.ledger.from_file`)."""
        own = self._file_variables()
        names = sorted(store.keys(), key=int)
        old = len(names) == len(own) + 1  # the layout with the key, written before
        if len(names) != len(own) + old:
            raise ValueError(
                f"This file holds {len(names)} variables of model {self.name!r}, not the "
                f"{len(own)} of its privacy state ({[v.name for v in own]}): load it into "
                "the model class and configuration that wrote it."
            )
        values = {id(v): store[name] for v, name in zip(own, names[old:])}
        table, counts = ledger.from_file(
            np.asarray(values.pop(id(self.privacy_ledger_table))),
            np.asarray(values.pop(id(self.privacy_ledger_counts))),
        )
        steps = np.asarray(values.pop(id(self.noisy_steps)))
        if steps.shape != () or steps.dtype.kind not in "iu" or not 0 <= steps <= ledger.INT32_MAX:
            raise ValueError(
                f"The noisy step count in this file ({steps!r}) is not a count between 0 and "
                f"{ledger.INT32_MAX}: it cannot be read; load the file on the TensorFlow backend."
            )
        for variable in own:
            if id(variable) in values:
                variable.assign(values[id(variable)])
        self.noisy_steps.assign(np.int32(steps))
        self.privacy_ledger_table.assign(table)
        self.privacy_ledger_counts.assign(counts)

    def _file_variables(self) -> list:
        """The model's own variables (Keras' order) a file holds: all but the noise key."""
        own = self._trainable_variables + self._non_trainable_variables
        return [v for v in own if v is not self.noise_key]

    def _own_state(self):
        """Loaded or set weights never bring a noise key: it stays this model's own (rule
        S8: another model's key would replay its noise)."""
        key = np.array(self.noise_key.numpy())
        return lambda: self.noise_key.assign(key)


# ---------------------------------------------------------------------- helpers
def _rows(x) -> int:
    return int(keras.tree.flatten(x)[0].shape[0])


def finite_rows(values):
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


def zeroed(finite, values):
    """``values`` with the floating leaves of the rows not ``finite`` set to 0."""
    import jax.numpy as jnp

    def zero(leaf):
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        mask = jnp.reshape(finite, (-1,) + (1,) * (leaf.ndim - 1))
        return jnp.where(mask, leaf, jnp.zeros_like(leaf))

    return keras.tree.map_structure(zero, values)


def per_row_loss(loss):
    """The compiled loss as ``(y_true, y_pred) -> per-row values`` (no reduction)."""
    loss = keras.losses.get(loss)
    return loss.call if isinstance(loss, keras.losses.Loss) else loss


__all__ = ["JaxPrivateTrainer", "StepPlan", "finite_rows", "per_row_loss", "zeroed"]
