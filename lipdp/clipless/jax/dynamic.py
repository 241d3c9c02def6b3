r"""The JAX tap of :class:`lipdp.clipless.dynamic.CotangentNorms` (imported under the JAX
backend only).

What the measurement is (backend-neutral, :class:`~lipdp.clipless.dynamic.CotangentNorms`):
for every row ``i`` and tap layer, ``s`` times the norm of the gradient of
``sum_j w_j loss_j / s`` w.r.t. the layer's output (``s`` the loss normaliser the clip
layers receive). What differs per backend is only how the gradient w.r.t. an intermediate
output is taken: TensorFlow watches the output on a ``GradientTape``; here a zero *probe*
``p`` is added at the tap's output (``h -> h + p``, the identity at ``p = 0``) and
``jax.grad`` w.r.t. the probes gives the cotangents, one row per example (every layer and
the loss act per row, rule S2). Differentiating at the *output* of a ``DP_ClipGradient``
gives its cotangent before its own clipping; clip layers further down clip as in training.

The function is compiled once per padded size: a batch is padded with zero rows of weight
0 up to the next power of two (a zero weight makes a padded row's loss and cotangent 0, and
no padded row changes a real row's cotangent, rule S2); their norms are dropped. This needs
a fixed loss normaliser (the model's metadata, which the callbacks require); without one
the batch is not padded (the clip layers clip at ``C / rows``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from lipdp.clipless.jax.trainer import loss_rows_function
from lipdp.core.jax.trainer import finite_rows, zeroed


def _padded_rows(rows: int) -> int:
    return 1 << max(0, int(rows) - 1).bit_length()


class JaxCotangentNorms:
    """``(x, y) -> [numpy (rows,) per tap]`` on a :class:`CliplessJaxTrainer` (module
    docstring); rows with a NaN or an infinity are zeroed and get weight 0 (norm 0), as
    the JAX training step neutralises them."""

    def __init__(self, model, indices):
        self.model = model
        self.indices = list(indices)
        self._compiled = jax.jit(self._norms)

    def _norms(self, trainable, non_trainable, x, y, weights):
        model = self.model
        loss_rows = loss_rows_function(model.loss)
        normalizer = model.dataset_metadata and model.dataset_metadata.loss_normalizer
        rows = keras.tree.flatten(x)[0].shape[0]
        scale = float(rows if normalizer is None else normalizer)
        finite = finite_rows(x) & finite_rows(y)
        x, y = zeroed(finite, x), zeroed(finite, y)
        weights = jnp.where(finite, weights, 0.0)
        position = {index: k for k, index in enumerate(self.indices)}

        def outputs(probes):
            def observe(index, h):
                return h + probes[position[index]] if index in position else h

            y_pred = model._stateless_forward(trainable, non_trainable, x, observe)
            return jnp.sum(weights * loss_rows(y, y_pred)) / scale

        shapes = {}

        def record(index, h):
            if index in position:
                shapes[index] = h
            return h

        jax.eval_shape(lambda: model._stateless_forward(trainable, non_trainable, x, record))
        probes = [jnp.zeros(shapes[i].shape, shapes[i].dtype) for i in self.indices]
        cotangents = jax.grad(outputs)(probes)
        return [
            jnp.sqrt(jnp.sum(jnp.reshape(g * scale, (rows, -1)) ** 2, axis=1)) for g in cotangents
        ]

    def __call__(self, x, y):
        model = self.model
        x = keras.tree.map_structure(lambda t: np.asarray(t), x)
        y = np.asarray(y)
        rows = int(keras.tree.flatten(x)[0].shape[0])
        metadata = model.dataset_metadata
        size = rows if metadata is None or metadata.loss_normalizer is None else _padded_rows(rows)

        def pad(t):
            return np.concatenate([t, np.zeros((size - rows, *t.shape[1:]), t.dtype)])

        x, y = keras.tree.map_structure(pad, x), pad(y)
        weights = np.concatenate([np.ones(rows, np.float32), np.zeros(size - rows, np.float32)])
        norms = self._compiled(
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            x,
            y,
            weights,
        )
        return [np.asarray(n)[:rows] for n in norms]
