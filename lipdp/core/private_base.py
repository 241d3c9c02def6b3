r"""The privacy surface of a private model, written once for every backend.

:class:`PrivateModelBase` is a mixin of the Keras model classes that train privately --
:class:`lipdp.core.private_model.PrivateModel` (TensorFlow, Keras 2 and 3: both families)
and :class:`lipdp.clipped.jax.model.DPSGD_JaxModel` (Keras 3's JAX backend) -- in the way
Keras 3 itself writes one backend-neutral ``Trainer`` (``keras/src/trainers/trainer.py``)
and one thin trainer per backend. It holds, once, every fact of the privacy surface that
does not depend on how a step is compiled:

* ``sigma`` (0 for a non-private reference run), the accountant's noise multipliers and
  the noise standard deviations, all by the one noise rule of :mod:`lipdp.core.noise`;
* the privacy plan (rule S11), the privacy ledger's view and the ledger row of one step
  (rule S10), the metadata a purpose needs;
* the guards of ``compile``, ``fit``, ``save``, ``set_weights`` and ``load_weights``: a
  loss that is the mean over the batch, no loss weights, float32 only, one sampling rate
  for the batches and the accountant (rules S5, S7, S9), the privacy state never rewound
  (rule S10), ``.keras`` files only;
* the configuration of the privacy parameters in ``get_config``/``from_config`` and the
  replay of ``compile`` on load.

A backend model keeps what truly differs (its hooks below): the compiled step and how it
draws its noise; how its ledger variables are stored (``float64`` on TensorFlow, the
float64 words in ``int32`` variables on JAX, :mod:`lipdp.core.jax.ledger`:
:meth:`_ledger_view`); where the noise standard deviation is evaluated
(:attr:`_noise_on_host`: in the TensorFlow graph in float32, on the host in float64 for
JAX's compiled constants); which data sources it takes (``tf.data`` pipelines, padded
Poisson batches: :meth:`_checked_data_source`, :meth:`_poisson_batches_facts`).

Everything here runs on the host, in Python and numpy: it imports neither TensorFlow nor
JAX, and nothing Keras-3-only (Keras 2's differences are in :mod:`lipdp.foundation.compat`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math

import keras
import numpy as np

from lipdp.accounting.mechanisms import effective_noise_multiplier
from lipdp.accounting.plan import PrivacyPlan
from lipdp.core import ledger, noise
from lipdp.core.ledger import PrivacyLedger, step_row
from lipdp.core.parameters import DPParameters
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import nested_layers
from lipdp.foundation.metadata import DatasetMetadata

logger = logging.getLogger(__name__)


class PrivateModelBase:
    """What every private Keras model holds, whatever its backend (module docstring).

    A mixin placed before ``keras.Model`` (``class M(PrivateModelBase, keras.Model)``): its
    ``save``, ``set_weights``, ``load_weights`` and configuration methods wrap Keras'.
    The model sets ``dp_parameters``, ``dataset_metadata`` (by
    :meth:`_set_privacy_configuration`), ``noisy_steps`` and the two ledger variables
    ``privacy_ledger_table`` and ``privacy_ledger_counts``, and implements the hooks
    :meth:`sensitivities`, :meth:`_noise_coefficients` and :meth:`_all_layers`.
    """

    #: Where :func:`lipdp.core.noise.noise_stddevs` evaluates the standard deviations:
    #: ``False``, float32 tensors (TensorFlow: in the graph, where a sensitivity may be a
    #: tensor); ``True``, float64 Python floats (JAX: constants of the compiled step).
    _noise_on_host = False
    #: What to pass for Poisson sampling, in the refusal of other data (backend hook).
    _poisson_batches_hint = "lipdp.pipeline.poisson_batches(x, y, sampling_rate, steps_per_epoch)"

    # ------------------------------------------------------------- configuration
    def _set_privacy_configuration(self, dp_parameters, dataset_metadata) -> None:
        """Check and set the privacy parameters and the dataset metadata."""
        if not isinstance(dp_parameters, DPParameters):
            raise TypeError(f"dp_parameters must be a DPParameters, got {type(dp_parameters)}.")
        if dataset_metadata is not None and not isinstance(dataset_metadata, DatasetMetadata):
            raise TypeError("dataset_metadata must be a lipdp.foundation.metadata.DatasetMetadata.")
        self.dp_parameters = dp_parameters
        self.dataset_metadata = dataset_metadata

    # ------------------------------------------------------- physical batches
    @property
    def physical_batch_size(self) -> int | None:
        r"""At most how many rows one pass of the step computes at once (``None``: the
        whole batch). A logical batch (of random size under Poisson sampling, expected
        ``b``) is split into consecutive micro-batches of at most ``P`` rows; each
        micro-batch's part of the averaged gradient,
        ``sum_{i in chunk} C_i g_i / n`` (clipped DP-SGD) or the gradient of
        ``sum_{i in chunk} loss_i / n`` (clipless), is summed over the micro-batches,
        and the sum -- the very sum ``sum_i C_i g_i / n`` of the logical batch, in
        another order of additions -- is noised once, applied once by the optimizer and
        billed once in the ledger, at the sampling rate ``b/N`` of the plan. The
        sensitivity, the noise and epsilon are those of the logical batch: ``P`` only
        bounds the memory of the step (the activations and per-example quantities of
        ``P`` rows) and changes no privacy fact. Under ``tf.distribute`` each replica
        splits its own rows. Settable after construction (the next ``fit`` traces a new
        step)."""
        return self._physical_batch_size

    @physical_batch_size.setter
    def physical_batch_size(self, value):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(
                    f"physical_batch_size must be a positive integer or None, got {value!r}."
                )
            value = int(value)
        object.__setattr__(self, "_physical_batch_size", value)
        object.__setattr__(self, "train_function", None)  # a step traced for another P

    def _refuse_gradient_accumulation(self, optimizer) -> None:
        """Refuse Keras' ``gradient_accumulation_steps``: the optimizer would average
        ``k`` gradients noised one by one -- ``sqrt(k)`` times the noise of one logical
        batch of ``k b`` rows, and ``k`` steps billed at rate ``b/N`` -- silently wasting
        the budget. ``physical_batch_size`` noises the logical batch once."""
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        if steps is not None and steps > 1:
            raise ValueError(
                f"The optimizer's gradient_accumulation_steps={steps} would noise each "
                "micro-batch on its own (sqrt(k) times the noise, k steps billed): declare "
                "the logical batch size in dataset_metadata and pass "
                "physical_batch_size=P to the model (or make_private) instead."
            )

    @property
    def batch_size(self) -> int:
        """``b``: the sensitivities of the averaged gradient are ``bound / b``."""
        return int(self._metadata_for("training").batch_size)

    @property
    def poisson_sampling(self) -> bool:
        return self.dataset_metadata is not None and self.dataset_metadata.sampling == "poisson"

    def _metadata_for(self, purpose) -> DatasetMetadata:
        if self.dataset_metadata is None:
            raise ValueError(
                f"{type(self).__name__} needs dataset_metadata=DatasetMetadata(...) for "
                f"{purpose}: the sensitivity depends on the batch size, the privacy "
                "accounting on the sampling rate b/N and the steps per epoch."
            )
        return self.dataset_metadata

    def _all_layers(self) -> list:
        """The layers whose compute dtype matters (backend hook; nested layers are
        walked by :func:`refuse_mixed_precision`)."""
        raise NotImplementedError

    def project(self):
        """Bring the weights back into their constraint sets (none by default)."""
        return None

    # --------------------------------------------------------------------- noise
    def sensitivities(self):
        """``[(entry, Delta)]``: sensitivity ``Delta`` of each Gaussian mechanism's part of
        the averaged gradient (family hook); ``entry.key`` names it, ``entry.bound`` is one
        example's bound, ``entry.nm_coef`` its noise coefficient ``c``."""
        raise NotImplementedError

    def _noise_coefficients(self) -> list[float]:
        """``c`` of every entry of :meth:`sensitivities`, in its order (family hook): what
        the accountant's multipliers are made of. A hook of its own because the plan is
        made before training, when the sensitivities (which need the compiled loss and the
        batch size) may not be computable yet."""
        raise NotImplementedError

    @property
    def _noiseless(self) -> bool:
        """A non-private reference run (``DPParameters(non_private=True)``), the one place
        the flag is read for the noise and the accounting: sigma is 0 (standard deviations
        and multipliers 0), no noise is drawn, the ledger records steps of sigma 0 and the
        plan has no mechanism (epsilon infinite after any step)."""
        return self.dp_parameters.non_private

    def _sigma(self) -> float:
        """The noise multiplier ``sigma`` of the steps (0 for a non-private reference)."""
        return 0.0 if self._noiseless else self.dp_parameters.noise_multiplier

    def noise_multipliers(self) -> list[float]:
        """Noise multipliers of the Gaussian mechanisms of one step, for the accountant:
        ``[sigma]`` (``"global"``) or ``[sigma * c]`` for every entry of
        :meth:`sensitivities` (``"per-layer"``), by :func:`lipdp.core.noise.noise_multipliers`."""
        strategy = self.dp_parameters.noisify_strategy
        return noise.noise_multipliers(strategy, self._sigma(), self._noise_coefficients())

    def _entry_stddevs(self, entries) -> list:
        """The standard deviation of the noise of each entry of :meth:`sensitivities`
        (``entries``), by :func:`lipdp.core.noise.noise_stddevs`: ``sigma sqrt(sum
        Delta^2)`` for every entry (``"global"``), ``sigma c Delta`` (``"per-layer"``)."""
        return noise.noise_stddevs(
            self.dp_parameters.noisify_strategy,
            self._sigma(),
            [delta for _, delta in entries],
            [entry.nm_coef for entry, _ in entries],
            on_host=self._noise_on_host,
        )

    # ------------------------------------------------------------------ privacy
    def privacy_plan(self) -> PrivacyPlan:
        """Every mechanism a training run of this model releases (rule S11): the noisy
        steps (noise multipliers of :meth:`noise_multipliers`, sampling rate and steps per
        epoch of the metadata) and the family's other releases (:meth:`_other_releases`)."""
        metadata = self._metadata_for("privacy accounting")
        params = self.dp_parameters
        noiseless = self._noiseless  # no mechanism: the multipliers are not read
        return PrivacyPlan.for_training(
            ledger=self.privacy_ledger,
            steps_done=int(self.noisy_steps.numpy()),
            noise_multipliers=1.0 if noiseless else self.noise_multipliers(),
            sampling_rate=metadata.sampling_rate,
            steps_per_epoch=metadata.nb_steps_per_epochs,
            delta=params.delta,
            other_releases=self._other_releases(metadata),
            non_private=noiseless,
            noise_multiplier=None if noiseless else self._sigma(),
            search=params.hyperparameter_search,
        )

    def _other_releases(self, metadata) -> tuple:
        """Releases besides the noisy steps (none by default)."""
        return ()

    @property
    def privacy_ledger(self) -> PrivacyLedger:
        """What this model has released so far (:mod:`lipdp.core.ledger`): its epsilon is the
        composition of these mechanisms, whatever its configuration is now."""
        return self._ledger_view(self.privacy_ledger_table, self.privacy_ledger_counts)

    @staticmethod
    def _ledger_view(table, counts) -> PrivacyLedger:
        """The :class:`~lipdp.core.ledger.PrivacyLedger` reading the ledger variables
        (backend hook: how they are stored)."""
        return PrivacyLedger(table, counts)

    @staticmethod
    def _new_ledger_variables() -> tuple:
        """The two variables of an empty ledger (backend hook: how they are stored)."""
        return PrivacyLedger.create_variables()

    # ------------------------------------------------------ layers in the config
    def _layers_config(self, adversarial=None) -> dict:
        """The configuration entries of a model of ``dp_layers`` (both backends write the
        same, so a file's configuration reads on either): the serialised layers and the
        model options."""
        return {
            self._layers_key: [keras.layers.serialize(layer) for layer in self.dp_layers],
            "adversarial": adversarial,
            "debug": self.debug,
            "independence_probe": self.independence_probe,
            "row_isolation": self.row_isolation,
        }

    @classmethod
    def _layers_from_config(cls, config, custom_objects) -> list:
        """The layers of :meth:`_layers_config` (removed from ``config``)."""
        return [
            keras.layers.deserialize(c, custom_objects=custom_objects)
            for c in config.pop(cls._layers_key)
        ]

    # ------------------------------------------------------- lineage (rule S10)
    # The ledger follows the weights: layers of another private model of this process
    # (trained here or loaded from its file) bring that model's ledger, wherever they are
    # reused. Written once for every backend; the TensorFlow and JAX trainers call these
    # at the same points (construction, build, every new step).
    def _lineage_layers(self) -> list:
        """The layers whose weights the ledger prices (hook: the model's layers)."""
        return list(self.dp_layers)

    def _lineage_ledger_variables(self) -> tuple:
        """The ledger variables of a new model (call before building it): those of the
        private model its layers belong to, shared (both models then record into them);
        for layers of several, new variables holding the composition of their ledgers
        (:func:`lipdp.core.ledger.inherited_ledger`); else new empty ones."""
        inherited = ledger.inherited_ledger(
            self._lineage_layers(), lambda: self._ledger_view(*self._new_ledger_variables())
        )
        if inherited is None:
            return self._new_ledger_variables()
        return self._ledger_variables_of(inherited)

    @staticmethod
    def _ledger_variables_of(view) -> tuple:
        """``(table, counts)`` variables behind a ledger view (inverse of :meth:`_ledger_view`)."""
        return view.storage, view.counts

    def _claim_layers(self) -> None:
        """Once the layers are built: add the spending of weights copied by hand
        (:meth:`_add_copied_spending`), then price the layers by this model's ledger
        wherever they are reused (:func:`lipdp.core.ledger.tag_layers`)."""
        self._add_copied_spending()
        ledger.tag_layers(self._lineage_layers(), self.privacy_ledger)

    def _check_lineage(self, new_step: bool) -> None:
        """Before a step is made: refuse to train layers that another private model, built
        on them after this one, now prices (its ledger holds this model's releases); on a
        new step (weights may have been copied since), add copied spending; claim the
        layers."""
        own = self.privacy_ledger
        others = {
            path: other
            for path, other in ledger.ledgers_of(self._lineage_layers()).items()
            if other.storage is not own.storage
        }
        if others:
            raise ValueError(
                f"Layer(s) {', '.join(map(repr, others))} belong to another private model "
                "built on them after this one (its ledger holds this model's releases and "
                "prices those weights): train that model, or build a new one from them."
            )
        if new_step:
            self._add_copied_spending()
        ledger.tag_layers(self._lineage_layers(), own)

    def _prepare_weights_for_training(self) -> None:
        """Before ``fit`` and ``train_on_batch``: weights set by hand bring their spending
        (:meth:`_add_copied_spending`, on the values as they were set: a projection would
        change them and hide the copy), then are brought back into their constraint sets
        before the first bound is trusted (rule S12)."""
        self._add_copied_spending()
        self.project()

    def _add_copied_spending(self) -> None:
        """Rule S10 for weights copied by hand (``layer.set_weights(private_layer.
        get_weights())``: numpy arrays, no ledger): when a layer of this model holds the
        trained weights of another private model of this process
        (:func:`lipdp.core.ledger.copied_ledgers`), this model's ledger is made to hold at
        least every release of that model's ledger, row by row
        (:meth:`~lipdp.core.ledger.PrivacyLedger.keep_at_least`): a fresh model starts
        from the source's spending; a model loaded from the source's file, which holds it
        already, adds nothing. Checked when the model is built, at every ``fit`` and when
        a training step is made. Limit (``docs/soundness.md``): a model that has itself
        run the very same mechanism at least as often before receiving the copy is not
        charged again."""
        copies = ledger.copied_ledgers(self._lineage_layers(), self.privacy_ledger)
        by_source = {}
        for path, source in copies.items():
            by_source.setdefault(id(source.storage), (source, []))[1].append(path)
        for source, paths in by_source.values():
            before = int(np.sum(self.privacy_ledger.counts.numpy()))
            self.privacy_ledger.keep_at_least(source.snapshot())
            added = int(np.sum(self.privacy_ledger.counts.numpy())) - before
            if added:
                logger.warning(
                    "Layer(s) %s hold weights copied from a model trained privately: %d of "
                    "its releases are added to this model's privacy ledger (rule S10). Copy "
                    "whole models (set_weights, load_weights, .keras files) to carry the "
                    "ledger with the weights.",
                    ", ".join(repr(p) for p in paths),
                    added,
                )

    def _step_row(self):
        """The ledger row of one step of the current configuration: the effective noise
        multiplier of its Gaussians (0 without noise), ``b``, ``N``, the sampling."""
        metadata = self._metadata_for("training")
        if self._noiseless:
            sigma, gaussians = 0.0, 1
        else:
            sigmas = self.noise_multipliers()
            sigma, gaussians = effective_noise_multiplier(sigmas), len(sigmas)
        return step_row(
            sigma,
            metadata.batch_size,
            metadata.nb_samples_train,
            metadata.sampling == "poisson",
            gaussians,
            reproducible=noise.reproducible_noise_seed() is not None,
        )

    # ------------------------------------------------------------------ compile
    def _check_loss(self, loss) -> None:
        """Refuse a loss whose per-example gradient the family cannot bound (hook)."""
        if loss is None:
            raise ValueError("compile(loss=...) is required.")
        check_reduction(loss)

    def _check_compile_arguments(self, loss, kwargs) -> None:
        """The guards of ``compile``: the loss (:meth:`_check_loss`), float32 only, no
        loss weights (they rescale the sensitivity)."""
        self._check_loss(loss)
        refuse_mixed_precision(self._all_layers())
        if kwargs.get("loss_weights") is not None:
            raise ValueError("loss_weights is not supported: it rescales the sensitivity.")

    def _compiled_with_loss(self) -> bool:
        if compat.keras_3():
            return bool(self.compiled) and self.loss is not None
        return self.compiled_loss is not None

    def _refuse_nothing_trainable(self) -> None:
        """A private step with no trainable variable would release nothing."""
        if self.built and not self.trainable_variables:
            raise ValueError(
                f"{type(self).__name__} has no trainable variables (every layer is frozen): "
                "a private step would release nothing. Unfreeze a layer (layer.trainable = "
                "True) and compile again."
            )

    # ---------------------------------------------------------------------- fit
    def _check_fit_arguments(self, x, y, batch_size, kwargs) -> None:
        """The guards of ``fit``, before any step: sample and class weights change the
        sensitivity; Poisson sampling needs Poisson batches drawn at the accountant's rate
        (:meth:`_poisson_batches_facts`) or arrays that ``fit`` samples itself
        (:meth:`_poisson_fit_data`); fixed-size batches need ``N`` a multiple of ``b``;
        arrays must hold the ``N`` declared (the sampling rate ``b/N``) and are checked
        row by row (rule S9: :func:`refuse_non_finite`, :meth:`_refuse_invalid_rows`).
        ``kwargs``: every argument of ``fit`` after ``batch_size``, by name
        (:func:`named_fit_arguments`)."""
        if not self._compiled_with_loss():
            raise RuntimeError("Call compile(loss=..., optimizer=...) before fit().")
        self._refuse_changed_trainable_state()
        self._refuse_gradient_accumulation(self.optimizer)
        metadata = self._metadata_for("training")
        b = metadata.batch_size
        for unsupported in ("sample_weight", "class_weight"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"{unsupported} is not supported: it changes the sensitivity.")
        self._check_distributed_data(x)
        if self.poisson_sampling:
            facts = self._poisson_batches_facts(x)
            if facts is None and _arrays(x):
                self._check_arrays(x, y, batch_size, kwargs)
                return
            if facts is None:
                raise ValueError(
                    "dataset_metadata.sampling='poisson' needs Poisson-sampled batches: pass "
                    f"the arrays themselves, fit(x, y), or {self._poisson_batches_hint}."
                )
            check_poisson_batches(*facts, metadata)
            self._check_poisson_batch_sizes(x)
            return
        if metadata.partial_last_batch:
            raise ValueError(
                "dataset_metadata.partial_last_batch: the last batch of each epoch is partial "
                "and would be refused mid-training. Prepare the data with drop_remainder=True."
            )
        if self._checked_data_source(x):
            return
        if metadata.multiplicity:
            raise ValueError(
                "dataset_metadata.multiplicity > 0: pass the augmented tf.data pipeline of "
                "lipdp.pipeline.load_and_prepare_images_data, not arrays."
            )
        if _not_arrays(x):  # batch sizes are checked when the step is traced
            return
        n_train = self._check_arrays(x, y, batch_size, kwargs)
        if n_train % b:
            raise ValueError(
                f"{n_train} training examples are not a multiple of batch_size={b}: the last "
                f"batch would be partial. Use {n_train - n_train % b} examples, or a "
                "pipeline with drop_remainder=True."
            )
        if kwargs.get("shuffle") is False:
            logger.warning(
                "fit(shuffle=False): batches are not random, so privacy "
                "amplification by subsampling does not apply."
            )

    def _check_arrays(self, x, y, batch_size, kwargs) -> int:
        """The checks of arrays given to ``fit`` (either sampling): every row (rule S9),
        ``batch_size`` the declared ``b``, the training part (before ``validation_split``)
        of the declared ``N``; under Poisson sampling, labels and the steps per epoch of
        the metadata. Returns the number of training examples."""
        metadata = self.dataset_metadata
        b = metadata.batch_size
        if self.poisson_sampling and y is None:
            raise ValueError(
                "fit(x) without y: Poisson sampling draws (x, y) rows together; pass the "
                "labels as y."
            )
        refuse_non_finite(x, y)
        self._refuse_invalid_rows(x, y)
        n = len(compat.flatten(x)[0])
        if batch_size is not None and batch_size != b:
            raise ValueError(
                f"fit(batch_size={batch_size}) differs from the batch size "
                f"{b} declared in dataset_metadata."
            )
        split = kwargs.get("validation_split") or 0.0
        n_train = int(math.floor(n * (1.0 - split))) if kwargs.get("validation_data") is None else n
        if n_train != metadata.nb_samples_train:
            raise ValueError(
                f"fit receives {n_train} training examples but dataset_metadata declares "
                f"nb_samples_train={metadata.nb_samples_train}: the sampling rate b/N of the "
                "privacy accounting comes from it. Declare the number of examples trained on."
            )
        steps = kwargs.get("steps_per_epoch")
        if self.poisson_sampling and steps is not None and steps != metadata.nb_steps_per_epochs:
            raise ValueError(
                f"fit(steps_per_epoch={steps}) differs from the {metadata.nb_steps_per_epochs} "
                "steps per epoch of dataset_metadata (the accountant's): omit steps_per_epoch."
            )
        return n_train

    def _poisson_fit_data(self, x, y, batch_size, kwargs) -> tuple:
        """``(x, y, batch_size)`` for Keras' ``fit``: under Poisson sampling, arrays become
        Poisson batches drawn here (:func:`lipdp.privatize.private_batches`: every record
        enters each batch independently with probability ``q = b/N``, from the operating
        system's entropy -- rule S8 --, fresh draws every epoch, ``nb_steps_per_epochs``
        steps an epoch: the mechanism the accountant analyses, rule S5), the way Keras
        batches arrays otherwise. Keras' ``validation_split`` is applied first, exactly as
        Keras does (the last ``validation_split`` of the rows, not shuffled, is held out:
        the first ``N`` are trained on); validation arrays are evaluated in batches of
        ``b``. ``shuffle`` does not apply (the draws are random). ``kwargs`` is updated in
        place. Other data, and every sampling but Poisson, is returned unchanged."""
        if not (self.poisson_sampling and self._poisson_batches_facts(x) is None and _arrays(x)):
            return x, y, batch_size
        split = kwargs.pop("validation_split", None) or 0.0
        if split and kwargs.get("validation_data") is None:
            n = self.dataset_metadata.nb_samples_train
            kwargs["validation_data"] = (_rows(x, slice(n, None)), _rows(y, slice(n, None)))
            x, y = _rows(x, slice(None, n)), _rows(y, slice(None, n))
        if isinstance(kwargs.get("validation_data"), (tuple, list)):
            kwargs.setdefault("validation_batch_size", self.dataset_metadata.batch_size)
        kwargs.pop("steps_per_epoch", None)  # checked: the metadata's, stated by the batches
        kwargs["shuffle"] = False
        return self.private_batches(x, y), None, None

    def private_batches(self, x, y, seed=None):
        """One epoch of Poisson batches of ``(x, y)`` at the model's rate ``q = b / N`` and
        steps per epoch (:func:`lipdp.privatize.private_batches`; ``x``: for a model of
        several inputs, one array per input, a dict or a list or tuple); the backend's
        batches (:meth:`_poisson_batches`). ``seed=None``: drawn from the operating system
        (rule S8)."""
        metadata = self._metadata_for("training")
        shape = metadata.input_shape
        if bool(shape) and all(isinstance(s, tuple) for s in shape):  # several inputs
            x = dict(x) if isinstance(x, dict) else tuple(x)
            records = len(compat.tf_nest_flatten(x)[0])
        else:
            records = len(x)
        if records != metadata.nb_samples_train:
            raise ValueError(
                f"x has {records} records but the model was made private for dataset_size="
                f"{metadata.nb_samples_train}: the sampling rate, and epsilon, come from it."
            )
        return self._poisson_batches(x, y, metadata, seed)

    def _poisson_batches(self, x, y, metadata, seed):
        """The backend's Poisson batches of one epoch (``tf.data`` on TensorFlow, padded
        numpy batches on JAX; backend hook)."""
        raise NotImplementedError

    def _refuse_changed_trainable_state(self) -> None:
        """Refuse layers frozen or unfrozen since ``compile`` where the backend would train
        the compiled ones (hook; none by default)."""

    def _check_distributed_data(self, x) -> None:
        """Refuse data that several workers could read twice (hook; none by default)."""

    def _poisson_batches_facts(self, x):
        """``(sampling rate or None, steps per epoch or None)`` that the Poisson batches
        ``x`` state, or ``None`` when ``x`` is not Poisson batches (backend hook)."""
        raise NotImplementedError

    def _check_poisson_batch_sizes(self, x) -> None:
        """Refuse batches whose sizes show they are not Poisson samples (hook; none by
        default)."""

    def _checked_data_source(self, x) -> bool:
        """Check the backend's own pipelines (``tf.data``, padded Poisson batches) and say
        so: ``True`` when the array checks of ``fit`` do not apply (backend hook)."""
        raise NotImplementedError

    def _refuse_invalid_rows(self, x, y) -> None:
        """Rule S9 for arrays beyond NaN and infinities (hook; none by default)."""

    # ------------------------------------------------------------ privacy state
    def save(self, filepath, *args, **kwargs):
        """Save in the ``.keras`` format only (rule S10).

        Keras 2.15's SavedModel directory and HDF5 files do not restore everything a
        privacy guarantee rests on (a SavedModel reload restores the optimizer's step count
        as 0, and the DP configuration is not part of HDF5): a reload would under-count
        epsilon. ``save_weights`` checkpoints keep the noisy step count (a model variable).
        """
        if not str(filepath).endswith(".keras"):
            raise ValueError(
                f"DP models are saved to .keras files (got {str(filepath)!r}): the SavedModel "
                "and HDF5 formats do not carry the privacy state (step count, DP "
                "configuration), so a reload would under-count epsilon."
            )
        return super().save(filepath, *args, **kwargs)

    def set_weights(self, weights):
        """Set the weights, then project them onto their constraint sets (S12). The
        privacy state is never rewound (:meth:`_keeping_the_privacy_state`)."""
        with self._keeping_the_privacy_state():
            super().set_weights(weights)
        self.project()

    def load_weights(self, *args, **kwargs):
        """Load the weights, then project them onto their constraint sets (S12); the
        privacy state is kept as by :meth:`set_weights`. ``skip_mismatch=True`` is refused:
        Keras then turns a ledger it cannot load (a refused one included) into a warning,
        and a new model would get the weights without their spending (rule S10)."""
        if kwargs.get("skip_mismatch") or (len(args) > 1 and args[1]):
            raise ValueError(
                "load_weights(skip_mismatch=True) could load the weights without the privacy "
                "ledger they were trained with (rule S10): load them without skip_mismatch."
            )
        with self._keeping_the_privacy_state():
            status = super().load_weights(*args, **kwargs)
        if self.built:
            self.project()
        return status

    @contextlib.contextmanager
    def _keeping_the_privacy_state(self):
        """Weights (and with them the ledger and the step count) may be restored to an
        earlier state -- EarlyStopping's best weights, a best checkpoint -- chosen after
        the later steps were released: what was recorded before stays recorded (rule
        S10). A fresh model loading a checkpoint simply gets the checkpoint's ledger.
        State of the backend's own (JAX's noise key) is kept by :meth:`_own_state`."""
        before, steps = self.privacy_ledger.snapshot(), int(self.noisy_steps.numpy())
        restore = self._own_state()
        yield
        self.privacy_ledger.keep_at_least(before)
        self.noisy_steps.assign(max(steps, int(self.noisy_steps.numpy())))
        restore()

    def _own_state(self):
        """A function restoring the model's own state that loaded weights must not replace
        (backend hook; nothing by default)."""
        return lambda: None

    # ----------------------------------------------------------- serialisation
    def get_compile_config(self):
        return super().get_compile_config()

    def compile_from_config(self, config):
        compat.replay_compile_config(self, config)

    def get_config(self):
        """The model's own entries (:meth:`_model_config`), the privacy parameters and the
        dataset metadata, the name."""
        metadata = self.dataset_metadata
        return {
            **self._model_config(),
            "dp_parameters": self.dp_parameters.to_config(),
            "dataset_metadata": None if metadata is None else metadata.to_config(),
            "physical_batch_size": self.physical_batch_size,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        network = cls._network_from_config(config, custom_objects)
        metadata = config.pop("dataset_metadata")
        return cls(
            network,
            dp_parameters=DPParameters(**config.pop("dp_parameters")),
            dataset_metadata=None if metadata is None else DatasetMetadata.from_config(metadata),
            **config,
        )

    def _model_config(self) -> dict:
        """The configuration entries of the network and the backend's options (hook)."""
        raise NotImplementedError

    @classmethod
    def _network_from_config(cls, config, custom_objects):
        """The first argument of the constructor (the layers, the network), popped from
        ``config`` and deserialised (hook)."""
        raise NotImplementedError


# --------------------------------------------------------------------- guards
def check_reduction(loss) -> None:
    """The loss must be the mean over the batch (what the sensitivities divide by)."""
    reduction = getattr(loss, "reduction", compat.Reduction.SUM_OVER_BATCH_SIZE)
    allowed = (compat.Reduction.AUTO, compat.Reduction.SUM_OVER_BATCH_SIZE)
    if reduction not in allowed:
        raise ValueError(
            f"Loss reduction {reduction!r} is not supported: sensitivities are computed for "
            "the mean over the batch. Use reduction=SUM_OVER_BATCH_SIZE (the default)."
        )


def one_target_per_output(labels, predictions):
    """Targets ``(rows,)`` of predictions ``(rows, 1)`` as ``(rows, 1)``. Why: Keras' losses
    squeeze such predictions to ``(rows,)`` and then average over their last axis -- the
    batch --, one value for the whole batch (harmless for Keras' mean, wrong per row).
    Any backend's dense arrays (a TensorFlow shape of unknown rank: unchanged)."""
    rank = _rank(predictions.shape)
    last = predictions.shape[-1] if rank else None
    if rank is not None and rank >= 2 and last == 1 and _rank(labels.shape) == rank - 1:
        return labels[..., None]
    return labels


def _rank(shape) -> int | None:
    """The rank of an array's shape: a tuple, or a TensorFlow ``TensorShape`` (``rank``,
    ``None`` when unknown)."""
    return shape.rank if hasattr(shape, "rank") else len(shape)


def other_backend_class(name: str, backend: str, fix: str):
    """A class registered as ``lipdp>name`` where the model class ``name`` of another
    backend cannot be built (the clipped family: ``DPSGD_Sequential`` is a TensorFlow
    program, ``DPSGD_JaxModel`` a JAX one, of different configurations): loading such a
    file is refused in one line naming the fix (``fix``), instead of Keras' "could not
    locate class". The clipless models need none: ``DP_Sequential`` is one class on both
    backends, and its file one layout."""

    def from_config(cls, config, custom_objects=None):
        raise ValueError(
            f"This file holds a {name}, a model of Keras' {backend} backend: it does not "
            f"load on this one; {fix}."
        )

    return type(
        name,
        (),
        {
            "__doc__": f"Refuses {name} files (:func:`other_backend_class`).",
            "from_config": classmethod(from_config),
            "get_config": lambda self: {},
        },
    )


def refuse_mixed_precision(layers) -> None:
    """Bounds, clipping and noise are computed for float32: refuse every other floating
    compute dtype (float16, bfloat16, float64, ...) of the global policy or of a layer at
    any depth of ``layers``. Integer and string layers (e.g. ``StringLookup``) compute in
    their own types."""
    policy = keras.mixed_precision.global_policy()
    names = [f"global policy {policy.name!r}"] if policy.compute_dtype != "float32" else []
    names += [
        f"layer {path!r} ({layer.compute_dtype})"
        for path, layer in nested_layers(list(layers))
        if _floating(getattr(layer, "compute_dtype", None)) not in ("float32", None)
    ]
    if names:
        raise ValueError(
            f"Mixed precision is not supported ({', '.join(names)}): float16 round-off "
            "exceeds the slack of the sensitivity bounds (an input clipped to norm 1 can "
            "come out above 1). Use keras.mixed_precision.set_global_policy('float32')."
        )


def _floating(dtype) -> str | None:
    """``dtype``'s name if it is a floating type (Keras names them ``float*`` and
    ``bfloat16``), else ``None``."""
    name = None if dtype is None else str(getattr(dtype, "name", dtype))
    return name if name is not None and name.startswith(("float", "bfloat")) else None


def refuse_non_finite(x, y) -> None:
    """Rule S9 for arrays: refuse examples with a NaN or an infinity, naming their rows.

    (Pipelines are neutralised in the step instead: such examples count zero.)
    """
    for name, values in (("x", x), ("y", y)):
        for array in compat.flatten(values):
            if array is None:
                continue
            array = np.asarray(array)
            if array.dtype.kind not in "fc" or array.ndim == 0:
                continue
            bad = np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(axis=1))
            if bad.size:
                raise ValueError(
                    f"{name} has {bad.size} example(s) with NaN or infinite values (rows "
                    f"{shown(bad)}): such a record has no bounded contribution. Remove or "
                    "repair these rows before fit."
                )


def check_poisson_batches(rate, steps, metadata) -> None:
    """Poisson batches that state their sampling rate must draw at the metadata's rate
    (the rate the accountant uses: batches drawn 4x more often cost far more than
    reported), and their steps per epoch must be the metadata's; a rate not stated
    (``None``) is warned about."""
    if rate is None:
        logger.warning(
            "The Poisson pipeline does not state its sampling rate (pass the dataset "
            "poisson_batches returns, before map/prefetch): the accountant assumes q = %g.",
            metadata.sampling_rate,
        )
        return
    if not math.isclose(rate, metadata.sampling_rate, rel_tol=1e-9):
        raise ValueError(
            f"The Poisson pipeline samples at rate {rate:g} but dataset_metadata declares "
            f"q = batch_size / N = {metadata.sampling_rate:g}, the rate the privacy "
            "accounting uses. Build the batches with metadata.sampling_rate."
        )
    if steps is not None and steps != metadata.nb_steps_per_epochs:
        raise ValueError(
            f"The Poisson pipeline has {steps} steps per epoch but dataset_metadata declares "
            f"{metadata.nb_steps_per_epochs}: the accountant would count the wrong number "
            "of steps. Build the batches with metadata.nb_steps_per_epochs."
        )


def named_fit_arguments(args, kwargs) -> dict:
    """The arguments of ``fit`` after ``batch_size`` by name: positional ones (``fit(x, y,
    32, 10)``) named as Keras' ``fit`` names them, so that every guard sees them."""
    names = list(inspect.signature(keras.Model.fit).parameters)[4:]  # self, x, y, batch_size
    if len(args) > len(names):
        raise TypeError(f"fit() takes at most {len(names) + 3} positional arguments.")
    named = dict(zip(names, args))
    for name in set(named) & set(kwargs):
        raise TypeError(f"fit() got multiple values for argument {name!r}.")
    return {**named, **kwargs}


def _arrays(x) -> bool:
    """Whether ``x`` is arrays (numpy, tensors, data frames: one, or a dict, tuple or list
    of them, one per input): data whose rows ``fit`` can sample itself."""
    if x is None or isinstance(x, keras.utils.Sequence):
        return False
    if isinstance(x, (dict, tuple, list)):
        leaves = list(x.values()) if isinstance(x, dict) else list(x)
        return bool(leaves) and all(_array(leaf) for leaf in leaves)
    return _array(x)


def _array(leaf) -> bool:
    return hasattr(leaf, "__array__") and hasattr(leaf, "shape") and hasattr(leaf, "__len__")


def _rows(x, rows):
    """The ``rows`` (a slice) of arrays ``x`` (one, or a dict, tuple or list of them)."""
    if isinstance(x, dict):
        return {key: value[rows] for key, value in x.items()}
    if isinstance(x, (tuple, list)) and all(_array(leaf) for leaf in x):
        return type(x)(value[rows] for value in x)
    return x[rows]


def _not_arrays(x) -> bool:
    """Whether ``x`` is no data, a ``keras.utils.Sequence`` (``PyDataset``), a callable or a
    generator: a source whose rows are not counted before ``fit``."""
    if x is None or isinstance(x, keras.utils.Sequence) or callable(x):
        return True
    return not hasattr(compat.flatten(x)[0], "__len__")


def shown(rows) -> str:
    """The first ten row indices, for an error message."""
    return ", ".join(str(i) for i in rows[:10]) + (", ..." if len(rows) > 10 else "")


__all__ = [
    "PrivateModelBase",
    "check_poisson_batches",
    "check_reduction",
    "named_fit_arguments",
    "one_target_per_output",
    "other_backend_class",
    "refuse_mixed_precision",
    "refuse_non_finite",
    "shown",
]
