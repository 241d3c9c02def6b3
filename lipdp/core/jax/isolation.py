r"""Rule S2 on the JAX step: the rows of a batch are isolated by construction, and what
could break the construction is refused.

**The argument.** The released gradient of :class:`lipdp.clipped.jax.model.DPSGD_JaxModel`
is ``sum_i w_i C_i g_i / b`` plus noise, and every quantity row ``i`` contributes --
its loss ``l_i``, its gradient ``g_i`` (``vmap`` path) or its layers' inputs ``A_i`` and
output cotangents ``G_i`` (ghost path), its norm, its factor ``C_i``, its weight ``w_i``,
the test that its values are finite -- is computed by ``jax.vmap`` of a function of
*one* row (a batch of one: ``x[i][None]``) over the rows, or row by row from those:

* ``vmap`` path: ``jax.vmap(jax.grad(row_loss))``
  (:func:`lipdp.clipped.jax.per_example.per_example_gradients`);
* ghost path: ``jax.vmap(row)`` of the tapped forward of one row, differentiated with
  respect to per-row probes (:mod:`lipdp.clipped.jax.ghost`): the network is never
  called on the batch there either; the norms and the clipped sum are per-row
  functions of the recorded ``A_i``, ``G_i``;
* the weights, the finiteness test, the norms, the clip factors and the selection of the
  usable rows (:mod:`lipdp.clipped.jax.per_example`) are row-wise array operations; the
  sum over the rows is the only reduction, and it is the released quantity.

``jax.vmap`` of a function built from JAX primitives computes, for every row ``i``, the
function applied to row ``i``'s operands alone (``vmap(f)(X)[i] = f(X[i])``): each
primitive's batching rule maps the primitive over the batch axis, and the only
primitives that combine the lanes of a ``vmap`` are collectives over a *named* axis,
which the step's ``vmap`` (unnamed) does not bind. So a layer or a loss that reads the
batch -- subtracts the batch mean, divides by the batch maximum, sorts over the batch,
gates on the batch size, scales the loss by the batch's largest logit -- sees a batch of
one in the step: ``l_i`` is a function of row ``i`` and the weights only, whatever the
layer's code, and removing a row removes its term and changes no other row's term
(``tests/clipped/jax/test_isolation.py``: the six couplings of ``tests/couplings.py`` train with
no cross-row effect, remove-one ratio at most ``1`` up to round-off). The numerical
probe of the TensorFlow step (:mod:`lipdp.core.batch_independence`) is not needed here.

**Where the construction does not hold, refused** (one line naming the fix):

* a batching rule that is not the lane-wise one: ``jax.custom_batching.custom_vmap``
  (the rule receives every row at once), host callbacks whose results enter the
  computation (``jax.pure_callback``, ``jax.experimental.io_callback``: with
  ``vmap_method="broadcast_all"`` or ``"expand_dims"`` the callback gets every row at
  once; even called row by row, a host function keeps state from one row to the next)
  and foreign functions (``jax.ffi.ffi_call``): :func:`refuse_cross_row_primitives`,
  on the jaxpr of one row's loss and gradient, when the step is traced (Keras' own
  layers use none of them; ``jax.debug`` callbacks return nothing and are accepted);
* state, which outlives the step and is not noised: the structural walk
  (:func:`lipdp.clipped.layer_support.check_keras_layers`, the TensorFlow models' walk,
  same messages: trainable batch normalisation and its moving statistics, layers
  declaring ``couples_examples = True``, stateful recurrent layers,
  ``SpectralNormalization``), and, when the step is traced, any call that assigns a
  non-trainable variable (a running statistic, a random layer's seed state) or adds a
  loss (:meth:`lipdp.clipped.jax.model.DPSGD_JaxModel._stateless_forward`).

The logs of a step (loss and metrics of the rows that entered it, computed from the
per-row predictions) are statistics of the private data for its owner, not part of the
release, as on the TensorFlow backend.
"""

from __future__ import annotations

#: Primitives whose batching is not the lane-wise map of the primitive, and why.
CROSS_ROW_PRIMITIVES = {
    "custom_vmap_call": "a jax.custom_batching.custom_vmap rule (it receives every row at once)",
    "pure_callback": "jax.pure_callback (a host function: it may receive every row at once, "
    "or keep state from one row to the next)",
    "io_callback": "an io_callback (a host function keeping state from one row to the next)",
    "ffi_call": "a foreign function (jax.ffi.ffi_call: its batching is its own)",
}


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jaxprs_in_params(eqn.params):
            yield from _equations(inner)


def _where(eqn) -> str:
    """``" (file:line)"`` of the user code that bound ``eqn``, when JAX records it."""
    try:
        from jax._src import source_info_util

        return f" ({source_info_util.summarize(eqn.source_info)})"
    except Exception:  # noqa: BLE001 - a private helper: the message only loses the place
        return ""


def cross_row_primitives(function, *args) -> list:
    """``[(primitive name, where)]`` of :data:`CROSS_ROW_PRIMITIVES` in the jaxpr of
    ``function(*args)`` (``args``: arrays or ``jax.ShapeDtypeStruct``), nested jaxprs
    included."""
    import jax

    closed = jax.make_jaxpr(function)(*args)
    return [
        (eqn.primitive.name, _where(eqn))
        for eqn in _equations(closed.jaxpr)
        if eqn.primitive.name in CROSS_ROW_PRIMITIVES
    ]


def refuse_cross_row_primitives(function, *args) -> None:
    """Refuse, in one line naming the fix, a primitive of :data:`CROSS_ROW_PRIMITIVES` in
    ``function(*args)`` -- one row's loss and gradient, unbatched (under ``vmap`` a
    ``custom_vmap`` rule is already replaced by what it computes)."""
    found = cross_row_primitives(function, *args)
    if found:
        name, where = found[0]
        raise ValueError(
            f"The forward pass or the loss calls {CROSS_ROW_PRIMITIVES[name]}{where}: the JAX "
            "step isolates the rows of a batch only for JAX's own batching rules (rule S2). "
            "Write that computation with keras.ops or jax.numpy."
        )


__all__ = ["CROSS_ROW_PRIMITIVES", "cross_row_primitives", "refuse_cross_row_primitives"]
