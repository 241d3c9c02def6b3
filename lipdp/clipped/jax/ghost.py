r"""Ghost norms on the JAX step (``DPSGD_JaxModel(gradient_method="ghost")``): per-example
gradient norms and the clipped sum without per-example gradients of the whole network.

**Scope: the ghost-rule registry of the TensorFlow engine.** Every trainable variable of
the network is the kernel or the bias of a layer whose ghost rule
(:func:`lipdp.clipped.per_example.registry.find_ghost_rule`: the same lookup, the same
``applies`` conditions as on TensorFlow) defines the backend-neutral pieces
``product_factors`` and ``apply_kernel`` -- :func:`ghost_layers`. Built in: ``Dense``
(exact class, no LoRA, not quantized) and ``Conv2D`` (exact class, ``channels_last``,
``groups=1``); a rule registered by a user with those pieces is covered too. Any other
model takes the ``vmap`` path for the whole step (:mod:`lipdp.clipped.jax.per_example`);
the two are never mixed. The rules that are TensorFlow's only (``Embedding``) and the
layers without a rule (normalisations, attention, ...) therefore run on the per-row
``vmap`` here, which is exact for any layer.

**Interception.** While the forward pass is traced, each such layer's ``call`` is replaced,
on the instance and only for that trace (:func:`tapped`), by the rule's ``apply_kernel``
(``a W`` for ``Dense``, the convolution for ``Conv2D``) with the tap's value of ``W``, plus
the tap's ``b``, plus a *probe* ``p`` added to ``z`` before the rule's activation; the tap
records the layer's input ``a``. Replacing ``call`` (not building the forward from the layer graph)
keeps every model Keras can call -- Sequential, functional, subclassed, nested -- and the
layer's activation untouched. A layer called several times records every call.

**One row at a time, as on the ``vmap`` path.** The forward is ``jax.vmap`` of the network
on one row (a batch of one) at a time, so no layer can mix the rows (rule S2). With zero
probes, ``jax.grad`` of the *summed* losses with respect to the probes is, row by row,
the cotangent ``G_i`` of each ``z`` (rows are independent), and the kernel gradient of
row ``i`` is ``A_i^T G_i`` (``A_i``, ``G_i``: the inputs -- the patches for ``Conv2D`` --
and cotangents of all of the layer's calls, positions stacked, ``T x d`` and ``T x p``).

**Every use counted.** The network runs with the trainable variables mapped to *sentinel*
values and the taps to the real ones; when the step is traced, the jaxpr of the forward is
checked not to read the sentinels (:func:`uses_only_taps`): a weight read outside its
layer's call (weight tying, a subclassed model reading ``layer.kernel``) would have a
gradient the taps miss, and such a model takes the ``vmap`` path.

**Norms** (float32, neither overflow nor underflow: every factor is scaled by its row's
largest magnitude, :mod:`lipdp.clipped.per_example.scale`): the rule's
``product_factors`` give ``A_i`` and ``G_i`` (the inputs, or the patches for ``Conv2D``:
the one per-backend piece of a rule), and
:func:`lipdp.clipped.per_example.dense.product_norms` -- the formulas the TensorFlow rules
use, in their float32 form -- gives the kernel norms: ``||a_i|| ||g_i||`` for ``T = 1``;
the materialised ``A_i^T G_i`` when ``T (d + p) >= d p`` (every ``Conv2D``; their rows give
the clipped sum too); else the Grams plus their float32 round-off bound. Biases:
``||sum_t g_t||`` (the rule's ``bias_rows``); the row's norm: the norm of the vector of
these norms (scaled again).

**Clipped sum** from the same recorded factors, no second backward pass: per variable
``sum_i k_i A_i^T G_i`` (``k_i = w_i C_i``; the materialised rows when there are some),
``sum_i k_i sum_t g_t`` for a bias, over the rows selected by
:func:`lipdp.clipped.jax.per_example.usable_rows` -- the others are replaced by zeros
(selected, never multiplied by 0). Row ``i`` contributes ``k_i`` times the very quantities
whose norm was bounded, so the sensitivity argument of
:mod:`lipdp.clipped.jax.per_example` is unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses

from lipdp.clipped.per_example.dense import EXACT, product_norms
from lipdp.clipped.per_example.registry import GhostRule, find_ghost_rule
from lipdp.clipped.per_example.scale import array_norms
from lipdp.foundation.layer_walk import nested_layers


# ----------------------------------------------------------------------- scope
def jax_rule(layer):
    """The ghost rule covering ``layer`` on the JAX step: the registry's rule
    (:func:`~lipdp.clipped.per_example.registry.find_ghost_rule`) if it defines the
    backend-neutral pieces (``product_factors``, ``apply_kernel``), else ``None``."""
    registration = find_ghost_rule(layer)
    if registration is None:
        return None
    rule = registration.rule
    for piece in ("product_factors", "apply_kernel"):
        if getattr(type(rule), piece) is getattr(GhostRule, piece):
            return None
    return rule


def ghost_layers(network, trainable_variables):
    """The layers the taps cover (:func:`jax_rule`: Dense, Conv2D), or ``None`` (with the
    reason as a string: ``(None, reason)``) when some trainable variable belongs to another
    layer."""
    covered, layers = set(), []
    for _, layer in nested_layers([network]):
        if not any(v.trainable for v in layer.weights):
            continue
        if jax_rule(layer) is not None:
            if any(id(v) in covered for v in own_variables(layer)):
                continue  # the same layer reached twice in the walk
            layers.append(layer)
            covered.update(id(v) for v in own_variables(layer))
    missing = [v for v in trainable_variables if id(v) not in covered]
    if missing:
        return None, (
            f"{missing[0].path!r} is not the kernel or bias of a layer whose ghost rule runs "
            "on JAX (Dense, Conv2D)"
        )
    return layers, None


def kernel_and_bias(layer):
    """``(kernel, bias or None)``: the variables the layer's rule covers."""
    rule = jax_rule(layer)
    return rule.kernel(layer), rule.bias(layer)


def own_variables(layer):
    """The variables the layer's rule covers: its kernel, then its bias if any."""
    kernel, bias = kernel_and_bias(layer)
    return [kernel] + ([bias] if bias is not None else [])


# ------------------------------------------------------------------------ taps
@dataclasses.dataclass
class Tap:
    """What one traced forward records (module docstring)."""

    values: dict  # id(layer) -> (kernel, bias or None): the values the taps compute with
    probes: list | None  # one per call in call order, or None (first trace: shapes)
    inputs: list = dataclasses.field(default_factory=list)  # (layer, a) per call
    outputs: list = dataclasses.field(default_factory=list)  # z per call (probes' shapes)

    def probe(self, z):
        index = len(self.outputs)
        self.outputs.append(z)
        return z if self.probes is None else z + self.probes[index]


def _tapped_call(layer, rule, tap):
    def call(inputs, *args, **kwargs):
        kernel, bias = tap.values[id(layer)]
        tap.inputs.append((layer, inputs))
        z = rule.apply_kernel(layer, inputs, kernel)
        if bias is not None:
            z = z + bias
        z = tap.probe(z)
        return rule.activation(layer, z)

    return call


@contextlib.contextmanager
def tapped(layers, tap):
    """Each layer's ``call`` replaced on the instance by its tapped computation, for the
    duration of the block (one trace)."""
    for layer in layers:
        object.__setattr__(layer, "call", _tapped_call(layer, jax_rule(layer), tap))
    try:
        yield tap
    finally:
        for layer in layers:
            object.__delattr__(layer, "call")


def uses_only_taps(function, sentinels, *args) -> bool:
    """Whether ``function(sentinels, *args)``'s jaxpr never reads ``sentinels`` (module
    docstring: every use of a trainable variable goes through a tap)."""
    import jax

    closed = jax.make_jaxpr(function)(sentinels, *args)
    count = len(jax.tree_util.tree_leaves(sentinels))
    watched = {id(v) for v in closed.jaxpr.invars[:count]}
    for eqn in closed.jaxpr.eqns:
        if any(id(v) in watched for v in eqn.invars):
            return False
    return not any(id(v) in watched for v in closed.jaxpr.outvars)


# ----------------------------------------------------------------- per layer
@dataclasses.dataclass
class _Factors:
    """One layer's recorded factors (positions of all its calls stacked)."""

    layer: object
    rule: object
    a: object  # (rows, T, d)
    g: object  # (rows, T, p)
    rows: object = None  # (rows, d, p) when materialised

    def norms(self):
        """Per-row norms of the kernel and bias gradients (a list of ``(rows,)``):
        :func:`lipdp.clipped.per_example.dense.product_norms` and the rule's bias rows."""
        kernel, self.rows = product_norms(self.a, self.g)
        out = [kernel]
        if self.rule.bias(self.layer) is not None:
            out.append(array_norms(self.rule.bias_rows(self.layer, self.g)))
        return out

    def sums(self, usable, scale):
        """``[sum_i k_i A_i^T G_i, sum_i k_i sum_t g_t]`` over the usable rows, the others
        selected out (module docstring); the kernel sum in the kernel's shape."""
        import jax.numpy as jnp

        def select(x):
            return jnp.where(jnp.reshape(usable, (-1,) + (1,) * (x.ndim - 1)), x, 0.0)

        g = select(self.g)
        if self.rows is not None:
            kernel = jnp.tensordot(scale, select(self.rows), axes=1, precision=EXACT)
        else:
            kernel = jnp.einsum(
                "btd,btp->dp", select(self.a), g * scale[:, None, None], precision=EXACT
            )
        out = [_kernel_shaped(self.layer, kernel)]
        if self.rule.bias(self.layer) is not None:
            bias = self.rule.bias_rows(self.layer, g)
            out.append(jnp.tensordot(scale, bias, axes=1, precision=EXACT))
        return out


def _kernel_shaped(layer, kernel):
    import jax.numpy as jnp

    return jnp.reshape(kernel, tuple(jax_rule(layer).kernel(layer).shape))


def factors(layers, inputs, cotangents):
    """A :class:`_Factors` per layer from the recorded ``(layer, a)`` per call (row axis
    first, then the batch of one of the row's forward) and the probes' cotangents, in call
    order: the rule's ``product_factors`` on the rows (the batch-of-one axis folded into
    the row axis)."""
    import jax.numpy as jnp

    per_layer = {id(layer): ([], []) for layer in layers}
    for (layer, a), g in zip(inputs, cotangents):
        rows = a.shape[0]
        a, g = jax_rule(layer).product_factors(
            layer,
            jnp.reshape(a, (-1,) + tuple(a.shape[2:])),
            jnp.reshape(g, (-1,) + tuple(g.shape[2:])),
        )
        a = jnp.reshape(a, (rows, -1, a.shape[-1])).astype("float32")
        g = jnp.reshape(g, (rows, -1, g.shape[-1])).astype("float32")
        per_layer[id(layer)][0].append(a)
        per_layer[id(layer)][1].append(g)
    out = []
    for layer in layers:
        a_list, g_list = per_layer[id(layer)]
        if not a_list:
            out.append(None)  # never called: a zero gradient
            continue
        a = a_list[0] if len(a_list) == 1 else jnp.concatenate(a_list, axis=1)
        g = g_list[0] if len(g_list) == 1 else jnp.concatenate(g_list, axis=1)
        out.append(_Factors(layer, jax_rule(layer), a, g))
    return out


__all__ = [
    "Tap",
    "factors",
    "ghost_layers",
    "jax_rule",
    "kernel_and_bias",
    "own_variables",
    "tapped",
    "uses_only_taps",
]
