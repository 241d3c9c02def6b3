"""A user function with *stated* Lipschitz constant and output bound."""

from __future__ import annotations

import keras

from lipdp.clipless.layers.base import DPLayer, register
from lipdp.foundation import compat, validation


@register
class DP_Lambda(keras.layers.Lambda, DPLayer):
    """Wraps ``function``; the caller states the two facts the bounds need.

    Args:
        function: a parameter-free function of one example batch.
        lipschitz_constant: ``l`` such that ``||f(x) - f(x')|| <= l ||x - x'||``
            for each example (cotangent bound ``G -> l * G``).
        output_gain, output_offset: ``||f(x)|| <= output_gain * ||x|| + output_offset``
            (output bound). For a function with ``f(0) = 0``, ``output_gain = l`` and
            ``output_offset = 0`` are valid.

    Nothing can check these claims in general: an arbitrary function is never
    assumed 1-Lipschitz, and the claims are the caller's responsibility.

    Rows (rule S2): the function is user code, so it must see one example at a time. On
    TensorFlow the private model's forward pass runs this layer row by row
    (:mod:`lipdp.core.isolation`). On Keras 3's JAX backend the layer does it itself:
    :meth:`call` is ``jax.vmap`` over the rows of the function applied to a batch of one
    (``x[i][None]``), so ``out[i] = f(x[i][None])[0]`` whatever ``f`` reads (a batch mean,
    a batch size, a sort over rows see one row), eagerly and under ``jax.jit`` alike.
    ``vmap`` maps every JAX primitive lane by lane; the primitives whose batching is not
    lane-wise (``custom_vmap``, host callbacks, foreign calls) are refused by the JAX step
    on the jaxpr of one row (``refuse_cross_row_primitives`` of the JAX trainer).
    """

    def __init__(
        self, function, lipschitz_constant=None, output_gain=None, output_offset=0.0, **kwargs
    ):
        if lipschitz_constant is None or output_gain is None:
            raise ValueError(
                "DP_Lambda needs lipschitz_constant= and output_gain= (and output_offset= if "
                "f(0) != 0): an arbitrary function has no known bound."
            )
        lipschitz_constant = validation.non_negative(
            "DP_Lambda lipschitz_constant", lipschitz_constant
        )
        output_gain = validation.non_negative("DP_Lambda output_gain", output_gain)
        output_offset = validation.non_negative("DP_Lambda output_offset", output_offset)
        super().__init__(function, **kwargs)
        self.lipschitz_constant = lipschitz_constant
        self.output_gain = output_gain
        self.output_offset = output_offset

    def call(self, inputs, mask=None, training=None):
        apply = super().call
        if compat.keras_backend() != "jax":
            return apply(inputs, mask=mask, training=training)
        return _row_by_row(lambda x, m: apply(x, mask=m, training=training), inputs, mask)

    def propagate_inputs(self, input_bound):
        return self.output_gain * input_bound + self.output_offset

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self.lipschitz_constant * gradient_bound

    def get_config(self):
        config = super().get_config()
        config.update(
            lipschitz_constant=self.lipschitz_constant,
            output_gain=self.output_gain,
            output_offset=self.output_offset,
        )
        return config


def _row_by_row(function, inputs, mask):
    """``jax.vmap`` over the rows of ``function`` on a batch of one: row ``i`` of the
    result is ``function(inputs[i][None], mask[i][None])[0]`` (JAX backend only)."""
    import jax

    from lipdp.core.jax.isolation import refuse_cross_row_primitives

    def one_row(row, row_mask):
        batch_of_one = jax.tree_util.tree_map(lambda t: t[None], (row, row_mask))
        return jax.tree_util.tree_map(lambda t: t[0], function(*batch_of_one))

    # Rule S2: under vmap a custom_vmap rule, a host callback or a foreign call would see
    # every row at once; they are refused on the function of one row, unbatched (under
    # vmap a custom_vmap rule is already replaced by what it computes).
    def spec(t):
        return None if t is None else jax.ShapeDtypeStruct(t.shape[1:], t.dtype)

    refuse_cross_row_primitives(
        one_row, jax.tree_util.tree_map(spec, inputs), jax.tree_util.tree_map(spec, mask)
    )
    return jax.vmap(one_row)(inputs, mask)
