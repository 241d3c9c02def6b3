r"""Row isolation: every piece of code lipdp does not own sees one example at a time.

Both families release ``sum_i g_i / n`` with noise calibrated to one row's share, which is
sound only if row ``i``'s loss depends on row ``i`` alone (rule S2). The structural walk
and the numerical probe of :mod:`lipdp.core.batch_independence` *check* that; a probe is a
test at some points, and a coupling that is inactive on every batch it draws (gated on
large activations, on non-negative inputs, on batches larger than the probe's, ...)
passes it. With ``row_isolation=True`` (an argument of both private models: the default of
the clipless family, whose own layers run on the batch, an option of clipped DP-SGD) the
training step instead *cannot* couple rows, whatever the layers and the loss compute:

* every call of code lipdp does not own -- a Keras layer, an activation, the loss, a
  user's layer or ``DP_Lambda`` function -- runs on **a batch of one row**, once per row,
  under ``tf.vectorized_map`` (a row loop, ``tf.map_fn``, for the layers ``pfor`` cannot
  vectorise): its code only ever receives one example, so no statistic of the batch, no
  batch size, no sort over rows exists for it to read (:func:`isolated_call`);
* its backward pass is per row too. One row's call is first traced on its own (what it
  runs is inspected there, below). Without an overridden gradient in it, the gradient of
  the map is TensorFlow's gradient of the vectorised graph: row ``i`` of the outputs is a
  function of row ``i`` of the inputs alone, so the Jacobian is block-diagonal and each
  row's input cotangent comes from its own output cotangent. With one (a
  ``tf.custom_gradient``, ``gradient_override_map``), the call is one
  ``tf.custom_gradient`` op whose gradient is the vectorised map of each row's own
  vector-Jacobian product (the row's forward run again under a ``GradientTape``): the
  gradient of a ``pfor``-converted graph taken from outside drops the override (measured:
  an identity instead of a halved cotangent, ``tests/core/test_row_isolation.py``), while
  inside the map it applies;
* what runs on the batch is lipdp's own code, which reduces over non-batch axes only: the
  model's forward loop, its records and the per-row bookkeeping of the step (S9's
  neutralisation, clipping factors, sums), the linear parts of lipdp's own ghost rules
  (Dense, Conv2D, Embedding: exact classes) and, in the clipless family, lipdp's own DP
  layers (exact classes; ``DP_Lambda`` and subclasses are isolated).

**State.** A row can still reach another through state the code keeps between calls.
Inside an isolated call (Keras 3) every write to a Keras variable is confined to the row
by a ``keras.StatelessScope`` and the values the layer reads are the ones before the
call, so a running statistic never mixes rows; such a write is then refused, naming the
variable (a statistic of the private batch would be saved without noise), except the
states of Keras' random seed generators, which advance as in a batched step (the value
every row computed, checked equal across rows). Any other stateful operation in the
isolated graph -- a write to a ``tf.Variable`` (Keras 2, or one a Keras 3 layer holds
itself), a ``tf.py_function`` (whose Python state a row loop would carry from row to
row), a lookup table insert, a queue -- is refused at trace time
(:func:`inspect_row_call`); variable reads and random draws are allowed. So the
probe's check of non-trainable variables is not needed under isolation, and the
structural walk still refuses batch normalisation (its moving statistics).

**What isolation changes.** A layer's code sees a batch of one: code reading the batch
size reads 1, and a loss that averages over the batch axis gives each row its own loss
(its value on a batch of one). Random layers drawing from a Keras 3 ``SeedGenerator``
(``Dropout``, ``GaussianNoise``, random augmentation) draw each row's numbers from the
generator's seed moved by the row's index -- every row its own draw, as in a batched
call, the draws independent of the data -- and the generator advances once per call as
in a batched step (``pfor`` has no converter for these per-row stateless draws: it loops
over the rows for that op). A call whose output for one row has a dimension not known
when traced (``RandomHeight``: the draw sets it) draws once for every row, as on a batch,
so that the rows' outputs stack. The Keras mask of a layer's output is computed per row
with it.

**Cost.** ``pfor`` converts each isolated call's graph when the step is traced (one row's
call is also traced apart); a call whose gradient is overridden runs its forward pass
twice. Measured against the batched step (``benchmarks/row_isolation_cost.py``, batch
512, two shared cores): 1.21x on the Keras CNN of ``lipdp train --method dp-sgd``, 1.09x
on a dense network, 1.01x on the clipless digits CNN (only its loss is isolated), peak
memory within 2 MB; the first step is no slower (no probe).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.python.framework import op_def_registry
from tensorflow.python.ops.parallel_for import pfor as pfor_ops

from lipdp.foundation import compat
from lipdp.foundation.tf_notices import pfor_loop_notice_filtered

#: Stateful operations an isolated call may run: reads of variables (weights, frozen
#: statistics) and lookup tables, random draws (state advanced by the amount drawn),
#: asserts and prints.
#: Any other stateful op is refused (:func:`inspect_row_call`).
ALLOWED_STATEFUL_OPS = frozenset(
    {
        # reading variables
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VarIsInitializedOp",
        "VariableShape",
        # reading lookup tables (StringLookup, IntegerLookup, TextVectorization)
        "LookupTableFind",
        "LookupTableFindV2",
        "LookupTableSize",
        "LookupTableSizeV2",
        # random draws (stateful kernels and generators)
        "RandomUniform",
        "RandomUniformInt",
        "RandomStandardNormal",
        "TruncatedNormal",
        "ParameterizedTruncatedNormal",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "Multinomial",
        "StatefulUniform",
        "StatefulUniformInt",
        "StatefulUniformFullInt",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulRandomBinomial",
        "RngReadAndSkip",
        "RngSkip",
        # checks and logs
        "Assert",
        "Print",
        "PrintV2",
        "CheckNumerics",
        "CheckNumericsV2",
    }
)

#: Ops whose vectorised form (one more batch axis) oneDNN mishandles on some CPUs: under
#: ``tf.vectorized_map`` a batched matrix product can corrupt the heap (measured on this
#: project's AVX-512 CPU: an isolated ``EinsumDense`` gave a per-example squared norm of
#: 5.6e39 instead of 3.3, or a segmentation fault; exact with ``TF_ENABLE_ONEDNN_OPTS=0``).
#: An isolated call holding one runs as a loop over rows, each row with the shapes of a
#: batch of one, as plain Keras runs it (rule S13: a model must not crash the process).
ROW_LOOP_OPS = frozenset({"BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})

#: Ops whose output shape depends on the values (``tf.boolean_mask``'s ``Where``, e.g. in
#: Keras 2's sparse cross-entropy with ``ignore_class``): ``pfor`` loops over the rows for
#: them and then cannot stack rows of different lengths (TensorFlow 2.15: "Incompatible
#: shapes during merge"). An isolated call holding one runs as a loop over rows too, whose
#: outputs (the call's, fixed per row) stack.
VALUE_SHAPED_OPS = frozenset({"Where", "Unique", "UniqueV2", "UniqueWithCounts"})

#: Ops of a row's graph that ``pfor`` leaves as they are (no per-row input).
_LOOP_INVARIANT_OPS = frozenset({"Const", "Placeholder", "NoOp"})

#: The node attribute of an op whose gradient function is overridden (graph mode).
_GRADIENT_OVERRIDE = "_gradient_op_type"

#: Operations that call functions (their bodies are scanned).
_CALLS = frozenset(
    {
        "PartitionedCall",
        "StatefulPartitionedCall",
        "While",
        "StatelessWhile",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
    }
)


# ------------------------------------------------------------------ stateful ops
def _function_def(graph, name):
    """The ``FunctionDef`` called ``name`` in ``graph``'s library (or an outer graph's)."""
    while graph is not None:
        function = graph._get_function(name)  # noqa: SLF001 - the graph's function library
        if function is not None:
            definition = getattr(function, "definition", None)
            return definition if definition is not None else function.cached_definition
        graph = getattr(graph, "outer_graph", None)
    return None


def _called_functions(node_def) -> list:
    """Names of the functions a ``NodeDef`` calls through its attributes."""
    names = []
    for attr in node_def.attr.values():
        if attr.HasField("func"):
            names.append(attr.func.name)
        names += [f.name for f in attr.list.func]
    return names


def _inspect(graph, node_defs, seen, found, types) -> bool:
    """Add to ``found`` the types of the stateful ops among ``node_defs`` and in the
    functions they call (recursively), except :data:`ALLOWED_STATEFUL_OPS` and the calls
    themselves, and to ``types`` every op type; return whether one of them has its gradient
    overridden (a ``tf.custom_gradient``, ``tf.RegisterGradient`` through
    ``gradient_override_map``)."""
    overrides = False
    for node in node_defs:
        types.add(node.op)
        overrides |= _GRADIENT_OVERRIDE in node.attr
        callees = _called_functions(node)
        body = _function_def(graph, node.op)  # a node may call a function by its name
        if body is not None:
            callees.append(node.op)
        for name in callees:
            if name in seen:
                continue
            seen.add(name)
            definition = _function_def(graph, name)
            if definition is None:
                found.append(f"a call of function {name!r} that cannot be inspected")
                continue
            overrides |= _inspect(graph, definition.node_def, seen, found, types)
        if body is not None or node.op in _CALLS or node.op in ALLOWED_STATEFUL_OPS:
            continue
        op_def = op_def_registry.get(node.op)
        if op_def is None or op_def.is_stateful:
            found.append(node.op)
    return overrides


def _origin(tensor, graph):
    """The tensor ``tensor`` of ``graph`` was captured from, through the outer graphs."""
    while graph is not None:
        captures = getattr(graph, "captures", ())  # a FuncGraph's; none for a tf.Graph
        captured = {id(internal): external for external, internal in captures}
        if id(tensor) not in captured:
            return tensor
        tensor, graph = captured[id(tensor)], getattr(graph, "outer_graph", None)
    return tensor


def _written_variables(graph, operations, variables) -> list:
    """Paths of ``variables`` whose resource is an input of one of ``operations`` (the
    stateful ops found at the top level of ``graph``), for the message."""
    handles = {id(compat.tape_variable(v).handle): v for v in variables}
    names = []
    for op in operations:
        for t in op.inputs:
            variable = handles.get(id(_origin(t, graph)))
            if variable is not None:
                names.append(repr(compat.variable_path(variable)))
    return sorted(set(names))


@dataclass(frozen=True)
class RowCall:
    """What :func:`inspect_row_call` found in one row's call."""

    #: An op's gradient is overridden: each row is differentiated inside the map.
    overrides: bool
    #: A batched matrix product (:data:`ROW_LOOP_OPS`) or an op whose output shape depends on
    #: the values (:data:`VALUE_SHAPED_OPS`): a loop over rows.
    products: bool
    #: An op ``pfor`` has no converter for (it loops over the rows for it, and cannot
    #: stack zero rows of a shape unknown statically): an empty batch is guarded.
    unconverted: bool


def inspect_row_call(graph, what, variables=()) -> RowCall:
    """Check the graph of one row's call (``graph``: of ``what``): refuse it if it runs a
    stateful op other than a variable read or a random draw, here or in a function it
    calls (module docstring: state kept between rows would couple them; ``variables``:
    those it may write, named in the message); and say what the map needs
    (:class:`RowCall`)."""
    found, types = [], set()
    overrides = _inspect(graph, [op.node_def for op in graph.get_operations()], set(), found, types)
    if found:
        names = ", ".join(sorted(set(found)))
        stateful = [op for op in graph.get_operations() if op.type in found]
        written = _written_variables(graph, stateful, variables)
        names += f" on {', '.join(written)}" if written else ""
        raise ValueError(
            f"{what} runs stateful operations ({names}) in training: under row_isolation "
            "state kept from one row to the next could carry data between examples. "
            "Remove them from the training call, or use row_isolation=False (the "
            "batch-independence probe then checks the model)."
        )
    converters = pfor_ops._pfor_converter_registry  # noqa: SLF001 - pfor's op converters
    unconverted = any(t not in converters and t not in _LOOP_INVARIANT_OPS for t in types)
    return RowCall(overrides, bool(types & (ROW_LOOP_OPS | VALUE_SHAPED_OPS)), unconverted)


# ----------------------------------------------------------------------- state
def _seed_states(layers) -> list:
    """Keras 3: the state variables of the ``SeedGenerator`` objects ``layers`` hold (at any
    depth) and of Keras' global one (its random ops called without a seed), if it exists."""
    if not compat.keras_3():
        return []
    from lipdp.core.batch_independence import random_sources

    generators = [g for _, g in random_sources(layers)[0]]
    global_generator = compat.keras_global_seed_generator()
    if global_generator is not None:
        generators.append(global_generator)
    states, seen = [], set()
    for generator in generators:
        if id(generator.state) not in seen:
            seen.add(id(generator.state))
            states.append(generator.state)
    return states


def _row_seeds(seed_values, index):
    """Row ``index``'s values of the seed states: the seed component moved by ``index``,
    so that every row draws its own numbers (as rows of a batched draw do) and no two
    (row, step) pairs share a seed (the counter component moves with every draw)."""
    rows = []
    for value in seed_values:
        offset = tf.one_hot(0, tf.size(value), dtype=value.dtype) * tf.cast(index, value.dtype)
        rows.append(value + tf.reshape(offset, tf.shape(value)))
    return rows


@contextlib.contextmanager
def _confined(seed_states, seed_values):
    """Keras 3: a ``StatelessScope`` in which the seed states read ``seed_values`` and every
    write to a Keras variable stays in the scope (module docstring); Keras 2: nothing (its
    writes are stateful ops, refused)."""
    if not compat.keras_3():
        yield None
        return
    import keras

    mapping = list(zip(seed_states, seed_values))
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        yield scope


def _written(scope, seed_states, seed_values) -> tuple[list, list]:
    """``(seed states written with their new values, ids of other variables written)`` in
    a scope of :func:`_confined`."""
    if scope is None:
        return [], []
    initial = {id(v): value for v, value in zip(seed_states, seed_values)}
    seeds, others = [], []
    for key, value in scope.state_mapping.items():
        if key in initial:
            if value is not initial[key]:
                seeds.append((key, value))
        else:
            others.append(key)
    return seeds, others


def _variable_named(key, candidates) -> str:
    for v in candidates:
        if id(v) == key:
            return repr(compat.variable_path(v))
    return "a variable"


# ---------------------------------------------------------------------- the call
def _is_float(t) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


def _as_batch(row, masks):
    """One row's tensors as a batch of one, with their Keras masks (``None``: none)."""
    batch = [t[None] for t in row]
    for t, mask in zip(batch, masks):
        if mask is not None:
            t._keras_mask = mask[None]  # noqa: SLF001 - Keras' mask convention
    return batch


def _row_spec(elems):
    """The ``tf.TensorSpec`` nest of one row of ``elems`` (a nest of batch tensors)."""
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), elems)


def rows_index(tensors):
    """``[0, 1, ..., b - 1]`` for the rows of ``tensors``."""
    return tf.range(tf.shape(tensors[0])[0])


def _map(fn, elems, loop, signature=None, guard_empty=True):
    """``fn`` over the rows of ``elems``: ``tf.vectorized_map``, or with ``loop`` a row loop
    (``tf.map_fn``; its output ``signature``, else from a trace of ``fn`` on one row).
    ``guard_empty``: an empty batch (a Poisson draw of no row) is mapped as one row of
    zeros whose results are dropped, because ``pfor`` cannot stack zero rows of an op it
    loops over when their shape is not known statically (the guard's conditionals cost
    time: only where :func:`inspect_row_call` finds such an op)."""
    rows = tf.shape(tf.nest.flatten(elems)[0])[0]

    def one_row_if_empty(t):
        zeros = tf.zeros(tf.concat([[1], tf.shape(t)[1:]], 0), t.dtype)
        return tf.cond(rows > 0, lambda: t, lambda: zeros)

    if guard_empty:
        elems = tf.nest.map_structure(one_row_if_empty, elems)
    if loop:
        if signature is None:
            traced = tf.function(fn, autograph=False).get_concrete_function(_row_spec(elems))
            signature = _signature(traced)
        result = tf.map_fn(fn, elems, fn_output_signature=signature)
    else:
        with pfor_loop_notice_filtered():  # a convolution's kernel gradient: pfor's loop
            result = tf.vectorized_map(fn, elems)
    if not guard_empty:
        return result
    return tf.nest.map_structure(lambda r: r[:rows], result)


def _signature(concrete):
    """The ``tf.TensorSpec`` nest of a concrete function's outputs."""
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), concrete.structured_outputs
    )


def _seed_updates(states, keys, rows):
    """Assign each written seed state the value every row computed for it (the rows must
    agree: a seed state is advanced independently of the data; an empty batch leaves it)."""
    by_key = {id(s): s for s in states}
    for key, values in zip(keys, rows):
        state = by_key[key]
        count = tf.shape(values)[0]
        first = values[tf.minimum(0, count - 1) :][:1]
        tf.debugging.assert_equal(
            values,
            tf.broadcast_to(first, tf.shape(values)),
            message="A random seed state was advanced differently for two rows.",
        )
        new = tf.cond(
            count > 0, lambda f=first: f[0], lambda s=state: tf.convert_to_tensor(s.value)
        )
        state.assign(tf.cast(new, state.dtype))


#: The calls that ran as a row loop while :func:`row_loops_recorded` is open (else None).
_ROW_LOOPS = None


@contextlib.contextmanager
def row_loops_recorded():
    """Yields a list that receives the name (``what``) of every isolated call traced inside
    the block that runs as a row loop (``tf.map_fn``). Why: a ``pfor`` taken from outside
    over such a loop -- a Jacobian of the per-row losses -- vectorises each row's batched
    matrix product into the very shapes the loop avoids (:data:`ROW_LOOP_OPS`): the
    caller then loops too."""
    global _ROW_LOOPS
    outer, _ROW_LOOPS = _ROW_LOOPS, []
    try:
        yield _ROW_LOOPS
    finally:
        found, _ROW_LOOPS = _ROW_LOOPS, outer
        if outer is not None:
            outer.extend(found)


@tf.autograph.experimental.do_not_convert  # Python run when traced, not graph code
def isolated_call(fn, inputs, *, what, layers=(), loop=False):
    """``fn(inputs)`` computed one row at a time, forward and backward (module docstring).

    Args:
        fn: maps a nest like ``inputs`` whose tensors hold one row (a batch of one) to a
            nest of tensors with a batch axis of one (a layer's call).
        inputs: a nest of tensors whose first axis is the batch; their Keras masks are
            handed to ``fn`` row by row.
        what: how messages name the call (``"Layer 'dense'"``).
        layers: the layers ``fn`` runs: their random seed generators (Keras 3) advance as
            in a batched call; a variable of theirs written in training is named.
        loop: a row loop (``tf.map_fn``) instead of ``tf.vectorized_map`` (also taken for
            a call holding an op of :data:`ROW_LOOP_OPS`).

    Returns:
        A nest like ``fn``'s output whose first axis holds every row, with the Keras masks
        ``fn`` put on its outputs (computed row by row).
    """
    nest = tf.nest.flatten(inputs)
    flat = [tf.convert_to_tensor(t) for t in nest]
    in_masks = [getattr(t, "_keras_mask", None) for t in nest]
    masks = [m for m in in_masks if m is not None]
    layers = list(layers)
    seed_states = _seed_states(layers)
    seed_values = [tf.convert_to_tensor(s.value) for s in seed_states]
    known = [v for layer in layers for v in layer.variables]
    structure = {}  # the output's structure, its masks and the seeds written: from the trace
    drawn_per_row = [1]  # 0: every row the same draw (below)

    def call_row(row, row_masks):
        given = iter(row_masks)
        full = [next(given) if m is not None else None for m in in_masks]
        return fn(tf.nest.pack_sequence_as(inputs, _as_batch(row, full)))

    def forward_row(elems):
        row, row_masks, index = elems
        row_seeds = _row_seeds(seed_values, index * drawn_per_row[0])
        with _confined(seed_states, row_seeds) as scope:
            out = call_row(row, row_masks)
        seeds, others = _written(scope, seed_states, row_seeds)
        if others:
            names = ", ".join(sorted({_variable_named(k, known) for k in others}))
            raise ValueError(
                f"{what} writes {names} in its training call: under row_isolation a "
                "statistic of the private batch would be saved without noise. Keep no state "
                "in the training call (or freeze the layer), or use row_isolation=False."
            )
        if scope is not None and scope.losses:
            raise ValueError(
                f"{what} adds a loss computed in its call (add_loss of a tensor or an "
                "activity regulariser), outside the per-example losses the sensitivity "
                "covers: remove it."
            )
        flat_out = tf.nest.flatten(out)
        out_masks = [getattr(o, "_keras_mask", None) for o in flat_out]
        structure.update(out=out, masks=out_masks, seeds=[k for k, _ in seeds])
        rows = [o[0] for o in flat_out] + [m[0] for m in out_masks if m is not None]
        # the seeds' new values without the row's offset: the same for every row
        start = dict(zip([id(v) for v in seed_states], zip(row_seeds, seed_values)))
        return rows + [
            tf.convert_to_tensor(value) - (start[key][0] - start[key][1]) for key, value in seeds
        ]

    elems = (flat, masks, rows_index(flat))

    # One row traced on its own: what the call runs (refused if it keeps state) and
    # whether it overrides a gradient. Not: the gradient of the map is TensorFlow's
    # gradient of its row-wise vectorised graph (no second forward pass). Else: each row
    # is differentiated inside the map, where the overriding gradient applies.
    def scoped_row(elems):  # a root name scope: a layer's own may start with "_"
        with tf.name_scope("row"):
            return forward_row(elems)

    traced = tf.function(scoped_row, autograph=False).get_concrete_function(_row_spec(elems))
    found = inspect_row_call(traced.graph, what, known)
    if seed_states and not all(t.shape.is_fully_defined() for t in traced.outputs):
        # An output shape that depends on the draw (RandomHeight): one draw for every
        # row, as on a batch, so that the rows' outputs stack.
        drawn_per_row[0] = 0
    loop = loop or found.products
    if loop and _ROW_LOOPS is not None:
        _ROW_LOOPS.append(what)
    signature = _signature(traced) if loop else None
    guard = found.unconverted or loop  # map_fn cannot stack zero rows of unknown shape either

    @tf.custom_gradient
    def op(*tensors):
        elems = (list(tensors), masks, rows_index(tensors))
        result = _map(forward_row, elems, loop, signature, guard)
        outputs = list(result[: len(tf.nest.flatten(structure["out"]))])
        structure["result"] = result

        def grad(*dys, variables=None):
            sources = list(variables or [])

            def backward_row(elems):
                row, row_masks, index, row_dys = elems
                floats = [t for t in row if _is_float(t)]
                with tf.GradientTape() as tape:
                    tape.watch(floats)
                    row_seeds = _row_seeds(seed_values, index * drawn_per_row[0])
                    with _confined(seed_states, row_seeds):
                        out = tf.nest.flatten(call_row(row, row_masks))
                pairs = [(o, dy) for o, dy in zip(out, row_dys) if _is_float(o)]
                grads = tape.gradient(
                    [o for o, _ in pairs],
                    floats + sources,
                    output_gradients=[dy[None] for _, dy in pairs],
                    unconnected_gradients="zero",
                )
                return [tf.convert_to_tensor(g) for g in grads]

            cotangents = [
                tf.zeros_like(o) if dy is None else tf.convert_to_tensor(dy)
                for o, dy in zip(outputs, dys)
            ]
            elems = (list(tensors), masks, rows_index(tensors), cotangents)
            per_row = iter(_map(backward_row, elems, loop, guard_empty=guard))
            input_grads = [next(per_row) if _is_float(t) else None for t in tensors]
            variable_grads = [tf.reduce_sum(g, axis=0) for g in per_row]
            return input_grads, variable_grads

        return outputs, grad

    if found.overrides:
        outputs = list(tf.nest.flatten(op(*flat)))
        result = structure["result"]
    else:
        result = _map(forward_row, elems, loop, signature, guard)
        outputs = list(result[: len(tf.nest.flatten(structure["out"]))])
    count = len(outputs)
    mask_count = sum(m is not None for m in structure["masks"])
    structure["out_masks"] = list(result[count : count + mask_count])
    structure["seed_rows"] = list(result[count + mask_count :])
    mask_rows = iter(structure["out_masks"])
    for o, mask in zip(outputs, structure["masks"]):
        if mask is not None:
            o._keras_mask = next(mask_rows)  # noqa: SLF001 - Keras' mask convention
    if structure["seeds"]:
        _seed_updates(seed_states, structure["seeds"], structure["seed_rows"])
    return tf.nest.pack_sequence_as(structure["out"], outputs)


__all__ = [
    "ALLOWED_STATEFUL_OPS",
    "ROW_LOOP_OPS",
    "VALUE_SHAPED_OPS",
    "RowCall",
    "inspect_row_call",
    "isolated_call",
]
