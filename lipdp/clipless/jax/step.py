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
from lipdp.clipless.bounds import bound_pass
from lipdp.clipless.layers.constrained import ConstrainedKernelLayer
from lipdp.clipless.losses import DP_Loss
from lipdp.core import noise

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
