"""What both model families share: a Keras model trained privately.

:class:`PrivateModel` is the TensorFlow model of
:class:`lipdp.core.private_base.PrivateModelBase`, which holds what every backend shares
(sigma, the accountant's multipliers and the noise standard deviations of
:mod:`lipdp.core.noise`, the privacy plan, the ledger view and row, the non-private
reference run, the guards of ``compile``, ``fit``, ``save``, ``set_weights`` and
``load_weights``, the configuration). This class adds the TensorFlow side: the
noisy-step counter and the privacy ledger as TensorFlow/Keras variables saved with the
weights (rule S10, :mod:`lipdp.core.ledger`), the one forward loop over the layers, the
one training step (:meth:`PrivateModel.train_step`: rule S9, the noise drawn by
:func:`lipdp.core.noise.add_noise`, the update, the ledger row, the logs) and the guards
of ``train_on_batch`` and of ``tf.data`` pipelines (rules S5, S9, S10, S12). A family says
how its gradient is bounded:

* :class:`lipdp.clipless.model.DP_Model` (clipless): sensitivities from the one bound pass of
  :mod:`lipdp.clipless.bounds`, the gradient of the batch loss, weights projected after
  every step;
* :class:`lipdp.clipped.model.DPSGD_Model` (clipped DP-SGD): sensitivity = the clip norm,
  per-example gradients clipped and summed.

A family implements :meth:`PrivateModel.sensitivities`, ``_noise_coefficients`` and
``_noised_variables`` (what each sensitivity's noise covers), ``_private_gradients`` (the
averaged gradient of a batch), and may override the hooks ``_check_layers``,
``_check_loss``, ``_check_adversarial``, ``_all_layers``, ``_other_releases``,
``_refuse_unsupported_step``, ``_neutralised_rows``, ``_after_release`` and ``project``.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from lipdp.core import batch_independence, distribute, isolation, ledger, noise
from lipdp.core.adversarial import PGD, softmax_kl
from lipdp.core.parameters import DPParameters
from lipdp.core.private_base import (
    PrivateModelBase,
    check_poisson_batches,
    check_reduction,
    named_fit_arguments,
    one_target_per_output,
)
from lipdp.core.private_base import refuse_mixed_precision as _refuse_mixed_precision
from lipdp.core.private_base import refuse_non_finite as _refuse_non_finite  # noqa: F401
from lipdp.core.private_base import shown as _shown
from lipdp.core.records import (
    finite_rows,
    ids_in_range,
    kept_rows,
    labels_in_range,
    neutralised_losses,
    read_ids,
    zero_rows,
)
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import nested_layers
from lipdp.foundation.variables import as_one_of, state_variable, variable_key

compat.require_supported_keras()
logger = logging.getLogger(__name__)


class StepGradients(NamedTuple):
    """What a family's :meth:`PrivateModel._private_gradients` gives the shared step."""

    #: The averaged gradient (before noise), aligned with ``trainable_variables``.
    gradients: list
    #: The predictions the logs' loss and metrics are computed on.
    predictions: tf.Tensor
    #: The inputs handed to ``compute_loss`` (the rows the predictions are of), or
    #: ``None`` when they are the step's own inputs: a logical batch computed in
    #: micro-batches then needs no second copy of its inputs (at b = 8192 rows of 28x28,
    #: a TensorArray and its concatenation: 50 MB).
    loss_inputs: object = None


class PrivateModel(PrivateModelBase, keras.Model):
    """A Keras model over a list of layers, trained under (epsilon, delta)-DP (module
    docstring). The privacy surface every backend shares (sigma, the noise multipliers,
    the plan, the ledger, the guards of compile, fit, save and the weights, the
    configuration) is :class:`lipdp.core.private_base.PrivateModelBase`'s; this class adds
    the TensorFlow step.

    Args:
        dp_layers: the layers, applied in order (checked by the family's ``_check_layers``).
        dp_parameters: :class:`DPParameters`.
        dataset_metadata: :class:`lipdp.foundation.metadata.DatasetMetadata` (the batch size
            ``b`` and ``N``); required for training.
        adversarial: a :class:`lipdp.core.adversarial.PGD` (or its config): train on each
            row's adversarial version (or a mix), computed in the step from the current
            weights; same sensitivity and privacy (:mod:`lipdp.core.adversarial`). ``None``
            (default): clean training.
        debug: run eagerly and log every step's sensitivities and noise levels.
        independence_probe: run the batch-independence probe of
            :mod:`lipdp.core.batch_independence` when the training step is first traced
            (default). ``False`` skips it -- for a model you know treats each example on
            its own -- and the privacy report says so; the structural walk and the
            per-example loss check still run (rule S2).
        row_isolation: compute each example's loss in isolation (:mod:`lipdp.core.isolation`):
            in training, every layer lipdp does not own, its activation and the loss run
            on one row at a time, forward and backward (a vectorised map over the rows),
            so that no code but lipdp's own ever sees two examples: rule S2 then holds by
            construction, whatever the layers compute, instead of being checked by the
            probe at a few points. Writes to variables and other stateful operations in
            those calls are refused when the step is traced (random seed states
            excepted). ``False``: layers run on the batch, as Keras runs them; the
            structural walk and the probe check rule S2. The families' defaults: on
            for the clipless family (only ``DP_Lambda``, foreign DP layers and the loss
            are isolated: 1.01x the batched step), off for clipped DP-SGD (1.21x on the
            CNN of ``lipdp train --method dp-sgd``; ``benchmarks/row_isolation_cost.py``).
        physical_batch_size: compute the step ``P`` rows at a time and noise the logical
            batch once (:attr:`~lipdp.core.private_base.PrivateModelBase.physical_batch_size`):
            logical batches larger than memory. ``None`` (default): the whole batch at once.
    """

    _layers_key = "dp_layers"

    @staticmethod
    def _check_layers(layers) -> None:
        """Refuse layers the family cannot bound (with the fix in the message)."""
        raise NotImplementedError

    def __init__(
        self,
        dp_layers,
        *,
        dp_parameters,
        dataset_metadata=None,
        adversarial=None,
        debug=False,
        independence_probe=True,
        row_isolation=False,
        physical_batch_size=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.physical_batch_size = physical_batch_size
        compat.refuse_foreign_layers(dp_layers)
        self._check_layers(dp_layers)
        self.adversarial = adversarial
        self._set_privacy_configuration(dp_parameters, dataset_metadata)
        self.dp_layers = list(dp_layers)
        self.debug = bool(debug)
        self.independence_probe = bool(independence_probe)
        if not isinstance(row_isolation, bool):
            raise TypeError(f"row_isolation must be True or False, got {row_isolation!r}.")
        self.row_isolation = row_isolation
        # The input specs the batch-independence probe has passed (reset by compile).
        object.__setattr__(self, "_independence_probed", set())
        # Training examples neutralised by rule S9, per epoch, in the training logs: with a
        # NaN or an infinity (input or label), finite ones with a token id out of range
        # and the others whose class label is out of range. Like the loss and the accuracy
        # there, statistics of the private data for its owner, not part of the DP release.
        # Kept out of Keras' metric list (object.__setattr__) so that evaluate() returns
        # what it always did.
        object.__setattr__(self, "_non_finite", keras.metrics.Sum(name="non_finite_examples"))
        object.__setattr__(self, "_invalid_inputs", keras.metrics.Sum(name="invalid_inputs"))
        object.__setattr__(self, "_invalid_labels", keras.metrics.Sum(name="invalid_labels"))
        #: Noisy steps taken (rule S10): a model variable, so it is saved and restored with
        #: the weights in every format (.keras, save_weights, checkpoints, BackupAndRestore)
        #: and survives a new optimizer; the accountant counts epochs from it.
        self.noisy_steps = state_variable(0, "int64", "noisy_steps")
        #: What the steps released, mechanism by mechanism (rule S10, :mod:`lipdp.core.ledger`):
        #: model variables too, saved wherever the step count is.
        #: Layers of another private model of this process (trained here, or loaded from
        #: a file) bring its ledger: the two models then share it; layers of several
        #: bring the composition of theirs (the lineage of those weights,
        #: :func:`lipdp.core.ledger.inherited_ledger`).
        table, counts = self._lineage_ledger_variables()
        self.privacy_ledger_table, self.privacy_ledger_counts = table, counts
        if dataset_metadata is not None:
            if dataset_metadata.sampling == "poisson" and dataset_metadata.multiplicity:
                raise ValueError(
                    "Augmentation multiplicity is not supported with Poisson sampling; "
                    "use sampling='shuffle' or multiplicity=0."
                )
        input_shape = compat.declared_batch_shape(self.dp_layers[0])
        if input_shape is not None:
            self.build(input_shape)
        # From now on the layers' weights are priced by this ledger (a model loaded from a
        # file: the ledger loaded with them), wherever they are reused (rule S10).
        self._claim_layers()

    # ----------------------------------------------------------------- structure
    def build(self, input_shape):
        """Build every layer for inputs of ``input_shape`` (with the batch dimension)."""
        if not compat.keras_3():
            return super().build(input_shape)
        # Keras 3 builds a subclassed model by calling it. Each layer of the forward loop is
        # called on symbolic tensors, as a Sequential builds its layers: a layer builds for
        # real (its build's assignments, e.g. an initial projection, happen -- inside a
        # symbolic_call's stateless scope they would be dropped), and a layer that cannot
        # run on these inputs raises what a real call would.
        self.forward(_symbolic(input_shape))
        return None

    def compute_output_shape(self, input_shape):
        """The output shape for inputs of ``input_shape`` (with the batch dimension; a nest
        for several inputs), from a symbolic call (Keras 3 has no default for models)."""
        if not compat.keras_3():
            return super().compute_output_shape(input_shape)
        outputs = compat.symbolic_call(self.call, _symbolic(input_shape))
        return tf.nest.map_structure(lambda spec: tuple(spec.shape), outputs)

    def call(self, inputs, training=None):
        return self.forward(inputs, training=training)

    @property
    def adversarial(self) -> PGD | None:
        """The adversarial training (:class:`lipdp.core.adversarial.PGD`) or ``None``; may be
        set after construction (the next ``fit`` traces a new training step)."""
        return self._adversarial

    @adversarial.setter
    def adversarial(self, value):
        value = PGD.coerce(value)
        if value is not None:
            self._check_adversarial(value)
        self._adversarial = value
        self.train_function = None  # a step traced without (or with another) attack

    def _check_adversarial(self, pgd) -> None:
        """Refuse an attack the family cannot bound (hook; everything by default)."""

    def forward(
        self, inputs, training=None, observe=None, apply=None, loss_weight=1.0, isolate=None
    ):
        """The one forward loop over ``dp_layers``.

        Layers that clip cotangents receive the loss normaliser of the model's metadata
        (:attr:`loss_normalizer`), divided by ``loss_weight`` when the pass's loss is
        weighted (adversarial training's mix): its cotangents are then clipped at the
        pass's share ``loss_weight * C`` of the clip value.

        ``observe(index, output)``, if given, is called after
        every layer and returns the tensor to continue with (e.g. after ``tape.watch``):
        how diagnostics and dynamic clipping look inside the network without a second
        copy of this loop. ``apply(layer, h, kwargs)``, if given, replaces the call
        ``layer(h, training=training, **kwargs)`` (how :mod:`lipdp.clipped.per_example` records
        each layer's pre-activation output).

        ``isolate``: run the layers lipdp does not own one row at a time
        (:meth:`isolated_layer_call`); ``None``: in training (``training=True``) when the
        model has ``row_isolation``. Symbolic inputs (building) always run on the batch.
        """
        h = inputs
        if isolate is None:
            isolate = self.row_isolation and training is True
        isolate = isolate and _real_tensors(inputs)
        normalizer = self.loss_normalizer
        if loss_weight != 1.0:
            rows = normalizer if normalizer is not None else tf.shape(tf.nest.flatten(h)[0])[0]
            normalizer = tf.cast(rows, tf.float32) / loss_weight
        normalizer = {"loss_normalizer": normalizer}
        with compat.op_name_scope(self.name):
            for index, layer in enumerate(self.dp_layers):
                kwargs = normalizer if getattr(layer, "uses_loss_normalizer", False) else {}
                if isinstance(layer, keras.layers.InputLayer):
                    pass  # the identity (Keras 3's InputLayer cannot be called)
                elif apply is None and isolate and not self._runs_batched(layer):
                    h = self.isolated_layer_call(layer, h, training, kwargs)
                elif apply is None:
                    h = layer(h, training=training, **kwargs)
                else:
                    h = apply(layer, h, kwargs)
                if observe is not None:
                    h = observe(index, h)
        return h

    def isolated_layer_call(self, layer, h, training, kwargs):
        """``layer(h, training=training, **kwargs)`` one row at a time, forward and backward
        (:func:`lipdp.core.isolation.isolated_call`)."""
        return isolation.isolated_call(
            lambda batch: layer(batch, training=training, **kwargs),
            h,
            what=f"Layer {layer.name!r} ({type(layer).__name__})",
            layers=[layer],
            loop=self._row_loop(layer),
        )

    def _runs_batched(self, layer) -> bool:
        """Whether ``layer`` runs on the whole batch under row isolation: code of lipdp's
        own that treats each row on its own (family hook; none by default)."""
        return False

    def _row_loop(self, layer) -> bool:
        """Whether an isolated ``layer`` runs as a loop over rows (``tf.map_fn``) rather
        than a vectorised map (family hook: layers ``pfor`` cannot vectorise)."""
        return False

    def layers_forward_order(self):
        return list(self.dp_layers)

    def layers_backward_order(self):
        return list(reversed(self.dp_layers))

    @property
    def loss_normalizer(self) -> int | None:
        """What the summed per-row loss of a batch is divided by (``None``: the rows of
        the batch, for a model without metadata)."""
        metadata = self.dataset_metadata
        return None if metadata is None else metadata.loss_normalizer

    def _all_layers(self):
        """Every layer whose dtype matters (wrapped blocks included)."""
        return list(self.dp_layers)

    # ---------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
        self._check_compile_arguments(loss, kwargs)
        self._refuse_gradient_accumulation(keras.optimizers.get(optimizer))
        # Layers frozen at construction may have been unfrozen since (rule S2).
        batch_independence.refuse_coupling_layers(self.dp_layers)
        self._independence_probed.clear()  # another loss: probed again
        if self.debug:
            kwargs["run_eagerly"] = True
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    # ------------------------------------------------------------- sensitivity
    def _noised_variables(self, entries) -> list[list]:
        """The trainable variables each entry of :meth:`sensitivities` covers, aligned with
        ``entries`` (family hook): its noise standard deviation applies to each of them."""
        raise NotImplementedError

    def noise_stddevs(self, sensitivities=None):
        """``{variable ref: standard deviation of its noise}`` by the noise rule of
        :func:`lipdp.core.noise.noise_stddevs`: ``sigma sqrt(sum Delta^2)`` on every
        variable (``"global"``), ``sigma c Delta`` on the variables of each entry
        (``"per-layer"``); 0 for a non-private model. ``sensitivities``: the result of
        :meth:`sensitivities` if already computed."""
        entries = self.sensitivities() if sensitivities is None else sensitivities
        stddevs = self._entry_stddevs(entries)
        groups = self._noised_variables(entries)
        return {variable_key(v): std for group, std in zip(groups, stddevs) for v in group}

    def _step_configuration(self) -> tuple:
        """What a traced training step bakes in: the privacy parameters (noise), the
        metadata (``b``, the sampling rate), the attack and the trainable variables."""
        trainable = tuple(variable_key(v) for v in self.trainable_variables)
        return (self.dp_parameters, self.dataset_metadata, self.adversarial, trainable)

    # --------------------------------------------------------------- training
    def per_example_losses(self, y, y_pred):
        """The loss of each row (mean over its non-batch axes), shape ``(rows,)``; a row
        whose label is unusable -- a NaN or an infinity, a class index out of range --
        counts 0 whatever the loss (rule S9, :func:`lipdp.core.records.neutralised_losses`)."""
        loss = keras.losses.get(self.loss)
        fn = loss.call if isinstance(loss, keras.losses.Loss) else loss

        def batched(labels, predictions):
            values = fn(_one_target_per_output(labels, predictions), predictions)
            # A loss without per-row values (a batch mean) is refused when traced (S2).
            batch_independence.check_per_example_values(values, predictions, self.loss)
            rank = len(values.shape)
            return values if rank == 1 else tf.reduce_mean(values, axis=list(range(1, rank)))

        def one_row(pair):  # a batch of one: any reduction gives the row's own loss
            labels, predictions = pair
            values = fn(_one_target_per_output(labels, predictions), predictions)
            return tf.reshape(tf.reduce_mean(values), [1])

        def isolated(labels, predictions):
            name = f"The loss {_loss_name(self.loss)!r}"
            return isolation.isolated_call(one_row, (labels, predictions), what=name)

        rows = isolated if self.row_isolation and _real_tensors((y, y_pred)) else batched
        with tf.GradientTape() as probe:  # the trainable variables the loss reads itself
            losses = neutralised_losses(rows, y, y_pred, self._ignored_class())
        self._refuse_loss_reads(probe.watched_variables())
        return losses

    def _refuse_loss_reads(self, read) -> None:
        """Refuse a loss that reads (``read``: the variables a tape watched while it ran)
        a trainable variable of the model itself, e.g. a weight penalty written inside the
        loss: the sensitivities bound the loss's gradient through the predictions only,
        and the penalty's gradient comes once per sampled row (clipless family: remove-one
        ratio 2.8, ``tests/test_attacks_couplings_records_ledger.py``). A hook: the clipped
        family lets its gradient method decide
        (:func:`lipdp.clipped.per_example.refuse_loss_reads`)."""
        own = {variable_key(v) for v in self.trainable_variables}
        for v in read:
            if variable_key(v) in own:
                v = as_one_of(v, self.trainable_variables)  # its Keras name
                raise ValueError(
                    f"The loss reads variable {v.name!r} of the model directly: its gradient "
                    "is outside the sensitivity bounds, which cover the loss through the "
                    "predictions. Penalise the weights with a kernel_regularizer or "
                    "add_loss(lambda: ...) (added outside the bounded sum)."
                )

    def class_labels_in_range(self, y, y_pred):
        """``(rows,)`` booleans: the row's label is not a class index out of range
        (:func:`lipdp.core.records.labels_in_range`, with the loss's ``ignore_class``)."""
        return labels_in_range(y, y_pred, self._ignored_class())

    def _ignored_class(self):
        """The ``ignore_class`` of a Keras sparse cross-entropy (its entries have loss 0
        by the loss itself: not out of range), or ``None``."""
        loss = keras.losses.get(self.loss)
        config = loss.get_config() if isinstance(loss, keras.losses.Loss) else {}
        return config.get("ignore_class")

    def input_ids_in_range(self, x):
        """``(rows,)`` booleans: every token id of the row's input is in the range of the
        layer reading it (:func:`lipdp.core.records.read_ids`, e.g. ``[0, input_dim)``
        for an ``Embedding`` fed by the input); ``None`` when no input is read as ids."""
        usable = [ids_in_range(ids, r.size) for ids, r in read_ids(self.dp_layers, x)]
        return tf.reduce_all(tf.stack(usable), axis=0) if usable else None

    def _count_neutralised(self, finite, labelled, ids=None) -> dict:
        """Rule S9's counts for the training logs, each neutralised row counted once:
        ``non_finite_examples`` (a NaN or an infinity in the input or the label),
        ``invalid_inputs`` (finite rows with a token id out of range; only for a model
        whose input is read as ids, ``ids`` not ``None``) and ``invalid_labels`` (the
        other rows whose class label is out of range). Inputs and labels apart: the
        owner of the data knows which to repair."""
        self._non_finite.update_state(tf.reduce_sum(tf.cast(~finite, tf.float32)))
        counts = {"non_finite_examples": self._non_finite.result()}
        inputs_usable = finite
        if ids is not None:
            self._invalid_inputs.update_state(tf.reduce_sum(tf.cast(finite & ~ids, tf.float32)))
            counts["invalid_inputs"] = self._invalid_inputs.result()
            inputs_usable = finite & ids
        invalid = tf.reduce_sum(tf.cast(inputs_usable & ~labelled, tf.float32))
        self._invalid_labels.update_state(invalid)
        return {**counts, "invalid_labels": self._invalid_labels.result()}

    def adversarial_examples(self, x, y):
        """Each row's adversarial version by the model's :class:`~lipdp.core.adversarial.PGD`
        (ascending its own loss at the current weights, inference mode)."""
        if self.adversarial is None:
            raise ValueError("The model has no adversarial=PGD(...) option.")

        def predict(inputs):  # isolated under row_isolation: the attack of row i sees row i
            if self.row_isolation:
                return self.forward(inputs, training=False, isolate=True)
            return self(inputs, training=False)

        if self.adversarial.trades_beta is not None:  # TRADES: ascend KL(p(x) || p(x'))
            clean = tf.stop_gradient(predict(x))

            def row_losses(inputs):
                return softmax_kl(clean, predict(inputs))

        else:

            def row_losses(inputs):
                return self.per_example_losses(y, predict(inputs))

        return self.adversarial.perturb(row_losses, x)

    # ------------------------------------------------------------- the step
    @compat.step_without_autograph
    def train_step(self, data):
        """One private step, for both families (the families differ only in their hooks):

        1. the batch, checked (:meth:`_checked_batch`: sample weights, batch size, rules
           S2 and S5 when traced);
        2. rule S9: the rows with a NaN or an infinity and those holding a token id out of
           range are found and neutralised (:meth:`_neutralised_batch`);
        3. the averaged gradient ``sum_i C_i g_i / n`` of the family (hook
           :meth:`_private_gradients`), whose sensitivities :meth:`sensitivities` states;
        4. :meth:`release_step`: the noise of the one noise rule (:meth:`noisify`), the sum
           over replicas, the weight penalties (after the noise), the optimizer, then once
           per step the step count, the ledger row and :meth:`project`; and the family's
           :meth:`_after_release`;
        5. the training logs (loss, metrics, the rows neutralised by S9) -- statistics of
           the private data for its owner, not part of the release.
        """
        self._refuse_unsupported_step()
        x, y, _ = self._checked_batch(data)
        x, y, finite, ids = self._neutralised_batch(x, y)
        step = self._accumulated_gradients(x, y, kept_rows(finite, ids))
        labelled = self.class_labels_in_range(y, step.predictions)
        # A replica holding the very rows of another (a batch given whole to every replica
        # by a custom loop) adds nothing: each record counts once (rule S12).
        gradients = distribute.weighted(step.gradients, distribute.duplicate_part_weight((x, y)))
        released = self.release_step(gradients, self.trainable_variables)
        self._after_release(released)
        # A label out of range would make a sparse loss or metric fail: logged as class 0.
        y_logged = zero_rows(labelled, y)
        loss_inputs = x if step.loss_inputs is None else step.loss_inputs
        self._track_loss(loss_inputs, y_logged, step.predictions)
        logs = self.compute_metrics(x, y_logged, step.predictions, None)
        logs = {**logs, **self._count_neutralised(finite, labelled, ids)}
        logs = distribute.logs_across_replicas(logs, self._metric_results)
        return distribute.reducible_logs(logs)

    def _metric_results(self) -> dict:
        """``{name: result}`` of every metric the step logs: Keras' (loss, compiled metrics)
        and rule S9's counts."""
        counters = (self._non_finite, self._invalid_inputs, self._invalid_labels)
        return {**self.get_metrics_result(), **{m.name: m.result() for m in counters}}

    def _track_loss(self, x, y, y_pred) -> None:
        """The loss of the logs (Keras' loss tracker), from the step's predictions: Keras 2's
        ``compute_loss`` updates the tracker itself, Keras 3's returns the loss (divided by
        the replicas under a strategy: :func:`lipdp.foundation.compat.replica_loss`)."""
        loss = self.compute_loss(x, y, y_pred)
        if compat.keras_3():
            rows = tf.shape(tf.nest.flatten(x)[0])[0]
            self._loss_tracker.update_state(compat.replica_loss(loss), sample_weight=rows)

    def _refuse_unsupported_step(self) -> None:
        """Refuse, when the step is traced and before anything else runs, a step the
        family cannot take in this context (hook; none by default)."""

    def _neutralised_batch(self, x, y):
        """``(x, y, finite, ids)``: rule S9 for a batch. ``finite``: the rows without a NaN
        or an infinity (in any input, or the label); ``ids``: the rows whose token ids are
        in the range of the layer reading them (``None`` when no input is read as ids,
        :meth:`input_ids_in_range`, read on the record as given); the other rows made
        harmless by :meth:`_neutralised_rows`. Rows whose class label is out of range need
        the predictions: their loss is 0 (:meth:`per_example_losses`)."""
        finite = finite_rows(y)
        for inputs in tf.nest.flatten(x):  # every input of a model of several inputs
            finite &= finite_rows(inputs)
        ids = self.input_ids_in_range(x)
        x, y = self._neutralised_rows(x, y, kept_rows(finite, ids))
        return x, y, finite, ids

    def _neutralised_rows(self, x, y, usable):
        """``(x, y)`` with the rows not ``usable`` zeroed -- finite, and id 0, in every
        range -- so that the step runs on them; the family gives them no contribution
        (hook; by default the inputs and the floating labels are zeroed)."""
        x = tf.nest.map_structure(lambda t: zero_rows(usable, t), x)
        y = zero_rows(usable, y) if y.dtype.is_floating else y
        return x, y

    def _private_gradients(self, x, y, kept) -> StepGradients:
        """The family's averaged gradient of a batch already neutralised (S9; ``kept``: the
        rows not neutralised for their input), aligned with ``trainable_variables``: the
        local part ``sum_{i local} C_i g_i / n`` (``n`` the global loss normaliser) of the
        released sum, each term within the sensitivities of :meth:`sensitivities`
        (family hook)."""
        raise NotImplementedError

    def _accumulated_gradients(self, x, y, kept) -> StepGradients:
        """:meth:`_private_gradients` of the batch, computed at most
        :attr:`physical_batch_size` rows at a time: the micro-batches' gradients summed
        (each is its rows' part ``sum_{i in chunk} C_i g_i / n`` of the logical batch's
        sum, ``n`` the global normaliser, so the sum is that of the whole batch), their
        predictions and loss inputs concatenated in order. A ``tf.while_loop`` with one
        iteration at a time: only one micro-batch's activations live at once. The first
        micro-batch is computed before the loop, which gives the structure of the
        predictions (an empty batch is a first micro-batch of no rows)."""
        size = self.physical_batch_size
        if size is None:
            return self._private_gradients(x, y, kept)

        def rows_of(t, start):
            # A slice at a tensor offset loses the static shape of every axis; the ghost
            # rules choose their method by it (e.g. a convolution's positions): restored.
            part = t[start : start + size]
            part.set_shape(tf.TensorShape([None]).concatenate(t.shape[1:]))
            return part

        def chunk(index):
            start = index * size
            part = tf.nest.map_structure(lambda t: rows_of(t, start), (x, y, kept))
            return self._private_gradients(*part)

        def collected(step):
            # The predictions, and the loss inputs when the family has its own (adversarial
            # examples; ``None``: the step's inputs, not gathered again).
            return (step.predictions, () if step.loss_inputs is None else step.loss_inputs)

        first = chunk(0)
        outputs = collected(first)
        arrays = tf.nest.map_structure(
            lambda t: tf.TensorArray(
                t.dtype,
                size=0,
                dynamic_size=True,
                infer_shape=False,
                element_shape=tf.TensorShape([None]).concatenate(t.shape[1:]),
            ),
            outputs,
        )
        arrays = tf.nest.map_structure(lambda a, t: a.write(0, t), arrays, outputs)
        chunks = (tf.shape(kept)[0] + size - 1) // size

        def body(index, sums, arrays):
            step = chunk(index)
            sums = [s + g for s, g in zip(sums, step.gradients)]
            arrays = tf.nest.map_structure(lambda a, t: a.write(index, t), arrays, collected(step))
            return index + 1, sums, arrays

        _, sums, arrays = tf.while_loop(
            lambda index, *_: index < chunks,
            body,
            (tf.constant(1), list(first.gradients), arrays),
            parallel_iterations=1,  # one micro-batch at a time: the memory of P rows
        )
        predictions, loss_inputs = tf.nest.map_structure(lambda a: a.concat(), arrays)
        loss_inputs = None if first.loss_inputs is None else loss_inputs
        return StepGradients(sums, predictions, loss_inputs)

    def _after_release(self, released) -> None:
        """Called with the released gradients after the update, on every replica (hook;
        nothing by default). The once-per-step hook, in cross-replica context, is
        :meth:`project`."""

    def noisify(self, gradients, variables):
        """Add the calibrated Gaussian noise to ``gradients`` (aligned with ``variables``)."""
        entries = self.sensitivities()
        stddevs = self.noise_stddevs(entries)
        if self.debug:
            for entry, delta in entries:
                logger.info("%s: sensitivity %.6g", entry.key, float(delta))
            for v in variables:
                logger.info("variable %s: noise std %.6g", v.name, float(stddevs[variable_key(v)]))
        if self._noiseless:  # no draw at all (a draw of standard deviation 0 would add 0)
            return list(gradients)
        return noise.add_noise(gradients, [stddevs[variable_key(v)] for v in variables])

    def release_step(self, gradients, variables):
        """The end of every family's training step, from the local gradients of the loss
        ``sum_i loss_i / n`` (``n``: the global loss normaliser): noise drawn once per
        global step, the sum over replicas, the update, then -- once, in cross-replica
        context -- the step count and the projections (:mod:`lipdp.core.distribute`). Returns
        the released gradients (identical on every replica), with the gradients of the
        weight penalties added (:meth:`penalty_gradients`)."""
        noisy = self.noisify(gradients, variables)  # the noise on one replica only
        penalty = self.penalty_gradients(variables)
        released = distribute.release(self.optimizer, noisy, penalty, variables)
        distribute.once_per_step(self._count_and_project)
        return released

    def _count_and_project(self):
        # The step records the mechanism it was traced with (the noise above was drawn
        # from the same configuration): what ran is what the ledger holds.
        self.noisy_steps.assign_add(1)
        self.privacy_ledger.record(self._step_row())
        search = self.dp_parameters.hyperparameter_search
        if search is not None:  # its cost stays with what ran under it
            self.privacy_ledger.record(ledger.search_row(search))
        self.project()

    def make_train_function(self, force=False):
        # A cached step keeps the noise, batch size and trainable variables it was traced
        # with: traced again when any of them changed (frozen layers take effect, and the
        # ledger records the mechanism that now runs).
        self._refuse_nothing_trainable()
        self._check_lineage(new_step=self.train_function is None or force)
        distribute.check_steps_per_execution(self.distribute_strategy, self.steps_per_execution)
        configuration = self._step_configuration()
        if configuration != getattr(self, "_traced_configuration", None):
            force = True
        object.__setattr__(self, "_traced_configuration", configuration)
        # The noise generator is created here, eagerly and in the strategy's scope, on
        # every worker in the same order -- not lazily while one replica is traced.
        with self.distribute_strategy.scope():
            noise.noise_generator()
        result = super().make_train_function(force)
        # Keras 3 hands every replica the whole batch outside fit (train_on_batch, a train
        # function called on arrays): each replica gets its own rows instead (rule S12).
        self.train_function = distribute.parts_between_replicas(
            self.train_function, self.distribute_strategy
        )
        return result

    def _checked_batch(self, data):
        """``(x, y, batch_rows)`` of a training batch, refusing what changes the
        sensitivity. Python: runs when the step is traced, so every path (fit,
        train_on_batch, custom loops) is checked at no per-step cost."""
        _refuse_mixed_precision(self._all_layers())
        check_reduction(self.loss)  # also a reduction set on the loss after compile
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # Keras 3 hands a run_eagerly step (train_on_batch, debug=True) the arrays as given;
        # the step reads tensors' dtypes and shapes (Keras 2 converts them first).
        x, y = tf.nest.map_structure(_as_tensor, (x, y))
        if sample_weight is not None:
            raise ValueError("sample weights are not supported: they change the sensitivity.")
        self._check_batch_independence(x, y)
        batch_rows = tf.shape(tf.nest.flatten(x)[0])[0]
        self._check_batch_rows(batch_rows)
        return x, y, batch_rows

    def _check_batch_independence(self, x, y) -> None:
        """Rule S2 when the step is traced: the structural walk (layers may have been
        unfrozen since compile), then, once per input spec, the numerical probe
        (:mod:`lipdp.core.batch_independence`) unless ``independence_probe=False`` or
        ``row_isolation=True``: an isolated step computes every row's loss from that row
        alone and refuses state kept between rows (:mod:`lipdp.core.isolation`), which is
        what the probe would test at a few points."""
        batch_independence.refuse_coupling_layers(self.dp_layers)
        if self.independence_probe and not self.row_isolation:
            batch_independence.probe_when_traced(self, x, y)

    def _check_batch_rows(self, batch_rows) -> None:
        """Fixed-size batches must have the rows the sensitivity is computed for (S5)."""
        if self.poisson_sampling:
            return
        # With augmentation multiplicity m a batch holds b originals x m copies; the
        # loss is their mean, so one original moves it by at most G / b still. Under a
        # strategy each of the R replicas holds its share of the global batch.
        rows = self.dataset_metadata.rows_per_batch
        replicas = distribute.replicas_in_sync()
        distribute.check_replica_batches(rows)
        share = f" ({rows // replicas} on each of {replicas} replicas)" if replicas > 1 else ""
        tf.debugging.assert_equal(
            batch_rows,
            rows // replicas,
            message=(
                f"DP training needs every batch to have exactly {rows} rows{share} "
                f"(batch_size={self.batch_size} x multiplicity; the sensitivity is computed "
                "for it); drop the partial last batch (dataset.batch(b, drop_remainder=True))."
            ),
        )

    def reset_metrics(self):
        super().reset_metrics()
        self._non_finite.reset_state()
        self._invalid_inputs.reset_state()
        self._invalid_labels.reset_state()

    def refuse_data_dependent_losses(self):
        """Refuse a loss added from the data in a forward pass (``add_loss`` of a tensor in
        a layer's call, an activity regulariser): the sensitivity bounds cover the
        per-example losses only. Call after a forward pass (trace time)."""
        inner = self._flatten_layers(include_self=False, recursive=False)
        for path, layer in [(self.name, self), *nested_layers(inner)]:
            if _losses_from_a_call(layer):
                raise ValueError(
                    f"Layer {path!r} adds a loss computed in its call (add_loss of a "
                    "tensor or an activity regulariser), outside the per-example losses the "
                    "sensitivity covers: remove it, or penalise the weights only "
                    "(kernel_regularizer, or add_loss(lambda: ...) on Keras 2)."
                )

    def penalty_gradients(self, variables):
        """Gradients w.r.t. ``variables`` of the penalties of the weights alone (Keras
        weight regularisers, ``add_loss`` of a zero-argument callable), or ``None``.

        :meth:`release_step` adds them to the released (noisy) gradient, outside the
        clipped or bounded sum: a function of the current weights, which are public
        (every earlier update was released), so adding it is post-processing and the
        sensitivity does not change. (Inside the sum a Poisson step would scale it by the
        random batch size over ``b``: a dependence on the data.) A callable loss must
        read weights only, as Keras' regularisers do; losses computed from the data are
        refused (:meth:`refuse_data_dependent_losses`)."""
        with tf.GradientTape() as tape:
            values = [value for value in self._weight_penalties() if value is not None]
            if not values:
                return None
            total = tf.add_n([tf.cast(value, tf.float32) for value in values])
        # The watched tf.Variables: "zero" for a variable no penalty reads needs a
        # tf.Variable's dtype (a Keras 3 variable's is a string).
        sources = [compat.tape_variable(v) for v in variables]
        grads = tape.gradient(total, sources, unconnected_gradients="zero")
        return [tf.convert_to_tensor(grad) for grad in grads]

    def _weight_penalties(self) -> list:
        """The penalties of the weights alone, computed now (under the caller's tape).

        Keras 2: the zero-argument callables of ``add_loss`` (weight regularisers are
        such callables). Keras 3 (``add_loss`` takes tensors only): each trainable
        variable's ``regularizer`` -- at the model's level, since a layer's
        ``trainable_weights`` holds its sublayers' too."""
        if compat.keras_3():
            return self._get_regularization_losses()  # noqa: SLF001
        return [fn() for layer in self._flatten_layers() for fn in layer._callable_losses]  # noqa: SLF001

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        """Keras' ``fit``, privately. Under Poisson sampling, arrays (``fit(x, y,
        batch_size=b, epochs=E)``, ``batch_size`` omitted or the declared ``b``) are
        Poisson-sampled here, fresh every epoch, from the operating system's entropy
        (:meth:`~lipdp.core.private_base.PrivateModelBase._poisson_fit_data`): ``shuffle``
        does not apply, ``validation_split`` holds out Keras' last rows exactly (the
        training part must be the declared ``N``), ``validation_data`` works and the steps
        per epoch are the metadata's. ``tf.data`` pipelines must be lipdp's Poisson
        batches (:func:`lipdp.private_batches`, ``lipdp.pipeline.poisson_batches``); a
        pipeline whose sampling lipdp cannot know is refused. Fixed-size sampling
        (``"shuffle"``): Keras batches the arrays, ``N`` a multiple of ``b``."""
        kwargs = named_fit_arguments(args, kwargs)
        self._check_fit_arguments(x, y, batch_size, kwargs)
        x, y, batch_size = self._poisson_fit_data(x, y, batch_size, kwargs)
        if getattr(x, "lipdp_partitioned", False):
            # An endless (distributed) stream of batches: its steps per epoch are stated.
            kwargs.setdefault("steps_per_epoch", x.lipdp_steps_per_epoch)
        if compat.keras_3() and isinstance(x, tf.data.Dataset):
            # Batches drawn by the pipeline (Poisson, or shuffled there): Keras 3 would warn
            # at every fit that its default shuffle=True does not apply to a dataset.
            kwargs.setdefault("shuffle", False)
        self._prepare_weights_for_training()
        return super().fit(x, y, batch_size, **kwargs)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras 3 only (Keras 2 has no such method): Keras' build at the start of ``fit``
        and ``evaluate`` under a strategy, on the spec of one replica's batches instead of a
        batch drawn and averaged over the replicas, which fails on parts of unequal row
        counts and wastes a Poisson draw (:func:`lipdp.foundation.compat.first_replica_spec`)."""
        dataset = getattr(iterator, "_distributed_dataset", None)  # Keras' TFEpochIterator
        if dataset is not None and self._distribute_strategy is not None:
            iterator, data_batch = None, compat.first_replica_spec(dataset)
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def train_on_batch(self, *args, **kwargs):
        """One DP step; weights set by hand are projected first, as in ``fit`` (S12)."""
        self._refuse_changed_trainable_state()
        if self._xla_fixed_size_step():  # the in-graph check of the rows is dropped by XLA
            x = args[0] if args else kwargs.get("x")
            rows = len(tf.nest.flatten(x)[0])
            expected = self.dataset_metadata.rows_per_batch // distribute.replicas_in_sync()
            if rows != expected:
                raise ValueError(
                    f"DP training needs every batch to have exactly {expected} rows (the "
                    f"declared batch size; the sensitivity is computed for it), got {rows}."
                )
        self._prepare_weights_for_training()
        return super().train_on_batch(*args, **kwargs)

    def _xla_fixed_size_step(self) -> bool:
        """A step compiled by XLA (``compile(jit_compile=True)``) on fixed-size batches:
        XLA drops ``tf.debugging`` assertions, so the rows of a batch (rule S5) are checked
        on the host instead (:meth:`train_on_batch`, :meth:`_checked_data_source`)."""
        return getattr(self, "jit_compile", False) is True and not self.poisson_sampling

    def _refuse_invalid_labels(self, x, y) -> None:
        """Rule S9 for arrays: refuse class-index labels out of range (:func:`lipdp.core.records.
        labels_in_range`, ``K`` the model's outputs), naming their rows. (Pipelines are
        neutralised in-graph instead: such rows count zero.)"""
        labels = tf.nest.flatten(y)
        if len(labels) != 1 or labels[0] is None:
            return
        labels = tf.convert_to_tensor(labels[0])
        input_shape = tf.nest.map_structure(lambda a: (None,) + np.shape(a)[1:], x)
        output_shape = tf.TensorShape(self.compute_output_shape(input_shape))
        classes = output_shape[-1] or self._metadata_for("training").nb_classes
        # Only the rank and the last dimension of the predictions matter.
        predictions = tf.zeros([1] * (output_shape.rank - 1) + [classes])
        usable = labels_in_range(labels, predictions, self._ignored_class()).numpy()
        bad = np.flatnonzero(~usable)
        if bad.size:
            raise ValueError(
                f"y has {bad.size} example(s) whose class label is not a whole number in "
                f"[0, {classes}) (rows {_shown(bad)}): the model has {classes} outputs. "
                "Remove or repair these rows before fit."
            )

    def _refuse_changed_trainable_state(self) -> None:
        """Keras 2's ``fit`` and ``train_on_batch`` train the layers that were trainable at
        the last ``compile`` (``RespectCompiledTrainableState``), while the privacy plan and
        the noise multipliers read the current flags: refuse until they agree (S11)."""
        compiled = getattr(self, "_compiled_trainable_state", None)
        if compiled is None or compat.keras_3():  # Keras 3 trains the current flags
            return
        # Layers created since compile (a nested Sequential builds its InputLayer on the
        # first call) keep their own flags in Keras too: compare the layers of both.
        current = self._get_trainable_state()  # noqa: SLF001
        if any(current[layer] != flag for layer, flag in compiled.items() if layer in current):
            raise ValueError(
                "Layers were frozen or unfrozen after compile(): Keras would train the "
                "layers of the last compile while the privacy plan prices the current ones. "
                "Call compile() again."
            )

    def _refuse_invalid_inputs(self, x) -> None:
        """Rule S9 for arrays: refuse token ids out of the range of the layer reading them
        (:func:`lipdp.core.records.read_ids`), naming their rows. (Pipelines are
        neutralised in-graph instead: such rows count zero.)"""
        for array, ids in read_ids(self.dp_layers, x):
            bad = np.flatnonzero(~ids_in_range(np.asarray(array), ids.size).numpy())
            if bad.size:
                raise ValueError(
                    f"x has {bad.size} example(s) with a token id that is not a whole number "
                    f"in [0, {ids.size}) (rows {_shown(bad)}): layer {ids.reader!r} reads ids "
                    "in that range. Remove or repair these rows before fit."
                )

    # ------------------------------------------- the backend's hooks of fit's guards
    def _check_distributed_data(self, x) -> None:
        _check_distributed_data(x, self.distribute_strategy)

    def _poisson_batches_facts(self, x):
        """A ``tf.data`` pipeline's stated rate and steps (``lipdp.pipeline``), or ``None``
        for other data."""
        if not isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset)):
            return None
        return _stated_poisson_facts(x)

    def _check_poisson_batch_sizes(self, x) -> None:
        _refuse_fixed_size_batches(x, self.dataset_metadata)

    def _poisson_batches(self, x, y, metadata, seed):
        """:func:`lipdp.data.sampling.poisson_batches` (a ``tf.data.Dataset``)."""
        from lipdp.data.sampling import poisson_batches

        rate, steps = metadata.sampling_rate, metadata.nb_steps_per_epochs
        return poisson_batches(x, y, rate, steps, seed)

    def _checked_data_source(self, x) -> bool:
        """A ``tf.data`` pipeline of fixed-size batches yields the rows of a batch."""
        if not isinstance(x, tf.data.Dataset):
            return False
        metadata = self.dataset_metadata
        static = tf.nest.flatten(x.element_spec)[0].shape[0]
        if static is not None and static != metadata.rows_per_batch:
            raise ValueError(
                f"The dataset yields batches of {static}, the model expects "
                f"{metadata.rows_per_batch} (batch_size={metadata.batch_size} x "
                "multiplicity, dataset_metadata)."
            )
        if static is None and self._xla_fixed_size_step():
            raise ValueError(
                "With jit_compile=True the batch size is not checked in the step (XLA drops "
                "the assertion): batch the dataset with drop_remainder=True, so that every "
                f"batch has the declared {metadata.rows_per_batch} rows."
            )
        return True

    def _refuse_invalid_rows(self, x, y) -> None:
        self._refuse_invalid_inputs(x)
        self._refuse_invalid_labels(x, y)

    # ---------------------------------------------------------- serialisation
    def _model_config(self) -> dict:
        adversarial = self.adversarial
        return self._layers_config(None if adversarial is None else adversarial.to_config())

    @classmethod
    def _network_from_config(cls, config, custom_objects):
        return cls._layers_from_config(config, custom_objects)


def _symbolic(input_shape):
    """Keras 3 symbolic inputs of ``input_shape`` (a shape, or a nest of shapes)."""
    return keras.tree.map_shape_structure(
        lambda shape: keras.KerasTensor(tuple(shape)), input_shape
    )


def _real_tensors(nest) -> bool:
    """Whether every leaf of ``nest`` is a TensorFlow tensor (not a Keras 3 symbolic
    ``KerasTensor``, whose layers are built rather than run)."""
    return all(tf.is_tensor(t) for t in tf.nest.flatten(nest))


def _loss_name(loss) -> str:
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__


def _as_tensor(value):
    """``value`` as a tensor, unless it is one already (ragged, sparse) or ``None``."""
    return value if value is None or tf.is_tensor(value) else tf.convert_to_tensor(value)


def _losses_from_a_call(layer) -> bool:
    """Whether ``layer`` holds losses computed in its last call (``add_loss`` of a tensor,
    an activity regulariser). Keras 2 keeps those in ``_eager_losses`` (inside tf.function
    too) and symbolic ones in ``_losses`` (its callables elsewhere); Keras 3 in ``_losses``
    (weight regularisers are not losses there until ``losses`` is read)."""
    if compat.keras_3():
        return bool(layer._losses)  # noqa: SLF001
    return bool(layer._eager_losses or layer._losses)  # noqa: SLF001


def _one_target_per_output(labels, predictions):
    """:func:`lipdp.core.private_base.one_target_per_output` for dense tensors (ragged and
    sparse labels or predictions are left as they are)."""
    if not isinstance(labels, tf.Tensor) or not isinstance(predictions, tf.Tensor):
        return labels
    return one_target_per_output(labels, predictions)


def _check_poisson_pipeline(dataset, metadata) -> None:
    """A Poisson pipeline that states its rate must draw at the metadata's rate
    (:func:`lipdp.core.private_base.check_poisson_batches`)."""
    check_poisson_batches(*_stated_poisson_facts(dataset), metadata)


def _stated_poisson_facts(dataset) -> tuple:
    """``(sampling rate, steps per epoch)`` a pipeline of ``lipdp.pipeline`` states
    (``None`` for what it does not state)."""
    return (
        getattr(dataset, "lipdp_sampling_rate", None),
        getattr(dataset, "lipdp_steps_per_epoch", None),
    )


def _refuse_fixed_size_batches(dataset, metadata) -> None:
    """A dataset whose batches all have one static size is not Poisson-sampled (Poisson
    batches have a random size): accounting it at rate b/N would be wrong. The one
    exception is rate 1, where the Poisson sample is the whole data set, N rows."""
    if not isinstance(dataset, tf.data.Dataset):
        return
    rows = tf.nest.flatten(dataset.element_spec)[0].shape
    whole_set = metadata.sampling_rate >= 1.0 and rows.rank and rows[0] == metadata.nb_samples_train
    if rows.rank and rows[0] is not None and not whole_set:
        raise ValueError(
            f"dataset_metadata.sampling='poisson' but every batch of the dataset has "
            f"{rows[0]} rows: fixed-size batches are not Poisson samples. Pass "
            "lipdp.pipeline.poisson_batches(x, y, sampling_rate, steps_per_epoch), or "
            "declare sampling='shuffle'."
        )


def _check_distributed_data(x, strategy) -> None:
    """Several workers each read their own pipeline: only a pipeline that partitions the
    records between the replicas keeps every record on at most one replica per step
    (:mod:`lipdp.core.distribute`)."""
    if distribute.worker_count(strategy) == 1:
        return
    if getattr(x, "lipdp_partitioned", False):
        return
    raise ValueError(
        "Training on several workers needs batches that never hold the same record on two "
        "workers: pass lipdp.pipeline.distributed_poisson_batches(strategy, x, y, "
        "sampling_rate, steps_per_epoch) with DatasetMetadata(sampling='poisson')."
    )


__all__ = ["DPParameters", "PrivateModel", "StepGradients", "check_reduction"]
