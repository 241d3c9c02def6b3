r"""Ghost norms on the JAX step (``DPSGD_JaxModel(gradient_method="ghost")``): per-example
gradient norms and the clipped sum without per-example gradients of the whole network.

**Scope.** Every trainable variable of the network is the kernel or the bias of a
``keras.layers.Dense`` (exact class, no LoRA, not quantized) or of a ``keras.layers.Conv2D``
(exact class, ``channels_last``, ``groups=1``) -- :func:`ghost_layers`. Any other model
takes the ``vmap`` path for the whole step (:mod:`lipdp.clipped.jax.per_example`); the two
are never mixed.

**Interception.** While the forward pass is traced, each such layer's ``call`` is replaced,
on the instance and only for that trace (:func:`tapped`), by the layer's own computation
``z = a W + b`` (the convolution for ``Conv2D``) written out with the tap's values of ``W``
and ``b``, plus a *probe* ``p`` added to ``z`` before the activation; the tap records the
layer's input ``a``. Replacing ``call`` (not building the forward from the layer graph)
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
largest magnitude, as :func:`lipdp.clipped.jax.per_example.row_norms` does):

* ``T = 1`` (a ``Dense`` on ``(b, d)`` rows, called once): ``||a_i|| ||g_i||``, exact;
* else, when ``T (d + p) >= d p`` (every ``Conv2D``), ``A_i^T G_i`` is materialised per
  row (the arithmetic of the ``vmap`` path's per-example kernel gradient), and its rows
  give the clipped sum too;
* else the Grams ``<A_i A_i^T, G_i G_i^T>`` (``T^2 (d + p)`` per row) of the scaled
  factors, *plus a bound on their float32 round-off*: without ``float64`` (JAX's default)
  cancellation between positions could otherwise under-estimate the norm (a privacy leak).
  Each Gram entry is a dot product of length ``d`` (``p``) and the sum has ``T^2`` terms,
  so the computed value is within ``c (sum_t ||a_t|| ||g_t||)^2`` of the exact one with
  ``c = 2 (d + p + T^2 + 4) u`` (``u = 2^-24``; the factor 2 covers the rounding of the
  bound itself); the norm used is ``sqrt(computed + bound)``, an upper bound;
* biases: ``||sum_t g_t||``;
* the row's norm: the norm of the vector of these norms (scaled again).

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

import keras

from lipdp.core.layer_walk import nested_layers

#: Unit round-off of float32.
UNIT_ROUNDOFF = 2.0**-24

#: Precision of every product here: full float32 ("highest"). The bounds assume float32
#: round-off; on accelerators JAX's default may compute float32 products in bfloat16 or
#: TF32 passes, whose error (~1e-3) would exceed both the Gram round-off bound and the
#: slack between a row's bounded norm and the term it adds to the sum.
EXACT = "highest"


# ----------------------------------------------------------------------- scope
def _dense_ok(layer) -> bool:
    return (
        type(layer) is keras.layers.Dense
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
    )


def _conv_ok(layer) -> bool:
    return (
        type(layer) is keras.layers.Conv2D
        and layer.data_format == "channels_last"
        and layer.groups == 1
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
    )


def ghost_layers(network, trainable_variables):
    """The layers the taps cover (Dense, Conv2D), or ``None`` (with the reason as a string:
    ``(None, reason)``) when some trainable variable belongs to another layer."""
    covered, layers = set(), []
    for _, layer in nested_layers([network]):
        if not any(v.trainable for v in layer.weights):
            continue
        if _dense_ok(layer) or _conv_ok(layer):
            if any(id(v) in covered for v in own_variables(layer)):
                continue  # the same layer reached twice in the walk
            layers.append(layer)
            covered.update(id(v) for v in own_variables(layer))
    missing = [v for v in trainable_variables if id(v) not in covered]
    if missing:
        return None, f"{missing[0].path!r} is not the kernel or bias of a Dense or Conv2D"
    return layers, None


def own_variables(layer):
    return [layer.kernel] + ([layer.bias] if layer.bias is not None else [])


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


def _dense_call(layer, tap):
    def call(inputs, *args, **kwargs):
        kernel, bias = tap.values[id(layer)]
        tap.inputs.append((layer, inputs))
        z = keras.ops.matmul(inputs, kernel)
        if bias is not None:
            z = z + bias
        z = tap.probe(z)
        return z if layer.activation is None else layer.activation(z)

    return call


def _conv_call(layer, tap):
    def call(inputs, *args, **kwargs):
        kernel, bias = tap.values[id(layer)]
        tap.inputs.append((layer, inputs))
        z = layer.convolution_op(inputs, kernel)
        if bias is not None:
            z = z + bias
        z = tap.probe(z)
        return z if layer.activation is None else layer.activation(z)

    return call


@contextlib.contextmanager
def tapped(layers, tap):
    """Each layer's ``call`` replaced on the instance by its tapped computation, for the
    duration of the block (one trace)."""
    for layer in layers:
        wrapper = _dense_call(layer, tap) if _dense_ok(layer) else _conv_call(layer, tap)
        object.__setattr__(layer, "call", wrapper)
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
def _scaled(x, axes):
    """``(x / m, m)`` with ``m`` the largest ``|entry|`` over ``axes`` per row (1 where 0;
    NaN or infinity propagate to ``m``)."""
    import jax.numpy as jnp

    m = jnp.max(jnp.abs(x), axis=axes)
    safe = jnp.where((m > 0) & jnp.isfinite(m), m, 1.0)
    return x / jnp.reshape(safe, (-1,) + (1,) * (x.ndim - 1)), m


def _norm(x):
    """Per-row norm of ``(rows, ...)`` without overflow or underflow."""
    import jax.numpy as jnp

    axes = tuple(range(1, x.ndim))
    xs, m = _scaled(x, axes)
    return jnp.where(m > 0, m * jnp.sqrt(jnp.sum(jnp.square(xs), axis=axes)), m)


def materialise(positions, d, p) -> bool:
    """Materialise ``A_i^T G_i`` rather than go through the Grams (module docstring)."""
    return positions == 1 or positions * (d + p) >= d * p


def gram_norms(a, g):
    """An upper bound on ``||A_i^T G_i||_F`` for ``a: (rows, T, d)``, ``g: (rows, T, p)``
    from the Grams of the scaled factors plus their float32 round-off bound (module
    docstring)."""
    import jax.numpy as jnp

    rows, t, d = a.shape
    p = g.shape[2]
    an, ma = _scaled(a, (1, 2))
    gn, mg = _scaled(g, (1, 2))
    grams = jnp.einsum("btd,bsd->bts", an, an, precision=EXACT) * jnp.einsum(
        "btp,bsp->bts", gn, gn, precision=EXACT
    )
    computed = jnp.sum(grams, axis=(1, 2))
    triangle = jnp.sum(
        jnp.sqrt(jnp.sum(jnp.square(an), axis=2) * jnp.sum(jnp.square(gn), axis=2)), axis=1
    )
    c = 2.0 * (d + p + t * t + 4) * UNIT_ROUNDOFF
    bound = jnp.sqrt(jnp.maximum(computed, 0.0) + jnp.float32(c) * jnp.square(triangle))
    # NaN or infinity in a row: the bound is not finite.
    return jnp.where(jnp.isfinite(ma) & jnp.isfinite(mg), ma * mg * bound, ma * mg * jnp.nan)


@dataclasses.dataclass
class _Factors:
    """One layer's recorded factors (positions of all its calls stacked)."""

    layer: object
    a: object  # (rows, T, d)
    g: object  # (rows, T, p)
    rows: object = None  # (rows, d, p) when materialised

    def norms(self):
        """Per-row norms of the kernel and bias gradients (a list of ``(rows,)``)."""
        import jax.numpy as jnp

        t, d, p = self.a.shape[1], self.a.shape[2], self.g.shape[2]
        if t == 1:
            kernel = _norm(self.a[:, 0]) * _norm(self.g[:, 0])
        elif materialise(t, d, p):
            self.rows = jnp.einsum("btd,btp->bdp", self.a, self.g, precision=EXACT)
            kernel = _norm(self.rows)
        else:
            kernel = gram_norms(self.a, self.g)
        out = [kernel]
        if self.layer.bias is not None:
            out.append(_norm(jnp.sum(self.g, axis=1)))
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
        if self.layer.bias is not None:
            out.append(jnp.tensordot(scale, jnp.sum(g, axis=1), axes=1, precision=EXACT))
        return out


def _patches(layer, inputs):
    """``(rows, T, kh kw C)`` patches of a Conv2D's input, features ordered as the kernel's
    ``(kh, kw, C)`` axes."""
    import jax
    import jax.numpy as jnp

    kh, kw = layer.kernel_size
    c = inputs.shape[-1]
    patches = jax.lax.conv_general_dilated_patches(
        inputs,
        filter_shape=(kh, kw),
        window_strides=tuple(layer.strides),
        padding=layer.padding.upper(),
        rhs_dilation=tuple(layer.dilation_rate),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )  # features ordered (C, kh, kw)
    rows = patches.shape[0]
    patches = jnp.reshape(patches, (rows, -1, c, kh, kw))
    patches = jnp.transpose(patches, (0, 1, 3, 4, 2))
    return jnp.reshape(patches, (rows, -1, kh * kw * c))


def _kernel_shaped(layer, kernel):
    import jax.numpy as jnp

    return jnp.reshape(kernel, tuple(layer.kernel.shape))


def factors(layers, inputs, cotangents):
    """A :class:`_Factors` per layer from the recorded ``(layer, a)`` per call (row axis
    first) and the probes' cotangents, in call order."""
    import jax.numpy as jnp

    per_layer = {id(layer): ([], []) for layer in layers}
    for (layer, a), g in zip(inputs, cotangents):
        rows = a.shape[0]
        if _conv_ok(layer):
            a = _patches(layer, jnp.reshape(a, (-1,) + tuple(a.shape[-3:])))
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
        out.append(_Factors(layer, a, g))
    return out


__all__ = [
    "UNIT_ROUNDOFF",
    "Tap",
    "factors",
    "own_variables",
    "ghost_layers",
    "gram_norms",
    "tapped",
    "uses_only_taps",
]
