r"""Rule S2 enforced: the examples of a batch do not interact in training.

Both families release ``sum_i g_i / n`` (``g_i``: the gradient of row ``i``'s loss) with
noise calibrated to one row's share. That is sound only if ``loss_i`` depends on row
``i`` alone -- its input and its label -- in training mode: a layer or a loss that uses
a statistic of the batch lets one row move every other row's gradient, and removing it
then changes the release by more than the declared sensitivity. Three checks enforce
it, for both families:

1. **A structural walk** (:func:`refuse_coupling_layers`), when a model is built,
   compiled and when its training step is traced: every layer reachable from the model's
   layers -- sub-models (``Sequential``, functional, subclassed), wrappers
   (``TimeDistributed``, ``Bidirectional``, anything with a ``layer``,
   ``forward_layer`` or ``backward_layer``), lipdp's ``DP_WrappedResidual`` blocks, and
   the sub-layers a custom layer tracks -- is refused if it couples the examples of a
   batch in training: a ``BatchNormalization`` of any Keras class (``SyncBatchNormalization``
   and the v1 class included) that is trainable, or a layer that declares itself
   coupling with the class or instance attribute ``couples_examples = True``
   (:data:`COUPLES_EXAMPLES`: how users mark their own layers). A frozen
   ``BatchNormalization`` (``trainable = False``; Keras 2's class, not the v1 one) runs
   in inference mode with its moving statistics, which it does not update: a fixed
   affine map of each example, accepted.
2. **Per-example loss values** (:func:`check_per_example_values`), when the step is
   traced: the loss must return one value per row; a scalar (a batch mean) or a tensor
   of another length is refused.
3. **A numerical probe** (:func:`probe`), once per model and input spec, when the step is
   first traced (``fit``, ``train_on_batch``, a custom loop calling ``train_step``): on a
   probe batch of :data:`PROBE_ROWS` rows built from the real input spec (shapes and
   dtypes; values from a local generator seeded with :data:`PROBE_SEED`, the global TF
   seed is neither read nor advanced), in training mode,

   * *inputs*: in one forward pass (so that random layers such as ``Dropout`` draw one
     mask), the Jacobian of the per-row losses with respect to the inputs and to the
     output of every top-level layer must be block-diagonal: ``d loss_i / d h_j = 0``
     for ``j != i``. Integer inputs (token ids, drawn in a range valid for every
     ``Embedding`` of the model) are covered through the first float outputs. The last
     stage whose Jacobian has off-diagonal blocks is followed by the coupling layer
     (or by the loss);
   * *inputs, without gradients*: when the forward pass is deterministic (two passes
     agree), rows ``1..B-1`` are redrawn and row 0's outputs after every top-level layer
     and its loss must not move -- this catches couplings that gradients do not see
     (``tf.stop_gradient`` of a batch statistic, integer operations);
   * *labels*: on the predictions of that pass, changing row ``j``'s label must leave
     every other row's loss unchanged (per-batch class weights, as deel-lip's KR losses);
   * *extra losses*: ``add_loss`` terms must not depend on the inputs (one number for the
     whole batch is not a per-example loss).

   Cost: three forward passes and :data:`PROBE_ROWS` backward passes of a
   :data:`PROBE_ROWS`-row batch, run eagerly once: measured 0.17 s on the digits CNN of
   ``lipdp train`` (0.035 s when TensorFlow's kernels are warm), whose first step,
   traced, takes 1.9 s and later steps 0.02 s; 0.06 s on a small Keras CNN trained with
   DP-SGD (first step 0.6 s, later 0.01 s; two shared CPU cores). The model argument
   ``independence_probe=False`` skips it (the structural walk and the per-example check
   still run); :func:`lipdp.report.privacy_report` then says so.

The probe is a test at one point, not a proof: a coupling that vanishes on its batch
(e.g. only beyond some batch size) escapes it; the walk and the per-example contract of
the documentation remain the rule.

:func:`fix_batch_coupling` returns a copy of a model (``Sequential``, functional, nested
sub-models, or a list of layers) with every trainable ``BatchNormalization`` replaced by
a ``GroupNormalization`` (per-example statistics), and a :class:`BatchCouplingFix`
report of what changed and of what it could not fix.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as eager_context

from lipdp.layer_walk import children, nested_layers

logger = logging.getLogger(__name__)

#: The attribute by which a layer declares that it couples the examples of a batch in
#: training: ``couples_examples = True`` on the class or the instance. Such a layer is
#: refused (:func:`refuse_coupling_layers`); if it also has a method
#: ``per_example_replacement()`` returning an equivalent layer that treats each example
#: on its own, :func:`fix_batch_coupling` uses it.
COUPLES_EXAMPLES = "couples_examples"

#: Rows of the probe batch.
PROBE_ROWS = 4

#: Seed of the probe's local generator (its inputs and labels).
PROBE_SEED = 2602

#: Relative size, in squared norm, of an off-diagonal block of the probe's Jacobian, or
#: of a change of a row's loss or output, above which rows are deemed coupled: exactly 0
#: for layers that treat rows separately (their cotangents are exact zeros), about
#: ``1 / B^2`` for a batch mean over ``B`` rows.
PROBE_TOLERANCE = 1e-10

#: Names of the Keras classes that normalise with batch statistics (the base class, the
#: v2 and v1 classes, the synchronised one), matched anywhere in a layer's class
#: hierarchy so that subclasses and other Keras packages' copies are caught.
_BATCH_NORMALIZATION_CLASSES = frozenset(
    {
        "BatchNormalizationBase",
        "BatchNormalization",
        "BatchNormalizationV1",
        "BatchNormalizationV2",
        "SyncBatchNormalization",
    }
)

_FIX = (
    "lipdp.fix_batch_coupling(model) replaces it with GroupNormalization (or use "
    "GroupNormalization or LayerNormalization yourself)"
)


# ------------------------------------------------------------------ structural walk
def is_batch_normalization(layer) -> bool:
    """Whether ``layer`` is a Keras batch normalisation (any of its classes)."""
    return any(cls.__name__ in _BATCH_NORMALIZATION_CLASSES for cls in type(layer).__mro__)


def runs_in_inference_mode(layer) -> bool:
    """A frozen Keras 2 ``BatchNormalization``: with ``trainable = False`` it runs in
    inference mode even when called with ``training=True`` (moving statistics, not
    updated; documented by Keras). The v1 class keeps batch statistics, so it is not."""
    return not layer.trainable and bool(getattr(layer, "_USE_V2_BEHAVIOR", False))


def coupling_reason(layer) -> str | None:
    """Why ``layer`` itself couples the examples of a batch in training, or ``None``."""
    if getattr(layer, COUPLES_EXAMPLES, False) is True:
        return "declares couples_examples = True (it mixes the examples of a batch)"
    if is_batch_normalization(layer) and not runs_in_inference_mode(layer):
        return (
            "normalises with batch statistics in training and updates its moving "
            "statistics from the private batch without noise"
        )
    return None


def coupling_layers(layers) -> list:
    """``[(path, layer, reason)]``: the layers of :func:`nested_layers` that couple the
    examples of a batch in training (:func:`coupling_reason`)."""
    found = []
    for path, layer in nested_layers(layers):
        reason = coupling_reason(layer)
        if reason is not None:
            found.append((path, layer, reason))
    return found


def refuse_coupling_layers(layers) -> None:
    """Refuse the first layer, at any depth, that couples the examples of a batch in
    training (rule S2), naming its path and the fix."""
    for path, layer, reason in coupling_layers(layers):
        if is_batch_normalization(layer):
            fix = f"{_FIX}, or freeze it (trainable=False: inference mode)"
        else:
            fix = (
                "Replace it by a layer that treats each example on its own (the fixer uses "
                "its per_example_replacement() if it has one)"
            )
        raise ValueError(
            f"Layer {path!r} ({type(layer).__name__}) {reason}: one example changes every "
            f"other example's gradient (rule S2). {fix}."
        )


# ------------------------------------------------------------- per-example losses
def _loss_name(loss) -> str:
    return str(getattr(loss, "name", None) or getattr(loss, "__name__", None) or repr(loss))


def check_per_example_values(values, y_pred, loss) -> None:
    """Refuse loss values that are not one per row (rule S2): a scalar (a mean over the
    batch, which then divides each row by the actual batch size -- random under Poisson
    sampling) or a leading axis of another length than the predictions'. Static shapes:
    Python, when the step is traced (the probe's batch has static shapes)."""
    shape = values.shape
    if shape.rank is None:
        return
    name = _loss_name(loss)
    if shape.rank == 0:
        raise ValueError(
            f"The loss {name!r} returns one value for the whole batch, not one per example: "
            "per-example clipping and the sensitivity need each row's loss (rule S2). "
            "Return shape (batch,) (no reduction over the batch axis)."
        )
    rows = tf.nest.flatten(y_pred)[0].shape[:1]
    if shape[0] is not None and rows[0] is not None and shape[0] != rows[0]:
        raise ValueError(
            f"The loss {name!r} returns {shape[0]} values for a batch of {rows[0]} rows: it "
            "must return one loss per example, shape (batch,) (rule S2)."
        )


# ------------------------------------------------------------------------- probe
@dataclass(frozen=True)
class ProbeResult:
    """What a probe checked: ``stages`` tensors watched by the Jacobian (inputs and
    top-level outputs), ``labels`` whether labels were perturbed, ``deterministic``
    whether the forward pass was deterministic (then rows were also redrawn)."""

    stages: int
    labels: bool
    deterministic: bool


def spec_key(x, y) -> tuple:
    """A hashable key of the structure, shapes (batch axis left out) and dtypes of a
    batch: the probe runs once per key."""

    def key(value):
        if value is None:
            return None
        flat = [(tuple(t.shape[1:]), t.dtype.name) for t in tf.nest.flatten(value)]
        return repr(tf.nest.map_structure(lambda _: 0, value)), tuple(flat)

    return key(x), key(y)


def _to_spec(value):
    if value is None:
        return None
    return tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), value)


def _token_range(model) -> int:
    """Integer inputs are drawn in ``[0, k)``: ``k`` = the smallest ``input_dim`` of the
    model's ``Embedding`` layers (at most 8), 2 without one."""
    sizes = [
        int(layer.input_dim)
        for _, layer in nested_layers(model.layers_forward_order())
        if isinstance(layer, tf.keras.layers.Embedding)
    ]
    return max(1, min([8, *sizes])) if sizes else 2


def _probe_shape(shape, rows, fallback) -> list:
    """The spec's shape with ``rows`` rows; an unknown axis takes the model's build shape
    (if of the same rank) or 8."""
    dims = list(shape)[1:]
    fallback = list(fallback)[1:] if fallback is not None else []
    if len(fallback) != len(dims):
        fallback = [None] * len(dims)
    return [rows] + [
        d if d is not None else (f if f is not None else 8) for d, f in zip(dims, fallback)
    ]


def _random_values(spec, shape, rng, tokens):
    dtype = spec.dtype
    if dtype.is_floating or dtype.is_complex:
        values = rng.standard_normal(shape)
    elif dtype.is_integer:
        values = rng.integers(0, tokens, shape)
    elif dtype.is_bool:
        values = rng.integers(0, 2, shape).astype(bool)
    elif dtype == tf.string:
        return tf.constant(rng.choice(np.array(["a", "b"]), shape))
    else:
        raise TypeError(f"The batch-independence probe cannot draw inputs of dtype {dtype}.")
    return tf.constant(values, dtype=dtype)


def _probe_inputs(model, spec, rows, rng):
    """Inputs of the spec (unknown axes from the shape the model was built for)."""
    fallback = getattr(model, "_build_input_shape", None)
    if isinstance(fallback, tf.TensorShape):
        fallback = fallback.as_list() if fallback.rank is not None else None
    single = len(tf.nest.flatten(spec)) == 1
    if not single or not isinstance(fallback, (list, tuple)):
        fallback = None
    elif not all(d is None or isinstance(d, int) for d in fallback):
        fallback = None
    tokens = _token_range(model)
    return tf.nest.map_structure(
        lambda s: _random_values(s, _probe_shape(s.shape, rows, fallback), rng, tokens), spec
    )


def _classes(y_pred) -> int:
    first = tf.nest.flatten(y_pred)[0]
    return int(first.shape[-1]) if first.shape.rank and first.shape.rank >= 2 else 1


def _label_kind(shape, dtype, classes) -> str:
    """How a label of this shape is drawn for predictions with ``classes`` outputs:
    ``"one-hot"`` (the label has the class axis), ``"ids"`` (class indices, integer or
    float, for sparse losses) or ``"values"`` in ``(0, 1)`` (binary, regression)."""
    if classes > 1 and len(shape) >= 2 and shape[-1] == classes:
        return "one-hot"
    if dtype.is_integer or (classes > 1 and (len(shape) == 1 or shape[-1] == 1)):
        return "ids"
    return "values"


def _probe_labels(spec, y_pred, rows, rng):
    """Labels of the spec's shape and dtype, valid for the predictions
    (:func:`_label_kind`)."""
    if spec is None:
        return None
    classes = _classes(y_pred)

    def draw(s):
        shape = _probe_shape(s.shape, rows, None)
        kind = _label_kind(shape, s.dtype, classes)
        if kind == "one-hot":
            values = np.eye(classes)[rng.integers(0, classes, shape[:-1])]
        elif kind == "ids":
            values = rng.integers(0, max(classes, 2), shape)
        else:
            values = rng.uniform(0.05, 0.95, shape)
        return tf.constant(values, dtype=s.dtype)

    return tf.nest.map_structure(draw, spec)


def _changed_label(labels, row, classes):
    """``labels`` with row ``row`` replaced by another valid label."""

    def change(t):
        values = t.numpy().copy()
        kind = _label_kind(list(values.shape), t.dtype, classes)
        if kind == "one-hot":
            values[row] = np.roll(values[row], 1, axis=-1)
        elif kind == "ids":
            values[row] = (values[row] + 1) % max(classes, 2)
        else:
            values[row] = 1 - values[row]
        return tf.constant(values, dtype=t.dtype)

    return tf.nest.map_structure(change, labels)


def _redrawn(x, rng, tokens):
    """``x`` with every row but the first drawn again."""

    def redraw(t):
        fresh = _random_values(tf.TensorSpec(t.shape, t.dtype), t.shape.as_list(), rng, tokens)
        keep = tf.reshape(tf.range(t.shape[0]) == 0, [-1] + [1] * (t.shape.rank - 1))
        return tf.where(keep, t, fresh)

    return tf.nest.map_structure(redraw, x)


def _float_tensors(value) -> list:
    return [t for t in tf.nest.flatten(value) if t.dtype.is_floating]


def _coupled(energies, row) -> bool:
    """``energies[j]``: squared norm of ``d loss_row / d h_j``; off-diagonal part large?"""
    off = float(np.sum(energies)) - float(energies[row])
    return off > PROBE_TOLERANCE * max(float(energies[row]), off) and off > 0


def _row_energies(gradient, rows) -> np.ndarray:
    values = tf.convert_to_tensor(gradient).numpy().astype(np.float64)
    return np.square(values.reshape(rows, -1)).sum(axis=1)


def _moved(a, b) -> bool:
    """Whether two values of a row differ beyond float round-off."""
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    change = float(np.sum(np.square(a - b)))
    return change > PROBE_TOLERANCE * max(float(np.sum(np.square(a))), 1e-30)


class _Forward:
    """One forward pass in training mode, recording the float outputs of every top-level
    layer (``stages[k]``: layer ``k``'s; ``-1``: the inputs), watched by ``tape``."""

    def __init__(self, model, x, tape=None):
        self.stages = {-1: _float_tensors(x)}
        if tape is not None:
            for t in self.stages[-1]:
                tape.watch(t)

        def observe(index, h):
            floats = _float_tensors(h)
            if tape is not None:
                for t in floats:
                    tape.watch(t)
            self.stages[index] = floats
            return h

        self.y_pred = model.forward(x, training=True, observe=observe)


def _describe_stage(model, stage) -> str:
    """What follows ``stage``: the next top-level layer, or the loss."""
    layers = model.layers_forward_order()
    if stage + 1 < len(layers):
        layer = layers[stage + 1]
        return f"layer {layer.name!r} ({type(layer).__name__})"
    return f"the loss {_loss_name(model.loss)!r}"


def _refuse(what, how) -> None:
    if what.startswith("the loss"):
        fix = "Use a loss whose value for row i depends on row i's prediction and label only"
    else:
        fix = "Make it treat each example on its own (no statistic over the batch axis)"
    raise ValueError(
        f"Batch-independence probe: {what} couples the examples of a batch in training "
        f"({how}; rule S2). {fix}, or pass independence_probe=False to the model if you are "
        "sure (the privacy report then says so)."
    )


def _check_jacobian(model, forward, losses_rows, tape, rows) -> int:
    """The block-diagonal check of the per-row losses' Jacobian; returns the number of
    stages watched."""
    stages = sorted(forward.stages)
    for stage in stages[1:]:
        for t in forward.stages[stage]:
            if t.shape.rank == 0 or t.shape[0] != rows:
                _refuse(
                    _describe_stage(model, stage - 1),
                    f"its output of shape {t.shape} has no batch axis of {rows} rows",
                )
    watched = [(stage, t) for stage in stages for t in forward.stages[stage]]
    coupled = set()
    for i, loss_i in enumerate(losses_rows):
        grads = tape.gradient(
            loss_i, [t for _, t in watched], unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        for (stage, _), g in zip(watched, grads):
            if stage not in coupled and _coupled(_row_energies(g, rows), i):
                coupled.add(stage)
    if coupled:
        _refuse(
            _describe_stage(model, max(coupled)),
            "one row's loss has a non-zero gradient with respect to another row's input",
        )
    return len(watched)


def _extra_loss_total(model):
    """The sum of the model's ``add_loss`` terms (and weight penalties), or ``None``."""
    extra = list(model.losses)
    if not extra:
        return None
    return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in extra])


def _check_extra_losses(total, forward, tape) -> None:
    """``add_loss`` terms must not depend on the data (weight penalties do not)."""
    if total is None:
        return
    watched = [t for stage in sorted(forward.stages) for t in forward.stages[stage]]
    grads = tape.gradient(total, watched)
    if any(g is not None and float(tf.reduce_sum(tf.abs(g))) > 0 for g in grads):
        _refuse(
            "the model's add_loss terms",
            "they depend on the inputs: one number for the whole batch, not a per-example loss",
        )


def _check_labels(model, labels, y_pred, losses, rows) -> bool:
    if labels is None:
        return False
    classes = _classes(y_pred)
    base = losses.numpy()
    for j in range(rows):
        changed = model.per_example_losses(_changed_label(labels, j, classes), y_pred).numpy()
        others = [i for i in range(rows) if i != j]
        if any(_moved(base[i], changed[i]) for i in others):
            _refuse(
                f"the loss {_loss_name(model.loss)!r}",
                "one row's loss changes when another row's label changes",
            )
    return True


def _check_redrawn(model, x, labels, first, losses, rng) -> bool:
    """Row 0's outputs and loss when rows ``1..`` are redrawn (deterministic models)."""
    again = _Forward(model, x)
    for stage in first.stages:
        for a, b in zip(first.stages[stage], again.stages[stage]):
            if _moved(a.numpy(), b.numpy()):
                return False  # a random forward pass (Dropout): the Jacobian covers it
    other = _Forward(model, _redrawn(x, rng, _token_range(model)))
    for stage in sorted(k for k in other.stages if k >= 0):
        for a, b in zip(first.stages[stage], other.stages[stage]):
            if _moved(a.numpy()[0], b.numpy()[0]):
                _refuse(
                    _describe_stage(model, stage - 1),
                    "row 0's output changes when the other rows' inputs change",
                )
    moved_loss = model.per_example_losses(labels, other.y_pred).numpy()[0]
    if _moved(losses.numpy()[0], moved_loss):
        _refuse(
            _describe_stage(model, len(model.layers_forward_order()) - 1),
            "row 0's loss changes when the other rows' inputs change",
        )
    return True


def probe(model, x_spec, y_spec, rows=PROBE_ROWS, seed=PROBE_SEED) -> ProbeResult:
    """Check numerically that each row's training loss depends on its own input and label
    only (module docstring, item 3); raise ``ValueError`` naming what couples.

    ``model``: a :class:`lipdp.private_model.PrivateModel` (its ``forward`` loop and
    ``per_example_losses``); ``x_spec``, ``y_spec``: the ``tf.TensorSpec`` (or nests)
    of a training batch. Eager; the model's variables are left as they were.
    """
    rng = np.random.default_rng(seed)
    x = _probe_inputs(model, x_spec, rows, rng)
    with tf.GradientTape(persistent=True) as tape:
        forward = _Forward(model, x, tape)
        labels = _probe_labels(y_spec, forward.y_pred, rows, rng)
        losses = model.per_example_losses(labels, forward.y_pred)
        check_per_example_values(losses, forward.y_pred, model.loss)
        losses_rows = tf.unstack(losses, num=rows)
        extra = _extra_loss_total(model)  # on the tape: its dependence on the inputs
    # A loss added in a call is refused by name first (the model's own check); the
    # probe below catches what that check cannot see (a callable reading the data).
    refuse_named = getattr(model, "refuse_data_dependent_losses", None)
    if refuse_named is not None:
        refuse_named()
    stages = _check_jacobian(model, forward, losses_rows, tape, rows)
    _check_extra_losses(extra, forward, tape)
    del tape
    checked_labels = _check_labels(model, labels, forward.y_pred, losses, rows)
    deterministic = _check_redrawn(model, x, labels, forward, losses, rng)
    return ProbeResult(stages, checked_labels, deterministic)


@contextlib.contextmanager
def _state_kept(model):
    """The model's non-trainable variables (a layer may update state in training mode)
    and TensorFlow's eager op-seed sequence, as they were."""
    variables = list(model.non_trainable_variables)
    values = [v.numpy() for v in variables]
    # The eager op seeds follow the global seed through this generator (not public API):
    # restored, so that the user's random ops draw what they would without the probe.
    rng = getattr(eager_context.context(), "_rng", None)
    state = rng.getstate() if rng is not None else None
    try:
        yield
    finally:
        for v, value in zip(variables, values):
            v.assign(value)
        if state is not None:
            rng.setstate(state)


@contextlib.contextmanager
def _eager_with_gradients():
    """Out of the graph being traced (``tf.init_scope``), with gradient recording on:
    ``init_scope`` stops it (TensorFlow's tape switch has no public API)."""
    with tf.init_scope():
        stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
        try:
            yield
        finally:
            if stopped:
                pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def probe_when_traced(model, x, y) -> None:
    """Run :func:`probe` for this batch's spec unless already done for it: eagerly (out of
    the graph being traced), once per global step under a distribution strategy (in
    cross-replica context). Python, called when the training step is traced."""
    key = spec_key(x, y)
    done = model._independence_probed  # noqa: SLF001 - the model's cache
    if key in done:
        return
    x_spec, y_spec = _to_spec(x), _to_spec(y)

    def run(*_):
        with _eager_with_gradients(), _state_kept(model):
            result = probe(model, x_spec, y_spec)
        logger.debug("batch-independence probe passed: %s", result)
        done.add(key)

    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        context.merge_call(run)
    else:
        run()


# -------------------------------------------------------------------------- fixer
@dataclass(frozen=True)
class Replacement:
    """One layer replaced by :func:`fix_batch_coupling`."""

    path: str
    old_class: str
    new_class: str
    detail: str = ""

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.path}: {self.old_class} -> {self.new_class}{detail}"


@dataclass(frozen=True)
class Unfixed:
    """A coupling layer :func:`fix_batch_coupling` left in place, and why."""

    path: str
    layer_class: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.layer_class} NOT FIXED ({self.reason})"


@dataclass
class BatchCouplingFix:
    """What :func:`fix_batch_coupling` changed (``replaced``) and could not change
    (``unfixed``: the copy still holds these layers, and DP models refuse it)."""

    replaced: list = field(default_factory=list)
    unfixed: list = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """No coupling layer left."""
        return not self.unfixed

    def __str__(self) -> str:
        if not self.replaced and not self.unfixed:
            return "No layer couples the examples of a batch: nothing to fix."
        lines = [f"{len(self.replaced)} layer(s) replaced, {len(self.unfixed)} not fixed:"]
        lines += [f"  {item}" for item in [*self.replaced, *self.unfixed]]
        return "\n".join(lines)


#: Fewest values one group of a replacing ``GroupNormalization`` normalises over (per
#: example): fewer make its mean and variance degenerate (one value: the output is beta).
MIN_GROUP_VALUES = 16


def group_count(channels, positions=None, max_groups=32) -> int:
    """Groups of the ``GroupNormalization`` replacing a batch normalisation over
    ``channels`` channels with ``positions`` values per channel and example (the product
    of the spatial or time axes; ``None``: unknown, taken as large): the largest divisor
    ``G`` of ``channels`` with ``G <= max_groups`` (Wu & He 2018 use 32) and at least
    :data:`MIN_GROUP_VALUES` values per group, ``(channels / G) x positions``; 1 if none
    (one group over the features is LayerNormalization's statistic)."""

    def enough(groups):
        return positions is None or (channels // groups) * positions >= MIN_GROUP_VALUES

    divisors = range(1, min(channels, max_groups) + 1)
    return max((g for g in divisors if channels % g == 0 and enough(g)), default=1)


def _positions(shape, axis):
    """Values per channel of one example (``None`` if an axis is unknown)."""
    sizes = [d for i, d in enumerate(shape) if i not in (0, axis)]
    return None if any(d is None for d in sizes) else int(np.prod(sizes, dtype=np.int64))


def _build_shape(layer):
    """The input shape ``layer`` was built for (Keras 2 records it when a layer is called),
    else -- a layer built directly by a wrapper -- what its ``input_spec`` states."""
    shape = getattr(layer, "_build_input_shape", None)
    if isinstance(shape, tf.TensorShape):
        shape = shape.as_list() if shape.rank is not None else None
    if shape is not None or not layer.built:
        return shape
    spec = layer.input_spec
    spec = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    if getattr(spec, "ndim", None) is None:
        return None
    shape = [None] * spec.ndim
    for axis, size in (spec.axes or {}).items():
        shape[axis] = size
    return shape


class _Fixer:
    """The recursive copy behind :func:`fix_batch_coupling`."""

    def __init__(self, max_groups):
        self.max_groups = max_groups
        self.report = BatchCouplingFix()
        self.pairs = []  # (old, new, copy_weights) in creation order, outer first

    def copy(self, layer, path):
        reason = coupling_reason(layer)
        if reason is not None:
            return self.replace(layer, path, reason)
        if _is_model(layer):
            return self.model(layer, path)
        inner = getattr(layer, "layer", None)
        wrapped = isinstance(layer, tf.keras.layers.Wrapper) and inner is not None
        if wrapped and coupling_layers(inner):
            if isinstance(layer, tf.keras.layers.Bidirectional):
                return self.unfixable(layer, path, "a Bidirectional wrapper is rebuilt by hand")
            config = layer.get_config()
            config.pop("layer")
            new = type(layer)(self.copy(inner, f"{path}/{inner.name}"), **config)
            self.pairs.append((layer, new, False))
            return new
        if any(coupling_layers(child) for child in children(layer)):
            return self.unfixable(
                layer,
                path,
                "inside a custom layer whose code creates it: rebuild that layer with "
                "GroupNormalization",
            )
        return self.same(layer)

    def same(self, layer):
        """A copy of ``layer`` from its config (its weights copied by :meth:`finish`)."""
        try:
            new = type(layer).from_config(layer.get_config())
        except (NotImplementedError, TypeError):
            raise ValueError(
                f"fix_batch_coupling cannot copy layer {layer.name!r} ({type(layer).__name__}): "
                "it has no get_config(). Implement get_config, or fix the model by hand."
            ) from None
        self.pairs.append((layer, new, True))
        return new

    def model(self, model, path):
        def clone(layer):
            return self.copy(layer, f"{path}/{layer.name}")

        new = tf.keras.models.clone_model(model, clone_function=clone)
        self.pairs.append((model, new, False))
        return new

    def unfixable(self, layer, path, why):
        for inner_path, inner, _ in coupling_layers(layer):
            suffix = inner_path.split("/", 1)[1] if "/" in inner_path else ""
            full = f"{path}/{suffix}" if suffix else path
            self.report.unfixed.append(Unfixed(full, type(inner).__name__, why))
        return self.same(layer)

    def replace(self, layer, path, reason):
        replacement = getattr(layer, "per_example_replacement", None)
        if not is_batch_normalization(layer):
            if callable(replacement):
                new = replacement()
                self.report.replaced.append(
                    Replacement(path, type(layer).__name__, type(new).__name__, "its own")
                )
                return new
            self.report.unfixed.append(
                Unfixed(path, type(layer).__name__, "no per_example_replacement()")
            )
            return self.same(layer)
        return self.group_norm(layer, path)

    def group_norm(self, layer, path):
        shape = _build_shape(layer)
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        if shape is None:
            self.report.unfixed.append(
                Unfixed(
                    path,
                    type(layer).__name__,
                    "not built, so its channel count is unknown: build the model first "
                    "(give its first layer an input_shape)",
                )
            )
            return self.same(layer)
        if len(axes) != 1:
            self.report.unfixed.append(
                Unfixed(path, type(layer).__name__, f"normalises over several axes {axes}")
            )
            return self.same(layer)
        axis = axes[0] % len(shape)
        channels = int(shape[axis])
        groups = group_count(channels, _positions(shape, axis), self.max_groups)
        config = layer.get_config()
        new = tf.keras.layers.GroupNormalization(
            groups=groups,
            axis=axis,
            epsilon=config["epsilon"],
            center=config["center"],
            scale=config["scale"],
            beta_initializer=config["beta_initializer"],
            gamma_initializer=config["gamma_initializer"],
            beta_regularizer=config["beta_regularizer"],
            gamma_regularizer=config["gamma_regularizer"],
            beta_constraint=config["beta_constraint"],
            gamma_constraint=config["gamma_constraint"],
            name=f"{layer.name}_gn",
            trainable=layer.trainable,
            dtype=config.get("dtype"),
        )
        self.pairs.append((layer, new, "bn"))
        self.report.replaced.append(
            Replacement(
                path,
                type(layer).__name__,
                "GroupNormalization",
                f"groups={groups} of {channels} channels; gamma and beta kept, moving "
                "statistics dropped",
            )
        )
        return new

    def finish(self):
        """Build what the clone left unbuilt, then copy the weights."""
        for old, new, _ in self.pairs:
            shape = _build_shape(old)
            if old.built and not new.built and shape is not None:
                _build_by_calling(new, shape)
        for old, new, how in self.pairs:
            if not old.built or how is False:
                continue
            if how == "bn":
                if old.scale:
                    new.gamma.assign(old.gamma)
                if old.center:
                    new.beta.assign(old.beta)
            else:
                new.set_weights(old.get_weights())


def _build_by_calling(layer, shape) -> None:
    """Build ``layer`` for ``shape`` by calling it on a symbolic input: unlike ``build``,
    this also creates the weights of the sub-layers a custom layer calls."""
    if all(d is None or isinstance(d, int) for d in shape):
        layer(tf.keras.Input(batch_shape=tuple(shape)))
    else:
        layer.build(shape)


def _built_for_shapes(layers) -> None:
    """Build a list's layers (through a throw-away ``Sequential``) when a batch
    normalisation in it is not built and the first layer states its input shape: the
    replacement needs the channel count."""
    unbuilt = any(not layer.built for _, layer, _ in coupling_layers(layers))
    if unbuilt and getattr(layers[0], "_batch_input_shape", None) is not None:
        try:
            tf.keras.Sequential(list(layers))
        except (TypeError, ValueError) as error:  # layers a Sequential cannot chain
            logger.debug("could not build the layers to read their shapes: %s", error)


def fix_batch_coupling(model, max_groups=32):
    """A copy of ``model`` in which no layer couples the examples of a batch, and a
    report of what changed.

    ``model``: a Keras ``Sequential`` or functional model (nested sub-models, wrappers
    such as ``TimeDistributed`` included), a single layer, or a list of layers (as
    :class:`lipdp.dpsgd.DPSGD_Sequential` takes). Every trainable batch normalisation
    (``BatchNormalization``, ``SyncBatchNormalization``, the v1 class) becomes a
    ``GroupNormalization`` over the same axis, with :func:`group_count` groups (the
    largest divisor of the channel count at most ``max_groups`` that leaves at least
    :data:`MIN_GROUP_VALUES` values per group and example, else 1), the same epsilon and
    gamma and
    beta (values, initialisers, regularisers, constraints); the moving statistics are
    dropped (a group normalisation has none). A frozen one (``trainable=False``) is kept:
    it runs in inference mode, a fixed affine map per example. A layer declaring
    ``couples_examples = True`` is replaced by its ``per_example_replacement()`` if it
    has one. Every other layer is copied with its weights.

    Returns ``(copy, report)``: ``report`` is a :class:`BatchCouplingFix` listing each
    replacement (path, old class, new class) and each coupling layer it could not fix
    (inside a custom layer's own code, an unbuilt batch normalisation whose channel count
    is unknown, a multi-axis one): the copy still holds those, and DP models refuse it.
    """
    fixer = _Fixer(max_groups)
    if isinstance(model, tf.keras.layers.Layer):
        new = fixer.copy(model, model.name)
    else:
        layers = list(model)
        _built_for_shapes(layers)
        new = [fixer.copy(layer, layer.name) for layer in layers]
    fixer.finish()
    if fixer.report.unfixed:
        logger.warning("fix_batch_coupling left layers that couple examples:\n%s", fixer.report)
    return new, fixer.report


def _is_model(layer) -> bool:
    return isinstance(layer, tf.keras.Sequential) or getattr(layer, "_is_graph_network", False)


__all__ = [
    "COUPLES_EXAMPLES",
    "MIN_GROUP_VALUES",
    "PROBE_ROWS",
    "PROBE_SEED",
    "PROBE_TOLERANCE",
    "BatchCouplingFix",
    "ProbeResult",
    "Replacement",
    "Unfixed",
    "check_per_example_values",
    "coupling_layers",
    "coupling_reason",
    "fix_batch_coupling",
    "group_count",
    "is_batch_normalization",
    "nested_layers",
    "probe",
    "probe_when_traced",
    "refuse_coupling_layers",
    "runs_in_inference_mode",
    "spec_key",
]
