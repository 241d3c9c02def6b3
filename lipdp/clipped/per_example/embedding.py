r"""Ghost rule of ``keras.layers.Embedding`` (exact class, ``mask_zero=False``, the table a
variable: no Keras 3 LoRA or quantization).

Position ``t`` of row ``i`` looks up row ``id_t`` of the table ``E``: ``z_t = e_{id_t}^T
E``, linear in ``E`` (``e_k`` the ``k``-th unit vector; no bias, no activation). For the
output cotangent ``G_i``:

* table gradient ``grad_E,i = sum_t e_{id_t} G_it^T`` (only the rows of the ids read);
* its squared norm, without forming the ``vocabulary x dim`` matrix:

      ``||sum_t e_{id_t} G_it^T||_F^2 = sum_{t,s} <e_{id_t}, e_{id_s}> <G_it, G_is>
      = sum_{t,s} [id_t = id_s] <G_it, G_is>``

  (``T^2 dim`` per row, float64: rule S13);
* BAM's shift: at ``E + grad_E,i`` position ``s`` looks up ``sum_t [id_t = id_s] G_it``
  more (the ids are the data: the same in both passes).

The rule is TensorFlow's only (it defines no ``product_factors``): on the JAX backend a
model with an ``Embedding`` takes the per-row ``vmap`` for the whole step
(:mod:`lipdp.clipped.jax.ghost`).

``Embedding(mask_zero=True)`` stays on the vectorised fallback (as it always has: the
mask then comes from the layer's own call).
"""

from __future__ import annotations

import keras

from lipdp.clipped.per_example.registry import (
    GhostRule,
    register_ghost_rule,
    rows,
    stored_weights,
)


def same_ids(a):
    """``(b, T, T)``: positions ``t, s`` of a row hold the same id."""
    import tensorflow as tf

    ids = tf.reshape(tf.cast(a, tf.int64), [tf.shape(a)[0], -1])
    return tf.equal(ids[:, :, None], ids[:, None, :])


class EmbeddingRule(GhostRule):
    """``Embedding`` without ``mask_zero`` (module docstring)."""

    name = "embedding"

    def applies(self, layer) -> bool:
        return not layer.mask_zero and stored_weights(layer)

    def kernel(self, layer):
        return layer.embeddings

    def bias(self, layer):
        return None

    def activation(self, layer, z):
        return z

    def linear(self, layer, a):
        import tensorflow as tf

        ids = a if a.dtype in (tf.int32, tf.int64) else tf.cast(a, tf.int32)
        return tf.nn.embedding_lookup(layer.embeddings, ids)

    def kernel_sq_norms(self, layer, a, g):
        import tensorflow as tf

        g = tf.cast(rows(g, layer.output_dim), tf.float64)
        inner = tf.einsum("btp,bsp->bts", g, g)
        same = tf.where(same_ids(a), inner, tf.zeros_like(inner))
        return tf.reduce_sum(same, [1, 2])

    def shift(self, layer, a_new, a, g, kernel_rows):
        import tensorflow as tf

        g_rows = rows(g, layer.output_dim)
        shift = tf.einsum("bst,btp->bsp", tf.cast(same_ids(a), g.dtype), g_rows)
        return tf.reshape(shift, tf.shape(g))


register_ghost_rule(keras.layers.Embedding, EmbeddingRule())

__all__ = ["EmbeddingRule", "same_ids"]
