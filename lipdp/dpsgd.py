r"""Clipped DP-SGD in the same API: ordinary Keras layers, per-example gradient clipping.

The second family of lipdp (issue 13; this module holds its first part: flat, automatic
and global clipping with per-example gradients from autodiff). Everything around the step
is shared with the clipless family: :class:`~lipdp.model.DPParameters`,
:class:`~lipdp.metadata.DatasetMetadata`, Poisson sampling, the privacy plan (the same
subsampled Gaussian per step), :class:`~lipdp.callbacks.DP_Accountant`,
:func:`~lipdp.report.privacy_report`, ``.keras`` saving with the step count (rule S10)
and the noise generator of :mod:`lipdp.noise`.

**One step** (Abadi et al., CCS 2016), for a batch of rows ``i``:

1. per-example gradients ``g_i`` of the per-example loss (the Jacobian of the vector of
   per-example losses; the model must not couple examples: batch normalisation is
   refused, rule S2);
2. clipping factor ``C_i`` from ``||g_i||`` (over all variables), e.g.
   ``min(1, R / ||g_i||)`` (:class:`Clipping` and its modes); rows with a NaN or an
   infinity, in the data or in their gradient, get ``C_i = 0`` (rule S9);
3. ``g = sum_i C_i g_i / b`` with ``b`` the loss normaliser of the metadata (the batch
   size, or its expectation under Poisson sampling);
4. Gaussian noise of standard deviation ``sigma * Delta`` on every coordinate, the
   ``"global"`` rule of :mod:`lipdp.noise` with one sensitivity
   ``Delta = R (1 + ROUNDOFF_SLACK) / b``: adding or removing one row changes the sum
   by ``C_i g_i``, of norm at most ``R`` (the slack covers float32 round-off of the
   clipped norm);
5. the optimizer step.

The accountant sees one subsampled Gaussian mechanism of multiplier ``sigma`` per step,
exactly as for the clipless family.
"""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from lipdp import noise, validation
from lipdp.bounds import ROUNDOFF_SLACK
from lipdp.model import DP_Model, DPParameters, _refuse_mixed_precision, check_reduction
from lipdp.records import finite_rows, zero_rows

#: Clipping modes available (per-layer clipping and BAM are the rest of issue 13).
CLIPPING_MODES = ("flat", "automatic", "global")

#: Layers that couple the examples of a batch (rule S2), with the fix.
_COUPLING_LAYERS = {
    "BatchNormalization": "GroupNormalization or LayerNormalization (per-example statistics)",
    "SyncBatchNormalization": "GroupNormalization or LayerNormalization",
}


@dataclass(frozen=True)
class Clipping:
    r"""How per-example gradients ``g_i`` are scaled, ``C_i g_i``, and why every scaled
    gradient has norm at most ``R`` (the sensitivity of the sum):

    * ``"flat"`` (Abadi et al. 2016): ``C_i = min(1, R / ||g_i||)``;
      ``||C_i g_i|| = min(||g_i||, R) <= R``.
    * ``"automatic"`` (Bu et al. 2022, normalisation): ``C_i = R / (||g_i|| + gamma)``;
      ``||C_i g_i|| = R ||g_i|| / (||g_i|| + gamma) < R``.
    * ``"global"`` (Bu et al. 2021, *On the convergence and calibration of deep learning
      with differential privacy*, Appendix C.8): ``C_i = R / Z`` if ``||g_i|| <= Z``,
      else ``0``; ``||C_i g_i|| <= (R / Z) Z = R``. Every kept gradient is scaled by the
      same factor, which keeps the per-sample gradients' relative sizes (their
      calibration argument); examples with gradients above ``Z`` are dropped from the step.

    Attributes:
        mode: one of :data:`CLIPPING_MODES`.
        clip_norm: ``R > 0``.
        gamma: ``gamma > 0`` of ``"automatic"`` (0.01, as the paper).
        threshold: ``Z > 0`` of ``"global"`` (required there, refused elsewhere).
    """

    mode: str = "flat"
    clip_norm: float = 1.0
    gamma: float = 0.01
    threshold: float | None = None

    def __post_init__(self):
        validation.choice("clipping mode", self.mode, CLIPPING_MODES)
        set_field = object.__setattr__  # normalisation of a frozen dataclass
        set_field(self, "clip_norm", validation.positive("clip_norm", self.clip_norm))
        set_field(self, "gamma", validation.positive("gamma", self.gamma))
        if (self.mode == "global") != (self.threshold is not None):
            raise ValueError(
                "threshold=Z is required with mode='global' (examples whose gradient norm "
                "exceeds Z are dropped) and only then."
            )
        if self.threshold is not None:
            set_field(self, "threshold", validation.positive("threshold", self.threshold))

    @classmethod
    def coerce(cls, value) -> Clipping:
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"clipping must be a Clipping or its config dict, got {value!r}.")

    def per_example_bound(self) -> float:
        """Norm bound on one row's scaled gradient: ``R`` in every mode (class docstring)."""
        return self.clip_norm

    def factors(self, norms):
        """``C_i`` from the per-example gradient norms (class docstring)."""
        r = tf.cast(self.clip_norm, norms.dtype)
        if self.mode == "flat":
            return r / tf.maximum(norms, r)  # 1 for a zero gradient
        if self.mode == "automatic":
            return r / (norms + tf.cast(self.gamma, norms.dtype))
        z = tf.cast(self.threshold, norms.dtype)
        return tf.where(norms <= z, r / z, tf.zeros_like(norms))

    def to_config(self) -> dict:
        return {
            "mode": self.mode,
            "clip_norm": self.clip_norm,
            "gamma": self.gamma,
            "threshold": self.threshold,
        }


@dataclass(frozen=True)
class ClippedGradientBound:
    """The sensitivity entry of a clipped model: one bound for the whole gradient."""

    key: str
    bound: float
    nm_coef: float = 1.0


def _neutralised(x, y):
    """``(x, y, finite)`` with the rows holding a NaN or an infinity zeroed (rule S9)."""
    finite = finite_rows(tf.nest.flatten(x)[0]) & finite_rows(y)
    x = tf.nest.map_structure(lambda t: zero_rows(finite, t), x)
    y = zero_rows(finite, y) if y.dtype.is_floating else y
    return x, y, finite


def check_keras_layers(layers) -> None:
    """Refuse what per-example clipping cannot handle, with the fix in the message."""
    layers = list(layers)
    if not layers:
        raise ValueError("A DP-SGD model needs at least one layer.")
    seen = set()
    for layer in layers:
        if not isinstance(layer, tf.keras.layers.Layer):
            raise TypeError(f"{layer!r} is not a Keras layer.")
        name = type(layer).__name__
        if name in _COUPLING_LAYERS:
            raise ValueError(
                f"Layer {layer.name!r} ({name}) normalises with batch statistics: one example "
                f"changes every other example's gradient (rule S2). Use {_COUPLING_LAYERS[name]}."
            )
        if id(layer) in seen:
            raise ValueError(f"Layer {layer.name!r} appears twice; use two layers.")
        seen.add(id(layer))
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"Layer {layer.name!r} has an activity_regularizer: a loss term outside the "
                "clipped per-example losses. Remove it."
            )


class DPSGD_Model(DP_Model):
    """A Keras model trained with clipped DP-SGD (module docstring).

    Args:
        layers: ordinary Keras layers, applied in order (give the first one an
            ``input_shape``).
        dp_parameters: :class:`~lipdp.model.DPParameters` (``noisify_strategy="global"``:
            flat clipping bounds the whole gradient, not each layer).
        clipping: a :class:`Clipping` (or its config dict).
        dataset_metadata: :class:`~lipdp.metadata.DatasetMetadata`, required for training.
        debug: run eagerly and log every step's noise level.
    """

    def __init__(
        self,
        layers,
        *,
        dp_parameters,
        clipping=Clipping(),
        dataset_metadata=None,
        debug=False,
        **kwargs,
    ):
        self.clipping = Clipping.coerce(clipping)
        if isinstance(dp_parameters, DPParameters):
            if dp_parameters.noisify_strategy != "global":
                raise ValueError(
                    "DP-SGD with flat clipping bounds the whole gradient: use "
                    "noisify_strategy='global' (per-layer noise needs per-layer clipping)."
                )
            if dp_parameters.dynamic_clipping is not None:
                raise ValueError("dynamic_clipping applies to DP_ClipGradient layers only.")
        super().__init__(
            layers,
            dp_parameters=dp_parameters,
            dataset_metadata=dataset_metadata,
            debug=debug,
            **kwargs,
        )

    _check_layers = staticmethod(check_keras_layers)

    # ----------------------------------------------------------------- sensitivity
    def bounds(self):
        raise ValueError(
            "A clipped DP-SGD model has no layer-wise bounds: its sensitivity is the clip "
            "norm (sensitivities())."
        )

    def sensitivities(self):
        """``[(ClippedGradientBound, Delta)]`` with ``Delta = R (1 + ROUNDOFF_SLACK) / b``."""
        bound = self.clipping.per_example_bound()
        entry = ClippedGradientBound(f"all variables ({self.clipping.mode} clipping)", bound)
        return [(entry, bound * (1.0 + ROUNDOFF_SLACK) / float(self.batch_size))]

    def noise_multipliers(self) -> list[float]:
        params = self.dp_parameters
        return noise.noise_multipliers("global", params.noise_multiplier, [1.0])

    def noise_stddevs(self, sensitivities=None):
        """``{variable ref: sigma * Delta}``, the same for every variable (0 if
        non-private)."""
        entries = self.sensitivities() if sensitivities is None else sensitivities
        params = self.dp_parameters
        sigma = 0.0 if params.non_private else params.noise_multiplier
        (std,) = noise.noise_stddevs("global", sigma, [d for _, d in entries], [1.0])
        return {v.ref(): std for v in self.trainable_variables}

    def project(self):
        return None  # no constraint sets

    # -------------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, **kwargs):
        if loss is None:
            raise ValueError("compile(loss=...) is required.")
        check_reduction(loss)
        _refuse_mixed_precision(self.dp_layers)
        if kwargs.get("loss_weights") is not None:
            raise ValueError("loss_weights is not supported: it rescales the sensitivity.")
        if self.debug:
            kwargs["run_eagerly"] = True
        tf.keras.Model.compile(self, optimizer=optimizer, loss=loss, metrics=metrics, **kwargs)

    # ----------------------------------------------------------------- training
    def per_example_losses(self, y, y_pred):
        """The loss of each row (mean over its non-batch axes), shape ``(rows,)``."""
        loss = tf.keras.losses.get(self.loss)
        fn = loss.call if isinstance(loss, tf.keras.losses.Loss) else loss
        values = fn(y, y_pred)
        rank = len(values.shape)
        return values if rank == 1 else tf.reduce_mean(values, axis=list(range(1, rank)))

    def clipped_gradient_sum(self, x, y):
        """``(sum_i C_i g_i, y_pred, finite)``: the clipped per-example gradients summed
        (aligned with ``trainable_variables``), the predictions and the finite rows."""
        x, y, finite = _neutralised(x, y)
        summed, y_pred = self._clipped_sum(x, y, finite)
        return summed, y_pred, finite

    def _clipped_sum(self, x, y, finite):
        """:meth:`clipped_gradient_sum` of rows already neutralised (S9)."""
        variables = self.trainable_variables
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            losses = self.per_example_losses(y, y_pred)
        jacobians = tape.jacobian(losses, variables, experimental_use_pfor=True)
        jacobians = [
            tf.zeros([tf.shape(losses)[0], *v.shape], v.dtype) if j is None else j
            for j, v in zip(jacobians, variables)
        ]
        squares = tf.add_n(
            [tf.reduce_sum(tf.reshape(tf.square(j), [tf.shape(j)[0], -1]), 1) for j in jacobians]
        )
        norms = tf.sqrt(squares)
        keep = finite & tf.math.is_finite(norms)
        factors = tf.where(keep, self.clipping.factors(norms), tf.zeros_like(norms))
        summed = [tf.tensordot(factors, zero_rows(keep, j), axes=[[0], [0]]) for j in jacobians]
        return summed, y_pred

    def train_step(self, data):
        _refuse_mixed_precision(self.dp_layers)
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        if sample_weight is not None:
            raise ValueError("sample weights are not supported: they change the sensitivity.")
        self._check_batch_rows(tf.shape(tf.nest.flatten(x)[0])[0])
        x, y, finite = _neutralised(x, y)
        summed, y_pred = self._clipped_sum(x, y, finite)
        self._non_finite.update_state(tf.reduce_sum(tf.cast(~finite, tf.float32)))
        normalizer = float(self.dataset_metadata.loss_normalizer)
        gradients = [s / normalizer for s in summed]
        variables = self.trainable_variables
        self.optimizer.apply_gradients(zip(self.noisify(gradients, variables), variables))
        self.noisy_steps.assign_add(1)
        self.compute_loss(x, y, y_pred)  # the loss tracker (training logs), not the step
        logs = self.compute_metrics(x, y, y_pred, None)
        return {**logs, "non_finite_examples": self._non_finite.result()}

    # ------------------------------------------------------------- serialisation
    def get_config(self):
        return {**super().get_config(), "clipping": self.clipping.to_config()}


class DPSGD_Sequential(DPSGD_Model):
    """``DPSGD_Sequential(layers, dp_parameters=..., clipping=Clipping(...),
    dataset_metadata=...)``: a stack of Keras layers trained with clipped DP-SGD."""

    _layers_key = "layers"


tf.keras.utils.register_keras_serializable(package="lipdp")(DPSGD_Model)
tf.keras.utils.register_keras_serializable(package="lipdp")(DPSGD_Sequential)

__all__ = [
    "CLIPPING_MODES",
    "ClippedGradientBound",
    "Clipping",
    "DPSGD_Model",
    "DPSGD_Sequential",
    "check_keras_layers",
]
