r"""The per-example engine: norms and clipped gradient sums for a chain of Keras layers.

Clipped DP-SGD (:mod:`lipdp.clipped.model`) needs, for every row ``i`` of a batch and every layer
``l`` with trainable variables, the squared norm ``||g_il||^2`` of the row's gradient for
that layer's variables; the clipping rule turns them into factors ``C_il``; the step
releases ``sum_i C_il g_il`` per layer. Two methods compute the same numbers (tested
against a naive loop of one ``GradientTape`` per row):

``"jacobian"``
    The Jacobian of the vector of per-row losses (``tape.jacobian``, vectorised with
    ``pfor``): every per-example gradient is materialised, ``b x (number of
    parameters)`` floats. The reference, and the method for any layer.

``"ghost"`` (the default; "book-keeping" of Bu et al. 2023 with the ghost norms of
Goodfellow 2015 and Li et al. 2022)
    One forward pass records each weighted layer's input ``A`` and *pre-activation* output
    ``Z``; one backward pass of ``sum_i loss_i`` gives the cotangents ``G = d sum/dZ``,
    whose row ``i`` is ``d loss_i / dZ_i`` because no layer couples the rows (batch
    normalisation is refused). Then, per row (``G`` below is the *unit* cotangent
    ``G_i / s_i`` of the next section):

    * a layer with a ghost rule (:mod:`lipdp.clipped.per_example.registry`, looked up by
      its Keras class): its kernel's squared norm from the rule's identity in ``A_i`` and
      ``G_i`` (or its materialised gradient, where the rule finds that cheaper), its bias
      from ``sum_t G_it``. The built-in rules and their identities:
      :mod:`~lipdp.clipped.per_example.dense` (``||a_i||^2 ||g_i||^2``; on sequences the
      ``T x T`` Grams ``<A_i A_i^T, G_i G_i^T>``),
      :mod:`~lipdp.clipped.per_example.convolution` (``Conv2D``: a Dense on input
      patches), :mod:`~lipdp.clipped.per_example.embedding` (``sum_{t,s} [id_t = id_s]
      <G_it, G_is>``). Supporting another layer is one rule registered for its class:
      nothing here changes.
    * any other layer with variables (normalisations, depthwise and grouped convolutions,
      recurrent layers, wrappers, nested models that are not a chain, subclasses of
      ``Dense``, ``Conv2D``, ``Embedding``): its per-example gradients from a vectorised
      map of the layer's own vector-Jacobian product ``(a_i, g_i) -> grad`` (each row with
      its Keras mask); materialised for that layer only (:func:`row_loop_layers` names the
      layers whose ops ``pfor`` cannot vectorise: they run the same map as a loop). Under
      the vectorised map each row runs as a batch of two copies of itself, the second
      with cotangent 0 (:func:`_row_copies`): a batch of one feeds oneDNN's matmul the
      shapes it corrupts memory on (attention layers: the process aborted, or norms came
      out wrong).
    * a nested model that is a chain -- a ``Sequential``, or a functional model whose
      layers each take the previous layer's output alone, at any depth: how pretrained
      backbones arrive -- is run layer by layer, each layer inside treated by the rules
      above (a frozen one runs as is). Its parts' squared norms are summed into the
      nested model's: clipping keeps one norm (one radius, one factor) per layer *of the
      model*, ``sum_parts ||g_i,part||^2`` being the squared norm of the row's gradient
      for all the nested model's variables. A layer inside that reads a variable of
      another one (weight tying without tracking) makes the nested model run as one
      layer instead. (A CNN backbone on the fallback as one layer took 2.0-2.5x the
      step time: :mod:`lipdp.clipped.model`.)

    The clipped sum of a ghost kernel is the vector-Jacobian product of the rule's linear
    map with the cotangents ``C_il G_i`` (a layer-local second backward pass, rows dropped
    by the clipping zeroed in both ``A`` and ``G``): no per-example gradient of those
    layers is materialised; where the rule materialised them (cheaper), they give the
    clipped sum ``sum_i C_il grad_W,i`` directly and the second backward pass is skipped.
    Biases are summed from their per-row gradients ``sum_t G_it`` (``b x p`` floats).

**Scale: norms that cannot underflow or overflow** (rule S13). A finite record can put
a row's quantities far from 1: with inputs of ``1e-19`` and a cotangent of ``1e19`` a
Dense kernel's gradient has entries near 1, but its ghost norm ``||a_i||^2 ||g_i||^2``
squares the inputs to ``1e-38``, which the CPU flushes to zero in float32: the norm read
0 and the row was never clipped. Every per-row quantity is therefore carried as a scale
times a unit part:

* the row's cotangents are divided by ``s_i = max |G_i|`` (exact in float32; 1 for a zero
  row): the unit cotangent ``U_i = G_i / s_i`` has entries in ``[-1, 1]`` (a batch whose
  every ``max |G_i|`` is in ``[2^-24, 2^8]`` keeps ``s_i = 1``, ``U = G``: the same range
  guarantee, :func:`lipdp.clipped.per_example.scale.unit_rows`). Every
  gradient is linear in the cotangent, so row ``i``'s gradient of each part (a ghost
  kernel, a bias, a materialised or a fallback layer's variables) is ``s_i u_i`` with
  ``u_i`` computed from ``A_i`` and ``U_i`` (the Jacobian method: ``s_i = 1``,
  ``u_i`` the row's gradient);
* ``||g_i||^2 = s_i^2 ||u_i||^2`` is formed in float64 (squares of float32 entries, Grams
  in float64), summed over parts and layers and turned into factors in float64: its
  range (``1e-308`` to ``1e308``) holds every such product for inputs and cotangents of
  magnitude ``1e-30`` to ``1e30`` (and beyond), so a norm is never read as 0 or inf
  because of its scale. The ghost norms are exact over that range, so is the fallback
  wherever the layer's own float32 backward pass is for a unit cotangent (any linear
  layer: convolutions, dense subclasses); the Jacobian method is exact where the row's
  gradient is a normal float32 number (one that overflows float32 is inf: the row gets
  factor 0; ``tests/clipped/test_extreme_records.py``);
* the factor is applied as the float32 coefficient ``k_i = C_i s_i`` of the unit part:
  the released contribution is ``k_i u_i`` (the cotangents ``k_i U_i`` of the
  layer-local backward pass, or ``sum_i k_i u_i`` of materialised rows), whose entries
  are those of the clipped gradient: ``C_i G_i`` is never formed in float32.

**Why each released contribution has norm at most R.** The clipping rule gives factors
with ``C_i ||g_i|| <= R`` in float64 arithmetic (:class:`lipdp.clipped.model.Clipping`), from
``||g_i||^2 = sum_parts s_i^2 ||u_i||^2`` (per layer under per-layer clipping).
``k_i = C_i s_i`` is rounded once to float32 (relative error ``<= 2^-24``) when it lies
in float32's normal range ``[1.2e-38, 3.4e38]``; otherwise it is replaced by 0: that
part contributes nothing, which is within any bound (below the range its contribution is
under float32's smallest normal number anyway; a denormal coefficient would be rounded
by up to 100%). A row whose
squared norm is NaN or infinite (a non-finite input, activation or cotangent, or a
gradient beyond float32 in the Jacobian method) gets factor 0 and its inputs and
cotangents are zeroed. For materialised parts the released ``k_i u_i`` is computed from
the very float32 tensor whose norm was measured, so ``||k_i u_i|| <= C_i ||g_i|| (1 +
2^-24) <= R (1 + 2^-24)``. For ghost kernels ``k_i u_i`` is recomputed by the layer's
float32 backward pass; it equals the measured ``u_i`` up to that pass's round-off over
the ``T`` positions of the row (relative ``~T 2^-24`` times ``sum_t ||a_t|| ||g_t|| /
||A_i^T G_i|| >= 1``, near 1 unless the positions cancel): the precondition, shared with
every float32 gradient the library computes, is that this round-off stays within the
slack. The sum over rows adds float32 round-off;
both are what ``ROUNDOFF_SLACK`` (:mod:`lipdp.clipless.bounds`) covers.

A variable shared by two layers would make a row's gradient the sum of two parts whose
norms are computed separately; :func:`weighted_layers` refuses it, and the ghost method
refuses a layer that reads, in its call, a trainable variable of another layer
(:func:`refuse_untracked_reads`) and a per-example loss that reads a trainable variable
of the model itself, e.g. a weight penalty written inside the loss
(:func:`refuse_loss_reads`): the cotangents of the layers' outputs do not carry those
uses. The Jacobian method differentiates every use: a penalty inside the loss is part of
each row's gradient, clipped with it (sound, though it then scales with the number of
rows sampled; a ``kernel_regularizer`` is added outside the clipped sum instead).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import keras
import tensorflow as tf

from lipdp.clipped.per_example.registry import FALLBACK, GhostRule, find_ghost_rule
from lipdp.clipped.per_example.scale import (
    float32_coefficients as _float32_coefficients,
)
from lipdp.clipped.per_example.scale import scaled as _scaled
from lipdp.clipped.per_example.scale import square_sums as _square_sums
from lipdp.clipped.per_example.scale import unit_rows as _unit_rows
from lipdp.core import isolation
from lipdp.core.records import zero_rows
from lipdp.foundation import compat, validation
from lipdp.foundation.tf_notices import pfor_loop_notice_filtered
from lipdp.foundation.variables import as_one_of, variable_key

#: How per-example gradients are obtained (module docstring).
GRADIENT_METHODS = ("ghost", "jacobian")


# ------------------------------------------------------------------------ structure
def weighted_layers(layers) -> list:
    """The layers with trainable variables, in order; a variable may belong to one only."""
    result, owner = [], {}
    for layer in layers:
        variables = layer.trainable_variables
        for v in variables:
            if variable_key(v) in owner and owner[variable_key(v)] is not layer:
                raise ValueError(
                    f"Variable {compat.variable_path(v)!r} is shared by layers "
                    f"{owner[variable_key(v)].name!r} and {layer.name!r}: per-example norms "
                    "would be computed per part. Use separate variables."
                )
            owner[variable_key(v)] = layer
        if variables:
            result.append(layer)
    return result


class _UntrackedRead(ValueError):
    """A layer reads a trainable variable of another layer without tracking it (a plain
    ValueError once out of :func:`_recorded_forward`: autograph re-raises only the
    built-in exception classes as they are)."""


def refuse_untracked_reads(layer, read, owners) -> None:
    """Refuse ``layer`` if it read (``read``: the trainable variables a tape watched during
    its call) a variable of another layer (``owners``: ``{key of the watched variable:
    owning layer}`` of the model, :func:`_variable_owners`): ghost norms would drop that
    use's share of the gradient. (Inside a nested chain model, the model is then run as
    one layer instead: :func:`_recorded_forward`.)"""
    own = {_watched_key(v) for v in layer.trainable_variables}
    for v in read:
        owner = owners.get(_watched_key(v))
        if owner is not None and _watched_key(v) not in own:
            raise _UntrackedRead(
                f"Layer {layer.name!r} reads variable {v.name!r} of layer {owner.name!r} "
                "without tracking it: ghost norms would drop that use's gradient. Make one "
                "layer own both uses, or use gradient_method='jacobian'."
            )


def refuse_loss_reads(read, owners) -> None:
    """Refuse a per-example loss that read (``read``: the trainable variables a tape
    watched while the losses were computed) a variable of the model (``owners``), e.g. a
    weight penalty written inside the loss: ghost norms take each row's gradient from the
    cotangents of the layers' outputs and would drop that path. (The Jacobian method
    differentiates the row's whole loss: the penalty's gradient is part of each row's
    clipped gradient.)"""
    for v in read:
        owner = owners.get(_watched_key(v))
        if owner is not None:
            v = as_one_of(v, owner.trainable_variables)  # its Keras name
            raise ValueError(
                f"The loss reads variable {v.name!r} of layer {owner.name!r} directly: ghost "
                "norms would drop that use's gradient. Penalise the weights with a "
                "kernel_regularizer (added outside the clipped sum), or use "
                "gradient_method='jacobian' (the penalty is then clipped with each row)."
            )


def _watched_key(variable):
    """The key of ``variable`` among the variables a tape watched (on Keras 3 a tape
    watches a Keras variable's backing ``tf.Variable``:
    :func:`lipdp.foundation.compat.tape_variable`)."""
    return variable_key(compat.tape_variable(variable))


def _variable_owners(model) -> dict:
    """``{key of the watched variable: layer}`` (:func:`_watched_key`) for every trainable
    variable of the model, the layer being the innermost one a ghost pass runs (nested
    chains expanded)."""
    return {
        _watched_key(v): leaf
        for layer in model.layers_forward_order()
        for leaf in _leaves(layer)
        for v in leaf.trainable_variables
    }


def _functional_chain(model) -> list | None:
    """The layers of a functional model in call order if its graph is one chain (each
    layer called once on the previous layer's output alone, no other argument, from the
    one input to the one output), else ``None``."""
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        return None
    reader = {}  # id of a tensor -> the node that reads it
    for nodes in model._nodes_by_depth.values():  # noqa: SLF001 - the functional graph
        for node in nodes:
            if node.is_input:
                continue
            single = _single_argument(node)
            if single is None or id(single) in reader:
                return None  # other arguments, or a tensor read twice: a branch
            reader[id(single)] = node
    chain, tensor = [], model.inputs[0]
    while id(tensor) in reader:
        node = reader.pop(id(tensor))
        layer, tensor = _node_layer_and_output(node)
        chain.append(layer)
    return chain if not reader and tensor is model.outputs[0] else None


def _single_argument(node):
    """The tensor a functional graph's node called its layer on, if it is the call's only
    argument (no keyword either), else ``None``. (Keras 3's nodes keep the call's
    arguments, with a ``mask`` Keras may have filled in: ``None`` or the input's own mask,
    which a call on the input alone passes too; Keras 2's nodes say whether a single
    positional tensor was passed.)"""
    if compat.keras_3():
        args, kwargs = node.arguments.args, dict(node.arguments.kwargs)
        if len(args) != 1 or not isinstance(args[0], keras.KerasTensor):
            return None
        mask = kwargs.pop("mask", None)
        if kwargs or (mask is not None and mask is not getattr(args[0], "_keras_mask", None)):
            return None
        return args[0]
    if not node._single_positional_tensor_passed:  # noqa: SLF001 - Keras 2's node
        return None
    return node.call_args[0]


def _node_layer_and_output(node):
    """``(layer, output)`` of a functional graph's node (Keras 3: output ``None`` if
    several; Keras 2: its nest, which no node reads as a single tensor)."""
    if compat.keras_3():
        outputs = node.outputs  # a flat list
        return node.operation, outputs[0] if len(outputs) == 1 else None
    return node.layer, node.outputs


def _chain_layers(layer) -> list | None:
    """The layers of ``layer`` in call order if it is a nested model that only runs them
    one after the other -- an exact ``keras.Sequential``, or Keras' own functional
    class whose graph is one chain (:func:`_functional_chain`) -- their trainable
    variables are all of its own and no layer is met twice once every nested chain is
    expanded; else ``None``: ``layer`` runs as one layer (branches, merges, several inputs
    or outputs, subclassed models, wrappers). Exact classes: a subclass may change
    ``call``."""
    if type(layer) is keras.Sequential:
        chain = layer.layers
    elif type(layer).__name__ == "Functional" and _is_graph(layer):
        chain = _functional_chain(layer)
    else:
        return None
    if not chain:
        return None
    own = {variable_key(v) for v in layer.trainable_variables}
    covered = {variable_key(v) for sub in chain for v in sub.trainable_variables}
    leaves = [leaf for sub in chain for leaf in _leaves(sub)]
    if own != covered or len({id(leaf) for leaf in leaves}) != len(leaves):
        return None
    return chain


def _is_graph(model) -> bool:
    """Is a ``Functional`` model a graph of layers? (Keras 3's always is; Keras 2's is
    unless built by subclassing.)"""
    return compat.keras_3() or getattr(model, "_is_graph_network", False)


def _leaves(layer) -> list:
    """``layer`` with every nested chain model expanded into its layers, recursively."""
    chain = _chain_layers(layer)
    return [layer] if chain is None else [leaf for sub in chain for leaf in _leaves(sub)]


def _needs_row_loop(layer) -> bool:
    """Does ``layer`` (or a layer inside it) run ops that ``pfor`` cannot vectorise?
    Keras' fused LSTM/GRU kernels (a TensorList inside a function: pfor fails while
    converting their gradient) and grouped convolutions (TF 2.15's pfor converter of the
    filter gradient returns wrong per-row values in a Jacobian, and the CPU has no kernel
    for the per-row 3-D op it falls back to)."""
    layers = keras.layers
    convolutions = (layers.Conv1D, layers.Conv2D, layers.Conv3D)  # and their transposes
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001 - Keras' walk
        if isinstance(sub, (layers.LSTM, layers.GRU)) and _may_run_fused_kernel(sub):
            return True
        if isinstance(sub, convolutions) and sub.groups > 1:
            return True
    return False


def _may_run_fused_kernel(recurrent) -> bool:
    """May an LSTM or GRU run Keras' fused kernel? Keras 2: its own flag (set whenever
    the configuration allows the kernel, on any device). Keras 3 runs cuDNN only on a
    GPU (``use_cudnn="auto"``), its plain loop elsewhere: the kernel is possible when the
    layer allows it and a GPU is visible (the exact test is Keras' private one)."""
    if not compat.keras_3():
        return bool(recurrent._could_use_gpu_kernel)  # noqa: SLF001
    return recurrent.use_cudnn is True or (
        recurrent.use_cudnn == "auto" and bool(tf.config.list_logical_devices("GPU"))
    )


def row_loop_layers(layers) -> list:
    """The layers among ``layers`` whose per-example gradients are computed by a loop
    over rows (``tf.map_fn``) rather than ``tf.vectorized_map``: same numbers, ``b``
    sequential iterations (:func:`_needs_row_loop`)."""
    return [layer for layer in layers if _needs_row_loop(layer)]


@dataclass
class _Record:
    """One weighted layer seen by a forward pass (nested chains expanded): its input,
    its (pre-activation) output on the tape, the name of its ghost rule (``"vectorized"``:
    the fallback), the layer of the model it belongs to (``group``: itself, or the nested
    model holding it), the rule itself (``None``: the fallback); after the backward
    pass, the output cotangents ``G``, their per-row scales ``s`` and unit cotangents ``U
    = G / s`` (module docstring), the parts that give the norms and the clipped sums and,
    for the vectorised fallback and the materialised ghost branch, the per-row gradients
    for the unit cotangents."""

    layer: keras.layers.Layer
    inputs: tf.Tensor
    outputs: tf.Tensor
    rule: str
    group: keras.layers.Layer
    ghost: GhostRule | None = None
    cotangents: tf.Tensor | None = None
    scales: tf.Tensor | None = None
    unit: tf.Tensor | None = None
    per_row: list | None = None
    parts: list | None = None


@dataclass
class Ascent:
    """A per-row step ``theta_i' = theta + s_i g_i`` (BAM's ascent, ``s_i = lambda /
    ||g_i||``, float64 ``scales``): ``first`` holds the rows' gradients ``g_i`` at
    ``theta`` (its records), and the second pass runs every weighted layer at its
    row-wise shifted weights."""

    first: PerExampleGradients
    scales: tf.Tensor


def _recorded_forward(model, x, records, ascent=None):
    """The model's forward loop, with each weighted layer split into its linear part
    (recorded) and its activation, and nested chain models run layer by layer
    (:func:`_chain_layers`: the same calls as their own ``call``, so that each layer
    inside gets its own rule); under an :class:`Ascent`, each weighted layer of row ``i``
    runs at ``W + s_i grad_W loss_i`` (the gradient at ``theta``, held constant). Layers
    run by their own call are watched: one that reads another layer's variable is
    refused (:func:`refuse_untracked_reads`), unless both are inside one nested chain
    model: that model then runs as one layer (its fallback differentiates every use)."""
    owners = _variable_owners(model)
    isolated = isolates_rows(model)

    def watched_call(layer, h, kwargs):
        with tf.GradientTape() as probe:  # records which trainable variables the call reads
            if isolated:
                out = model.isolated_layer_call(layer, h, True, kwargs)
            else:
                out = layer(h, training=True, **kwargs)
        refuse_untracked_reads(layer, probe.watched_variables(), owners)
        return out

    def activation(layer, rule, z):
        if not isolated:
            return rule.activation(layer, z)
        return isolation.isolated_call(
            lambda batch: rule.activation(layer, batch),
            z,
            what=f"The activation of {_describe(layer)}",
            layers=[layer],
        )

    def apply(layer, h, kwargs, group=None):
        if not layer.built:
            layer(h, training=True, **kwargs)  # creates the variables read below
        if not layer.trainable_variables:
            return watched_call(layer, h, kwargs)
        group = layer if group is None else group
        # BAM's second pass: the first pass's record of this layer (same order), whose
        # split into nested layers it follows.
        first = ascent.first.records[len(records)] if ascent is not None else None
        chain = _chain_layers(layer) if tf.is_tensor(h) else None
        if chain is not None and (first is None or first.layer is not layer):
            start = len(records)
            try:
                out = _as_model_input(layer, h)
                for sub in chain:
                    out = apply(sub, out, {}, group)
                return out
            except _UntrackedRead:  # between two of its layers: run it as one layer
                del records[start:]
        registration = find_ghost_rule(layer)
        if isolated and registration is not None and not _lipdp_rule(registration.rule):
            registration = None  # a user's rule is code of its own: the per-row fallback
        if registration is None and first is None:
            out = watched_call(layer, h, kwargs)
            records.append(_Record(layer, h, out, FALLBACK, group))
            return out
        if registration is None:
            out = _shifted_call(first, h, ascent.scales, isolated)
            records.append(_Record(layer, h, out, FALLBACK, group))
            return _masked_like_keras(layer, h, out)
        rule = registration.rule
        _refuse_partial_rule(registration, layer)
        z = rule.linear(layer, h)
        if first is not None:
            z = z + _ghost_shift(first, h, _float32_coefficients(ascent.scales))
        records.append(_Record(layer, h, z, registration.name, group, rule))
        return _masked_like_keras(layer, h, activation(layer, rule, z))

    try:
        return model.forward(x, training=True, apply=apply)
    except _UntrackedRead as error:
        raise ValueError(str(error)) from None


def isolates_rows(model) -> bool:
    """Whether ``model`` computes each row's loss in isolation (``row_isolation``,
    :mod:`lipdp.core.isolation`): every layer it runs by its own call, every activation
    and the loss run one row at a time; the linear parts of lipdp's own ghost rules run
    on the batch (:func:`_lipdp_rule`)."""
    return bool(getattr(model, "row_isolation", False))


def _lipdp_rule(rule) -> bool:
    """A ghost rule of lipdp's own (:mod:`~lipdp.clipped.per_example.dense`,
    :mod:`~lipdp.clipped.per_example.convolution`, :mod:`~lipdp.clipped.per_example.embedding`):
    its linear map, norms and clipped sums treat each row on its own. Under row isolation a
    layer covered by another rule takes the per-row fallback: its norms and sums come from
    the row's own gradient, whatever the rule computes."""
    return type(rule).__module__.startswith("lipdp.clipped.per_example.")


def _describe(layer) -> str:
    return f"Layer {layer.name!r} ({type(layer).__name__})"


def _rule_variables(rule, layer) -> list:
    """The variables a ghost rule covers: its kernel, then its bias if any."""
    bias = rule.bias(layer)
    return [rule.kernel(layer)] + ([] if bias is None else [bias])


def _refuse_partial_rule(registration, layer) -> None:
    """Refuse a rule whose kernel and bias are not exactly the layer's trainable
    variables: a variable it does not cover would be missing from the row's norm."""
    covered = _rule_variables(registration.rule, layer)
    trained = layer.trainable_variables
    refs = {variable_key(v) for v in covered}
    if len(refs) != len(covered) or refs != {variable_key(v) for v in trained}:
        covered_names = [compat.variable_path(v) for v in covered]
        trained_names = [compat.variable_path(v) for v in trained]
        raise ValueError(
            f"Ghost rule {registration.name!r} covers {covered_names} of layer "
            f"{layer.name!r}, which trains {trained_names}: fix the rule's "
            "kernel/bias, or unregister it (the fallback differentiates every variable)."
        )


def _as_model_input(model, h):
    """``h`` conformed to a graph model's ``Input`` (dtype, a trailing axis of size 1) as
    its own call does first; a ``Sequential`` never built as a graph passes ``h`` on."""
    return compat.conformed_to_model_input(model, h)


def _masked_like_keras(layer, inputs, outputs):
    """``outputs`` with the Keras mask ``layer.__call__`` would attach (masking layers
    downstream, e.g. pooling after ``Embedding(mask_zero=True)``, read it). Keras 3
    attaches none for a layer that does not support masking."""
    if compat.keras_3() and not layer.supports_masking:
        return outputs
    mask = layer.compute_mask(inputs, getattr(inputs, "_keras_mask", None))
    if mask is not None:
        outputs._keras_mask = mask  # noqa: SLF001 - Keras 2's mask convention
    return outputs


def _unkept_zeroed(keep, tensors) -> dict:
    """``{id(t): t with the rows where keep is False zeroed}`` for each of ``tensors``
    (:func:`lipdp.core.records.zero_rows`: a NaN times a factor 0 would stay NaN); the
    tensors themselves when every row is kept (the same values, without a pass over them:
    issue 39). One ``tf.cond`` for all of them: each cond traces two branch functions
    (about 5 ms when a step is traced; one per tensor was 3 % of the tests' time). The
    cost: when a row is dropped (a non-finite or invalid record), every zeroed copy is
    alive at once, at most the per-row tensors' size again, where one cond per tensor
    could free each copy after its use. Keyed by ``id``: the callers hold the tensors; an
    ``IndexedSlices`` is made dense."""
    unique = {id(t): t for t in tensors}
    if not unique:
        return {}
    keys = list(unique)
    values = [tf.convert_to_tensor(t) for t in unique.values()]
    zeroed = tf.cond(
        tf.reduce_all(keep),
        lambda: [tf.identity(t) for t in values],
        lambda: [zero_rows(keep, t) for t in values],
    )
    return dict(zip(keys, zeroed))


@dataclass
class _RowsPart:
    """Variables whose per-row gradients are materialised: row ``i``'s gradient of
    ``variables[j]`` is ``scales[i] * tensors[j][i]`` (``scales`` ``None``: 1)."""

    variables: list
    tensors: list
    scales: tf.Tensor | None = None

    def sq_norms(self):
        sq = _square_sums(self.tensors)
        return sq if self.scales is None else sq * tf.square(tf.cast(self.scales, tf.float64))

    def rows_to_zero(self) -> list:
        return list(self.tensors)

    def clipped_sums(self, factors, keep, zeroed) -> dict:
        """``zeroed``: :func:`_unkept_zeroed` of :meth:`rows_to_zero`."""
        k = factors if self.scales is None else factors * tf.cast(self.scales, tf.float64)
        k = _float32_coefficients(k, keep)
        return {
            variable_key(v): tf.tensordot(k, zeroed[id(t)], [[0], [0]])
            for v, t in zip(self.variables, self.tensors)
        }


@dataclass
class _GhostKernelPart:
    """A ghost rule's kernel: row ``i``'s gradient is ``s_i`` times the gradient of the
    linear map at ``A_i`` for the unit cotangent ``U_i``, of squared norm ``unit_sq[i]``
    (float64); the clipped sum is the layer-local VJP with cotangents ``k_i U_i``."""

    record: _Record
    unit_sq: tf.Tensor

    def sq_norms(self):
        return self.unit_sq * tf.square(tf.cast(self.record.scales, tf.float64))

    def rows_to_zero(self) -> list:
        return [self.record.unit, self.record.inputs]

    def clipped_sums(self, factors, keep, zeroed) -> dict:
        """``zeroed``: :func:`_unkept_zeroed` of :meth:`rows_to_zero`."""
        record = self.record
        k = _float32_coefficients(factors * tf.cast(record.scales, tf.float64), keep)
        cotangents = _scaled(k, zeroed[id(record.unit)])
        kernel = record.ghost.kernel(record.layer)
        return {variable_key(kernel): _local_vjp(record, zeroed[id(record.inputs)], cotangents)}


# --------------------------------------------------------------------- ghost norms
def _ghost_parts(record) -> list:
    """The parts of a ghost-rule layer: its materialised rows where the rule finds them
    cheaper, else the ghost kernel; and the bias rows ``sum_t U_it``."""
    layer, rule, unit = record.layer, record.ghost, record.unit
    bias = rule.bias(layer)
    kernel_rows = rule.kernel_rows(layer, record.inputs, unit)
    if kernel_rows is not None:
        record.per_row = [kernel_rows] + ([] if bias is None else [rule.bias_rows(layer, unit)])
        return [_RowsPart(_rule_variables(rule, layer), record.per_row, record.scales)]
    unit_sq = rule.kernel_sq_norms(layer, record.inputs, unit)
    if unit_sq.dtype != tf.float64:
        raise TypeError(
            f"Ghost rule {record.rule!r} gave {unit_sq.dtype.name} squared norms for layer "
            f"{layer.name!r}: they must be float64 (float32 squares underflow, rule S13)."
        )
    parts = [_GhostKernelPart(record, unit_sq)]
    if bias is not None:
        parts.append(_RowsPart([bias], [rule.bias_rows(layer, unit)], record.scales))
    return parts


# ------------------------------------------------------- row-wise shifted weights (BAM)
def _ascent_row_scales(scales, record):
    """BAM's ``lambda / ||g_i||`` times the record's cotangent scales ``s_i`` (its per-row
    gradients are kept for the unit cotangents), as float32 coefficients."""
    return _float32_coefficients(tf.cast(scales, tf.float64) * tf.cast(record.scales, tf.float64))


def _ghost_shift(first, a_new, coefficients):
    """``k_i (f(a'_i; grad_W,i) + grad_b,i)``: the change of a ghost-rule layer's output
    at ``W + k_i grad_i`` (the rule's :meth:`~GhostRule.shift`), ``grad_i`` the first
    pass's gradient of row ``i`` held constant: its input and cotangents (not the unit
    ones), and its materialised kernel rows when it has them (times their scales)."""
    a, g = tf.stop_gradient(first.inputs), tf.stop_gradient(first.cotangents)
    kernel_rows = None
    if first.per_row is not None:
        kernel_rows = _scaled(first.scales, tf.stop_gradient(first.per_row[0]))
    return _scaled(coefficients, first.ghost.shift(first.layer, a_new, a, g, kernel_rows))


def _variable_slots(layer) -> list:
    """``(object, attribute)`` holding each trainable variable of ``layer`` (or of a
    sub-layer), to run the layer on other weights."""
    slots = {}
    for sub in layer._flatten_layers(include_self=True):  # noqa: SLF001 - Keras' walk
        for name, value in vars(sub).items():
            if compat.is_variable(value):
                slots.setdefault(variable_key(value), (sub, name))
    missing = [
        compat.variable_path(v) for v in layer.trainable_variables if variable_key(v) not in slots
    ]
    if missing:
        raise ValueError(
            f"Cannot run layer {layer.name!r} on row-wise weights: variables {missing} are "
            "not held as layer attributes. Use per-example ascent only with layers that "
            "store their variables as attributes (all built-in Keras layers do)."
        )
    return [slots[variable_key(v)] for v in layer.trainable_variables]


@contextlib.contextmanager
def _weights_replaced(slots, tensors):
    """Within the block the layer reads ``tensors`` instead of its variables. Plain
    ``object.__setattr__``: Keras' attribute tracking would reorder the layer's weights."""
    saved = [getattr(owner, name) for owner, name in slots]
    for (owner, name), tensor in zip(slots, tensors):
        object.__setattr__(owner, name, tensor)
    try:
        yield
    finally:
        for (owner, name), variable in zip(slots, saved):
            object.__setattr__(owner, name, variable)


def _row_inputs(h, **per_row):
    """The rows to map over: ``inputs`` (``h``), its Keras mask if it has one (the
    layer's call reads it, as in the batch's forward pass) and ``per_row`` tensors."""
    rows = {"inputs": h, **per_row}
    mask = getattr(h, "_keras_mask", None)
    if mask is not None:
        rows["mask"] = mask
    return rows


def _one_row_call(layer, row):
    """``layer`` on ``row["inputs"]`` (a nest of tensors for a model of several inputs;
    with its mask) as a batch of :func:`_row_copies` copies of the row: the output of the
    first copy. The other copies' outputs are not used, so their cotangent is 0 and the
    gradient of the layer is the row's own (the rows of a batch do not interact: rule S2)."""
    copies = _row_copies(layer)
    a = tf.nest.map_structure(lambda t: tf.stack([t] * copies), row["inputs"])
    if "mask" in row:
        a._keras_mask = tf.stack([row["mask"]] * copies)  # noqa: SLF001 - Keras 2's mask
    return layer(a, training=True)[0]


def _row_copies(layer) -> int:
    """How many copies of a row the fallback runs ``layer`` on: 2 under
    ``tf.vectorized_map`` where TensorFlow's oneDNN kernels are on, else 1.

    Why not one: ``pfor`` turns a per-row tensor ``(1, T, d)`` into ``(b, 1, T, d)``, so a
    per-row product with a weight ``(1, T, d) @ (d, p)`` -- the projections of Keras'
    ``EinsumDense`` and ``MultiHeadAttention`` (Keras' ``einsum`` calls ``tf.matmul``
    there), a user's attention written with ``tf.matmul`` -- becomes a ``BatchMatMulV2``
    of ``(b, 1, T, d)`` and a ``(d, p)`` broadcast over the batch axes. oneDNN's matmul
    (TensorFlow 2.21 on CPU; not 2.15) mishandles a rank-4 left operand whose second axis
    is 1 against a right operand broadcast over both batch axes (tensorflow/tensorflow
    issues 117700 and 123109): it writes out of bounds -- the process aborts or segfaults
    (``MultiHeadAttention``, a keras-hub ViT) -- or returns wrong numbers without a word
    (per-row squared norms 5 and 32 times too small on batches of 4 and 6). With two copies that
    axis is 2, which oneDNN computes right, at the cost of running the layer's per-row
    pass on two rows. A loop over rows (:func:`_needs_row_loop`) runs each row in the
    shapes of a plain call on a batch of one and needs no copy; nor does TensorFlow
    without oneDNN (``TF_ENABLE_ONEDNN_OPTS=0``, which TensorFlow reads at start; lipdp
    sets no variable). Still exposed: a layer whose per-row computation itself puts a
    leading axis of size 1 (other than the batch) in front of such a product."""
    if _needs_row_loop(layer) or not _onednn_enabled():
        return 1
    return 2


@functools.cache
def _onednn_enabled() -> bool:
    """Are TensorFlow's oneDNN kernels on? TensorFlow's own report (``True`` where it
    gives none)."""
    try:
        from tensorflow.python.util import _pywrap_util_port  # no public name
    except ImportError:  # pragma: no cover - a TensorFlow without the report
        return True
    return bool(_pywrap_util_port.IsMklEnabled())


def _row_call(layer, slots, row, weights):
    """``layer`` on one row with its variables replaced by ``weights``."""
    with _weights_replaced(slots, weights):
        return _one_row_call(layer, row)


def _shifted_weights(layer, first_grads, scale):
    return [v + scale * grad for v, grad in zip(layer.trainable_variables, first_grads)]


def _map_rows(layer, one_row, rows, dtypes):
    """``one_row`` over the rows of ``rows``: ``tf.vectorized_map``, or a loop over rows
    (``tf.map_fn``) for the layers :func:`_needs_row_loop` names."""
    if _needs_row_loop(layer):
        return tf.map_fn(one_row, rows, fn_output_signature=dtypes)
    with pfor_loop_notice_filtered():  # a convolution's kernel gradient: pfor's loop, exact
        return tf.vectorized_map(one_row, rows)


def _shifted_call(first, h, scales, isolated=False):
    """A vectorised-fallback layer on each row at ``W + s_i grad_i`` (materialised);
    ``isolated``: its backward pass per row too (:func:`lipdp.core.isolation.isolated_call`)."""
    layer, slots = first.layer, _variable_slots(first.layer)
    grads = [tf.stop_gradient(t) for t in first.per_row]
    if isolated:

        def one_row(batch):
            weights = _shifted_weights(layer, [t[0] for t in batch["shifts"]], batch["scale"][0])
            with _weights_replaced(slots, weights):
                return layer(batch["inputs"], training=True)

        rows = {"inputs": h, "scale": _ascent_row_scales(scales, first), "shifts": grads}
        return isolation.isolated_call(
            one_row, rows, what=_describe(layer), layers=[layer], loop=_needs_row_loop(layer)
        )

    def one_row(row):
        weights = _shifted_weights(layer, row["shifts"], row["scale"])
        return _row_call(layer, slots, row, weights)

    rows = _row_inputs(h, scale=_ascent_row_scales(scales, first), shifts=grads)
    return _map_rows(layer, one_row, rows, tf.as_dtype(layer.compute_dtype))


def _vectorized_gradients(record, first=None, scales=None):
    """Per-row gradients of a fallback layer for the unit cotangents: a vectorised map of
    the layer's own vector-Jacobian product on ``(a_i, u_i)``, at ``W`` or, after an
    ascent, at ``W + s_i grad_i``."""
    layer, variables = record.layer, record.layer.trainable_variables
    slots = _variable_slots(layer) if first is not None else None

    def one_row(row):
        with tf.GradientTape() as tape:
            if first is None:
                out = _one_row_call(layer, row)
                # What the tape watched: "zero" for a variable the row does not reach
                # needs a tf.Variable's dtype (a Keras 3 variable's is a string).
                sources = [compat.tape_variable(v) for v in variables]
            else:
                sources = _shifted_weights(layer, row["shifts"], row["scale"])
                tape.watch(sources)
                out = _row_call(layer, slots, row, sources)
        grads = tape.gradient(
            out, sources, output_gradients=row["unit"], unconnected_gradients="zero"
        )
        return [tf.convert_to_tensor(grad) for grad in grads]

    rows = _row_inputs(record.inputs, unit=record.unit)
    if first is not None:
        rows["scale"] = _ascent_row_scales(scales, first)
        rows["shifts"] = [tf.stop_gradient(t) for t in first.per_row]
    return _map_rows(layer, one_row, rows, [tf.as_dtype(v.dtype) for v in variables])


def _local_vjp(record, inputs, cotangents):
    """``sum_i`` of the rows' kernel gradients for cotangents ``G``: the layer's linear
    part re-run on ``inputs`` (the forward op is pruned in graph mode) and differentiated.
    A row-wise shift is constant in the weights, so this is also the gradient at the
    shifted weights."""
    kernel = compat.tape_variable(record.ghost.kernel(record.layer))
    with tf.GradientTape() as tape:
        z = record.ghost.linear(record.layer, inputs)
    grad = tape.gradient(z, kernel, output_gradients=cotangents, unconnected_gradients="zero")
    return tf.convert_to_tensor(grad)  # embedding: IndexedSlices


# ------------------------------------------------------------------------- results
@dataclass
class PerExampleGradients:
    """The per-row facts of one batch, per weighted layer of the model (in forward order:
    :func:`weighted_layers` of its layers; a nested model is one layer).

    ``sq_norms[l]``: ``(b,)`` squared norms (float64) of each row's gradient for layer
    ``l``'s variables (a nested chain model: the sum over the layers inside, ``records``).
    ``y_pred``: the forward pass's predictions. :meth:`clipped_sums` returns ``{variable
    ref: sum_i C_il g_il}`` for factors ``C_il``.
    """

    layers: list
    sq_norms: list
    y_pred: tf.Tensor
    parts: list
    records: list | None = None

    def clipped_sums(self, factors, keep) -> dict:
        """``factors[l]``: ``(b,)`` factors of layer ``l`` (float64); rows where ``keep``
        is False contribute nothing (their inputs and cotangents are zeroed, rule S9)."""
        zeroed = _unkept_zeroed(
            keep,
            [t for layer_parts in self.parts for part in layer_parts for t in part.rows_to_zero()],
        )
        sums = {}
        for layer_parts, c in zip(self.parts, factors):
            c = tf.where(keep, tf.cast(c, tf.float64), tf.zeros_like(c, tf.float64))
            for part in layer_parts:
                sums.update(part.clipped_sums(c, keep, zeroed))
        return sums


def per_example_gradients(
    model, x, per_example_losses, method="ghost", ascent=None
) -> PerExampleGradients:
    """The per-example squared norms of ``model`` (a chain of Keras layers run by
    ``model.forward``) on ``x``; ``per_example_losses(y_pred)`` gives the ``(b,)`` losses.
    ``ascent``: an :class:`Ascent` (ghost method only): the gradients of each row at its
    own shifted weights."""
    validation.choice("per-example gradient method", method, GRADIENT_METHODS)
    if method == "jacobian":
        if ascent is not None:
            raise ValueError("A per-example ascent (BAM) needs gradient_method='ghost'.")
        return _jacobian(model, x, per_example_losses)
    records = []
    with tf.GradientTape() as tape:
        y_pred = _recorded_forward(model, x, records, ascent)
        with tf.GradientTape() as probe:  # which trainable variables the loss reads
            losses = per_example_losses(y_pred)
        total = tf.reduce_sum(losses)
    refuse_loss_reads(probe.watched_variables(), _variable_owners(model))
    cotangents = tape.gradient(total, [r.outputs for r in records])
    weighted_layers([r.layer for r in records])  # refuses shared variables
    first = ascent.first.records if ascent is not None else [None] * len(records)
    for record, g, before in zip(records, cotangents, first):
        record.cotangents = tf.zeros_like(record.outputs) if g is None else g
        record.unit, record.scales = _unit_rows(record.cotangents)
        if record.ghost is None:
            scales = None if ascent is None else ascent.scales
            record.per_row = _vectorized_gradients(record, before, scales)
            parts = [_RowsPart(record.layer.trainable_variables, record.per_row, record.scales)]
        else:
            parts = _ghost_parts(record)
        record.parts = parts
    layers, parts = [], []  # per layer of the model: a nested chain's units together
    for record in records:
        if not layers or layers[-1] is not record.group:
            layers.append(record.group)
            parts.append([])
        parts[-1].extend(record.parts)
    sq_norms = [tf.add_n([p.sq_norms() for p in layer_parts]) for layer_parts in parts]
    return PerExampleGradients(layers, sq_norms, y_pred, parts, records)


def _jacobian(model, x, per_example_losses) -> PerExampleGradients:
    if not model.built and tf.is_tensor(x):
        # The Jacobian is taken for the variables listed before the pass: create them
        # (the ghost pass builds each layer as it meets it). A Keras 3 layer's config
        # keeps no input shape: a model of layers from configs arrives unbuilt.
        model.build((None, *x.shape[1:]))
    layers = weighted_layers(model.layers_forward_order())
    variables = [v for layer in layers for v in layer.trainable_variables]
    vectorise = not row_loop_layers(layers)
    isolated = getattr(model, "row_isolation", False)
    # A loop needs a persistent tape; so may an isolated forward pass (below).
    with (
        isolation.row_loops_recorded() as looped,
        tf.GradientTape(persistent=isolated or not vectorise) as tape,
    ):
        y_pred = model.forward(x, training=True)
        losses = per_example_losses(y_pred)
    # pfor over an isolated call that loops over rows would give each row's matrix
    # products the shapes the loop is there to avoid (lipdp.core.isolation.ROW_LOOP_OPS).
    vectorise = vectorise and not looped
    with pfor_loop_notice_filtered():
        jacobians = tape.jacobian(losses, variables, experimental_use_pfor=vectorise)
    rows = tf.shape(losses)[0]
    jacobians = [
        tf.zeros(tf.concat([[rows], v.shape], 0), v.dtype) if j is None else j
        for j, v in zip(jacobians, variables)
    ]
    parts, start = [], 0
    for layer in layers:
        count = len(layer.trainable_variables)
        parts.append([_RowsPart(layer.trainable_variables, jacobians[start : start + count])])
        start += count
    sq_norms = [layer_parts[0].sq_norms() for layer_parts in parts]
    return PerExampleGradients(layers, sq_norms, y_pred, parts)


__all__ = [
    "GRADIENT_METHODS",
    "Ascent",
    "PerExampleGradients",
    "per_example_gradients",
    "refuse_loss_reads",
    "refuse_untracked_reads",
    "row_loop_layers",
    "weighted_layers",
]
