r"""Clipped DP-SGD in the same API: ordinary Keras layers, per-example gradient clipping.

The second family of lipdp (issue 13). Everything around the step
is shared with the clipless family: :class:`~lipdp.clipless.model.DPParameters`,
:class:`~lipdp.foundation.metadata.DatasetMetadata`, Poisson sampling, the privacy plan (the same
subsampled Gaussian per step), :class:`~lipdp.core.callbacks.DP_Accountant`,
:func:`~lipdp.core.report.privacy_report`, ``.keras`` saving with the step count (rule S10)
and the noise generator of :mod:`lipdp.core.noise`.

**One step** (Abadi et al., CCS 2016), for a batch of rows ``i``:

1. per-example gradient norms ``||g_i||`` of the per-example loss, per weighted layer
   (:mod:`lipdp.clipped.per_example`: ghost norms for Dense, Conv2D and Embedding, a vectorised
   per-example fallback for other layers, or the full Jacobian; the model must not couple
   examples: batch normalisation at any depth is refused and a probe checks the rest,
   rule S2, :mod:`lipdp.core.batch_independence`), carried in float64 from per-row
   rescaled cotangents so that no finite record's norm underflows or overflows;
2. clipping factor ``C_i`` from ``||g_i||`` (over all variables), e.g.
   ``min(1, R / ||g_i||)``, or one per layer (:class:`Clipping` and its modes); rows with
   a NaN or an infinity, in the data or in their gradient, rows holding a token id
   outside the range of the layer reading it and rows whose class-index label is out of
   range get ``C_i = 0`` (rule S9, :mod:`lipdp.core.records`);
3. ``g = sum_i C_i g_i / b`` with ``b`` the loss normaliser of the metadata (the batch
   size, or its expectation under Poisson sampling);
4. Gaussian noise of standard deviation ``sigma * Delta`` on every coordinate, the
   ``"global"`` rule of :mod:`lipdp.core.noise` with one sensitivity
   ``Delta = R (1 + ROUNDOFF_SLACK) / b``: adding or removing one row changes the sum
   by ``C_i g_i``, of norm at most ``R`` (the slack covers float32 round-off of the
   clipped norm); or, with per-layer clipping and ``noisify_strategy="per-layer"``, one
   Gaussian per layer of standard deviation ``sigma R_l (1 + ROUNDOFF_SLACK) / b``;
5. the optimizer step.

Optionally a sharpness-aware ascent comes before step 1 (:class:`SharpnessAscent`): BAM
takes every row's gradient at its own ascent point (about 2x the cost of a step), DP-SAT
at the point reached along the previous released gradient (two weight assignments).

**Cost of a step.** Ghost norms need one forward pass, one backward pass to the
layer outputs and a second, layer-local backward pass with the clipping factors (skipped
where a layer's per-row gradients were cheaper to materialise): measured 1.4x a plain
Keras step on a 50k-parameter CNN, 1.4-1.7x on a dense net, with memory of the order of
the activations (``benchmarks/README.md``). The vectorised fallback and
``gradient_method="jacobian"`` store ``b`` copies of the affected variables. A nested
backbone that is a chain (``Sequential``, functional chain) is run layer by layer, so
only its layers without a ghost rule take the fallback: on a 2-block CNN backbone with
GroupNormalization (first block frozen, b = 256), the step is as fast as the same layers
listed flat (0.98-1.05x) and 2.0-2.5x faster than the backbone on the fallback as one
layer, the engine before (2.3x at b = 1024; ``benchmarks/nested_backbone_speed.py``).

The accountant sees one subsampled Gaussian mechanism of multiplier ``sigma`` per step,
exactly as for the clipless family.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from lipdp.clipped.clipping import CLIPPING_MODES, ClippedGradientBound, Clipping
from lipdp.clipped.layer_support import check_keras_layers
from lipdp.clipped.per_example import (
    GRADIENT_METHODS,
    Ascent,
    per_example_gradients,
    row_loop_layers,
    weighted_layers,
)
from lipdp.clipped.per_example.convolution import kernel_rows_by_offset
from lipdp.clipped.sharpness import ASCENT_MODES, SharpnessAscent
from lipdp.core import distribute
from lipdp.core.adversarial import softmax_kl
from lipdp.core.private_base import other_backend_class
from lipdp.core.private_model import DPParameters, PrivateModel, StepGradients
from lipdp.core.records import kept_rows
from lipdp.foundation import validation
from lipdp.foundation.variables import state_variable, variable_key


def _refuse_replicas(what) -> None:
    if distribute.replicas_in_sync() > 1:
        raise ValueError(
            f"{what} is not supported under a distribution strategy with several replicas: "
            "train on one device or use SharpnessAscent(mode='bam')."
        )


class DPSGD_Model(PrivateModel):
    """A Keras model trained with clipped DP-SGD (module docstring).

    Args:
        layers: ordinary Keras layers, applied in order (give the first one an
            ``input_shape``).
        dp_parameters: :class:`~lipdp.clipless.model.DPParameters`. ``noisify_strategy="global"``:
            one Gaussian mechanism on the whole clipped gradient; ``"per-layer"`` (with
            per-layer clipping only): one per weighted layer, of sensitivity ``R_l``.
        clipping: a :class:`Clipping` (or its config dict).
        dataset_metadata: :class:`~lipdp.foundation.metadata.DatasetMetadata`, required for
            training.
        gradient_method: ``"ghost"`` (default) or ``"jacobian"``, how per-example gradient
            norms are computed (:mod:`lipdp.clipped.per_example`; the same numbers).
        ascent: a :class:`SharpnessAscent` (BAM or DP-SAT), or ``None``.
        debug: run eagerly and log every step's noise level.
        row_isolation: every layer, activation and the loss computed one row at a time,
            forward and backward (:mod:`lipdp.core.isolation`; the linear parts of lipdp's
            own ghost rules run on the batch, a layer with a user's rule takes the per-row
            fallback): rule S2 by construction. Other arguments: :class:`PrivateModel`.
    """

    def __init__(
        self,
        layers,
        *,
        dp_parameters,
        clipping=Clipping(),
        dataset_metadata=None,
        gradient_method="ghost",
        ascent=None,
        debug=False,
        row_isolation=False,
        **kwargs,
    ):
        self.clipping = Clipping.coerce(clipping)
        self.gradient_method = validation.choice(
            "gradient_method", gradient_method, GRADIENT_METHODS
        )
        self.ascent = SharpnessAscent.coerce(ascent)
        if self.ascent is not None and self.ascent.mode == "bam" and gradient_method != "ghost":
            raise ValueError("BAM's per-example ascent needs gradient_method='ghost'.")
        if isinstance(dp_parameters, DPParameters):
            if dp_parameters.noisify_strategy != "global" and self.clipping.mode != "per-layer":
                raise ValueError(
                    f"{self.clipping.mode!r} clipping bounds the whole gradient: use "
                    "noisify_strategy='global' (per-layer noise needs per-layer clipping)."
                )
            if dp_parameters.dynamic_clipping is not None:
                raise ValueError("dynamic_clipping applies to DP_ClipGradient layers only.")
        super().__init__(
            layers,
            dp_parameters=dp_parameters,
            dataset_metadata=dataset_metadata,
            debug=debug,
            row_isolation=row_isolation,
            **kwargs,
        )

    _check_layers = staticmethod(check_keras_layers)

    def _check_adversarial(self, pgd) -> None:
        if pgd.trades_beta is not None and self.gradient_method != "jacobian":
            raise ValueError(
                "TRADES couples two forward passes of each example (its KL term): it needs "
                "DPSGD_Sequential(..., gradient_method='jacobian'); ghost norms cover losses "
                "of one row."
            )

    def _row_loop(self, layer) -> bool:
        """Layers ``pfor`` cannot vectorise run as a row loop under row isolation too
        (:func:`lipdp.clipped.per_example.row_loop_layers`)."""
        return bool(row_loop_layers([layer]))

    def _refuse_loss_reads(self, read) -> None:
        """A loss reading a weight itself: ghost norms refuse it, the Jacobian method clips
        its gradient with each row (:func:`lipdp.clipped.per_example.refuse_loss_reads`, where
        the per-example gradients are taken)."""

    # ----------------------------------------------------------------- sensitivity
    def weighted_layers(self) -> list:
        """The layers with trainable variables, forward order (one clip radius each under
        per-layer clipping)."""
        if not self.built:
            raise ValueError("Build the model (call it on data) before asking for its layers.")
        return weighted_layers(self.dp_layers)

    def _per_layer_noise(self) -> bool:
        return self.dp_parameters.noisify_strategy == "per-layer"

    def sensitivities(self):
        """``[(ClippedGradientBound, Delta)]`` with ``Delta = bound (1 + ROUNDOFF_SLACK) /
        b``: one entry of bound ``R`` for the whole gradient, or one per weighted layer of
        bound ``R_l`` under per-layer noise (:meth:`Clipping.sensitivities`, the rule of
        both backends)."""
        names = (
            [layer.name for layer in self.weighted_layers()] if self._per_layer_noise() else None
        )
        return self.clipping.sensitivities(self.batch_size, names)

    def _noise_coefficients(self) -> list[float]:
        """1 for the one entry, or for every weighted layer under per-layer noise."""
        mechanisms = len(self.weighted_layers()) if self._per_layer_noise() else 1
        return [1.0] * mechanisms

    def _noised_variables(self, entries) -> list[list]:
        """Every trainable variable under the one entry, or each weighted layer's under
        its own entry (per-layer noise)."""
        if not self._per_layer_noise():
            return [list(self.trainable_variables)]
        return [list(layer.trainable_variables) for layer in self.weighted_layers()]

    # -------------------------------------------------------------------- compile
    def build(self, input_shape):
        result = super().build(input_shape)
        # DP-SAT's state is shaped like the weights, which exist now. (Keras 3 accepts new
        # variables only while a layer builds; on Keras 2 compile could create them.)
        self._create_ascent_state(layers_built=True)
        return result

    def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
        self._create_ascent_state(layers_built=self.built)
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    def _create_ascent_state(self, layers_built):
        """DP-SAT keeps the previous released gradient (saved with the model)."""
        if self.ascent is None or self.ascent.mode != "dp-sat":
            return
        if hasattr(self, "previous_noisy_gradient"):
            return
        if not layers_built:
            raise ValueError(
                "DP-SAT keeps the previous noisy gradient: build the model before compile "
                "(give the first layer an input_shape)."
            )
        # Privacy state: Keras variables on Keras 3, which saves no tf.Variable attribute
        # (a .keras file would give zeros back).
        self.previous_noisy_gradient = [
            state_variable(tf.zeros(v.shape, v.dtype), v.dtype, "previous_noisy_gradient")
            for v in self.trainable_variables
        ]

    # ----------------------------------------------------------------- training
    def clipped_gradient_sum(self, x, y):
        """``(sum_i C_i g_i, y_pred, kept)``: the clipped per-example gradients summed
        (aligned with ``trainable_variables``) as the training step computes them (with the
        adversarial rows, if any), the predictions and the rows not neutralised for their
        input (finite, token ids in range: rule S9)."""
        x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
        x, y, finite, ids = self._neutralised_batch(x, y)
        kept = kept_rows(finite, ids)
        summed, y_pred = self._step_sum(x, y, kept)
        return summed, y_pred, kept

    def _step_sum(self, x, y, kept):
        """The clipped sum of a training step on rows already neutralised (S9)."""
        if self.adversarial is None:
            return self._clipped_sum(x, y, kept)
        return self._adversarial_clipped_sum(x, y, kept)

    def _clipped_sum(self, x, y, kept, row_weights=None, losses=None):
        """:meth:`clipped_gradient_sum` of rows already neutralised (S9), at DP-SAT's
        ascent point if asked (arguments of :meth:`_clipped_sum_at`)."""

        def compute():
            return self._clipped_sum_at(x, y, kept, row_weights, losses)

        if self.ascent is not None and self.ascent.mode == "dp-sat":
            return self._at_dp_sat_point(compute)
        return compute()

    def _adversarial_clipped_sum(self, x, y, kept):
        """The clipped sum of adversarial training (:mod:`lipdp.core.adversarial`): rows
        replaced by their adversarial versions (``mix = 1``), clean and adversarial rows
        clipped separately and weighted ``1 - mix`` and ``mix`` (``||.|| <= R``), or one
        TRADES loss per example over both (clipped as one row). Returns ``(sum,
        predictions on the adversarial rows)``."""
        x_adv = self.adversarial_examples(x, y)
        rows = tf.shape(kept)[0]
        both = tf.concat([x, x_adv], 0)
        beta = self.adversarial.trades_beta
        if beta is not None:

            def trades(y_pred):
                clean, adversarial = y_pred[:rows], y_pred[rows:]
                return self.per_example_losses(y, clean) + beta * softmax_kl(clean, adversarial)

            summed, y_pred = self._clipped_sum(both, y, kept, losses=trades)
            return summed, y_pred[rows:]
        w = self.adversarial.mix
        if w == 1.0:
            return self._clipped_sum(x_adv, y, kept)
        weights = tf.concat([tf.fill([rows], 1.0 - w), tf.fill([rows], w)], axis=0)
        labels, keep = tf.concat([y, y], 0), tf.concat([kept, kept], 0)
        summed, y_pred = self._clipped_sum(both, labels, keep, row_weights=weights)
        return summed, y_pred[rows:]

    def _clipped_sum_at(self, x, y, kept, row_weights=None, losses=None):
        """``(sum_i w_i C_i g_i, y_pred)``; ``row_weights`` ``w_i`` (default 1);
        ``losses(y_pred)``: the per-example losses (default: the compiled loss of each
        row; TRADES pairs the rows of ``x``, jacobian method only)."""
        if losses is None:

            def losses(y_pred):
                return self.per_example_losses(y, y_pred)

        facts = per_example_gradients(self, x, losses, self.gradient_method)
        self.refuse_data_dependent_losses()  # add_loss in a call, seen by the forward pass
        y_pred = facts.y_pred
        if self.ascent is not None and self.ascent.mode == "bam":
            norms = tf.sqrt(tf.add_n(facts.sq_norms))
            usable = kept & tf.math.is_finite(norms) & (norms > 0)
            safe = tf.where(usable, norms, tf.ones_like(norms))
            scales = tf.where(usable, self.ascent.radius / safe, tf.zeros_like(norms))
            facts = per_example_gradients(self, x, losses, "ghost", Ascent(facts, scales))
        factors = self.clipping.layer_factors(facts.sq_norms)
        if row_weights is not None:
            factors = [c * tf.cast(row_weights, c.dtype) for c in factors]
        # Rows with an out-of-range label already have loss 0 (per_example_losses): their
        # gradient is 0; masking them too keeps S9 independent of that.
        labelled = self.class_labels_in_range(y, y_pred)
        keep = kept & labelled & tf.math.is_finite(tf.add_n(facts.sq_norms))
        sums = facts.clipped_sums(factors, keep)
        summed = [
            sums[variable_key(v)] if variable_key(v) in sums else tf.zeros_like(v)
            for v in self.trainable_variables
        ]
        return summed, y_pred

    def _at_dp_sat_point(self, compute):
        """``compute()`` with the weights at ``theta + rho u / ||u||`` (``u``: the previous
        released gradient; ``theta`` itself when ``u = 0``), then ``theta`` restored
        exactly (a saved copy, not a subtraction)."""
        variables = self.trainable_variables
        previous = self.previous_noisy_gradient
        norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(u)) for u in previous]))
        scale = tf.where(norm > 0, self.ascent.radius / tf.maximum(norm, 1e-30), 0.0)
        saved = [tf.identity(v) for v in variables]
        for v, u in zip(variables, previous):
            v.assign_add(scale * u)
        result = compute()
        for v, value in zip(variables, saved):
            v.assign(value)
        return result

    def _refuse_unsupported_step(self) -> None:
        if self.ascent is not None and self.ascent.mode == "dp-sat":
            _refuse_replicas("DP-SAT (it moves the weights inside the step)")

    def _private_gradients(self, x, y, kept) -> StepGradients:
        """``sum_i C_i g_i / n`` (:meth:`clipped_gradient_sum`) on rows already
        neutralised (S9): each clipped term of norm at most ``R``."""
        if self.physical_batch_size is None:
            summed, y_pred = self._step_sum(x, y, kept)
        else:  # the user bounded the step's memory: no Conv2D patch matrix
            with kernel_rows_by_offset():
                summed, y_pred = self._step_sum(x, y, kept)
        normalizer = float(self.dataset_metadata.loss_normalizer)
        return StepGradients([s / normalizer for s in summed], y_pred)

    def _after_release(self, released) -> None:
        """DP-SAT's next ascent direction: the gradient just released."""
        if self.ascent is not None and self.ascent.mode == "dp-sat":
            for kept, value in zip(self.previous_noisy_gradient, released):
                kept.assign(value)

    # ------------------------------------------------------------- serialisation
    def get_config(self):
        return {
            **super().get_config(),
            "clipping": self.clipping.to_config(),
            "gradient_method": self.gradient_method,
            "ascent": None if self.ascent is None else self.ascent.to_config(),
        }


class DPSGD_Sequential(DPSGD_Model):
    """``DPSGD_Sequential(layers, dp_parameters=..., clipping=Clipping(...),
    dataset_metadata=...)``: a stack of Keras layers trained with clipped DP-SGD."""

    _layers_key = "layers"


keras.utils.register_keras_serializable(package="lipdp")(DPSGD_Model)
keras.utils.register_keras_serializable(package="lipdp")(DPSGD_Sequential)
# The JAX clipped model's files: refused in one line (other_backend_class).
keras.utils.register_keras_serializable(package="lipdp")(
    other_backend_class(
        "DPSGD_JaxModel",
        "JAX",
        "load it with KERAS_BACKEND=jax (a clipped model's file loads on the backend that "
        "wrote it)",
    )
)

__all__ = [
    "ASCENT_MODES",
    "CLIPPING_MODES",
    "SharpnessAscent",
    "ClippedGradientBound",
    "Clipping",
    "DPSGD_Model",
    "DPSGD_Sequential",
    "check_keras_layers",
]
