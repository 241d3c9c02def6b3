r"""Rule S2 enforced: the examples of a batch do not interact in training.

Both families release ``sum_i g_i / n`` (``g_i``: the gradient of row ``i``'s loss) with
noise calibrated to one row's share. That is sound only if ``loss_i`` depends on row
``i`` alone -- its input and its label -- in training mode: a layer or a loss that uses
a statistic of the batch lets one row move every other row's gradient, and removing it
then changes the release by more than the declared sensitivity. Three checks enforce
it, for both families:

1. **A structural walk** (:func:`refuse_coupling_layers`, defined in
   :mod:`lipdp.core.coupling` and re-exported here: the JAX backend runs the same one),
   when a model is built, compiled and when its training step is traced: every layer
   reachable from the model's layers -- sub-models (``Sequential``, functional,
   subclassed), wrappers (``TimeDistributed``, ``Bidirectional``, anything with a
   ``layer``, ``forward_layer`` or ``backward_layer``), lipdp's ``DP_WrappedResidual``
   blocks, and the sub-layers a custom layer tracks -- is refused if it couples the
   examples of a batch in training: a ``BatchNormalization`` of any Keras class
   (``SyncBatchNormalization`` and the v1 class included) that is trainable, or a layer
   that declares itself coupling with the class or instance attribute
   ``couples_examples = True`` (:data:`COUPLES_EXAMPLES`: how users mark their own
   layers). A frozen ``BatchNormalization`` (``trainable = False``; Keras 2's class, not
   the v1 one) runs in inference mode with its moving statistics, which it does not
   update: a fixed affine map of each example, accepted.
2. **Per-example loss values** (:func:`check_per_example_values`), when the step is
   traced: the loss must return one value per row; a scalar (a batch mean), a tensor of
   another length, or a static leading axis of 1 when the batch axis is not statically
   1 (a ``keepdims`` batch mean, under Poisson sampling's batches of unknown size) is
   refused.
3. **A numerical probe** (:func:`probe`), once per model and input spec, when the step is
   first traced (``fit``, ``train_on_batch``, a custom loop calling ``train_step``), in
   training mode, eagerly. It runs :data:`SCENARIOS`, each a *weight point* and a
   *draw* (:data:`DRAWS`): ``N(0, 1)``, 8-bit pixels in ``[0, 1]`` with a dark
   background (non-negative) and mixed signs of magnitude ``1e2``-``1e4`` (rows of
   different scales) at the model's weights, then the weights scaled by
   :data:`WEIGHT_SCALE` (``N(0, 1)`` inputs) and perturbed by Gaussian noise of each
   variable's own size (pixels not scaled, ``0..255``), every variable put back exactly
   afterwards. Inputs
   follow the real input spec (shapes and dtypes; integer inputs are token ids, in a
   range valid for every ``Embedding``), labels are valid for the predictions, all from
   a local generator seeded with :data:`PROBE_SEED`. Batch sizes (:func:`probe_sizes`):
   :data:`PROBE_ROWS` = 4; the *full* batch, ``min(b, 8)`` rows (``b``: the metadata's
   rows per batch), on which the gradient checks run and every row is removed in turn;
   ``b`` itself and ``b + max(4, ceil(4 sqrt(b)))`` (more rows than a Poisson batch of
   expected size ``b`` holds but with probability ``< 1e-4``), both capped at
   :data:`MAX_PROBE_ROWS`. Every forward pass is replayed from the same state (the
   variables; every random generator of the model -- Keras' ``RandomGenerator`` of
   ``Dropout``, ``GaussianNoise`` and the random preprocessing layers, switched to
   stateless ops with fixed seeds (Keras 3: their ``SeedGenerator``, whose state seeds
   stateless ops, put back), ``tf.random.Generator`` objects of the layers, the global
   generators; TensorFlow's op seeds; numpy's and Python's random states), so that random
   layers draw the same numbers in every pass, and a row the same numbers at the same
   position of a batch; the user's state is put back afterwards, the global seed's
   sequence and the generators not advanced. In every scenario:

   * *inputs*: the Jacobian of the per-row losses with respect to the inputs and to the
     output of every top-level layer must be block-diagonal, ``d loss_i / d h_j = 0`` for
     ``j != i``: the gradient of the (randomly weighted) loss sum of each of the row sets
     of :func:`row_sets` must vanish on the rows outside the set (5 backward passes for
     the 8 rows of the full batch; the old probe took one per row). Integer inputs are
     covered through the first float outputs; stages before an op without a gradient
     (``RandomContrast``) are left to the comparisons below. The last stage whose
     Jacobian has off-diagonal blocks is followed by the coupling layer (or by the loss);
   * *labels*: on the predictions of that pass, changing the labels of each row set must
     leave the other rows' losses unchanged (per-batch class weights, as deel-lip's KR
     losses);
   * *extra losses*: ``add_loss`` terms must not depend on the inputs (one number for the
     whole batch is not a per-example loss);
   * *removal*, no gradient: in the first scenario every row of the full batch removed in
     turn (the remove-one relation), elsewhere each row set removed: every other row's
     outputs after every top-level layer and its loss must not move -- couplings
     gradients do not see (``tf.stop_gradient`` of a batch statistic, integer
     operations, a sort over the batch, the batch's largest logit), what depends on the
     number of rows or on a row's position in the batch;
   * *sizes*, at the model's weights: the first rows of the full batch alone
     (:data:`PROBE_ROWS`), and the first rows of the larger batch (and, in the first
     scenario, of the model-size one) must give the same outputs and losses as in the
     next smaller batch, and in the first scenario the model-size batch minus its last
     row must leave the others unchanged -- a coupling switched on above some batch
     size;
   * *variables*: after each of these passes, no variable -- non-trainable, and trainable
     when a pass assigns one (the scenario then runs again with them put back before
     every pass) -- may differ from the pass it is compared with (a random generator's
     state, advanced by the number of values drawn, excepted): a layer keeping
     statistics of the private batch (as batch normalisation's moving statistics) saves
     them with the model, never noised; refused, naming the layer's path and the
     variable;
   * *replay*, first scenario: a second pass on the same batch must give the same
     outputs, losses and variables; randomness the probe cannot reset (a generator it
     does not find) is refused, naming the layer (the escape hatch below), rather than
     certified;
   * *traced*, first scenario, models without randomness: the full and the model-size
     batches run once more in a ``tf.function`` (traced once for any number of rows,
     without autograph unless the code needs it), as training steps run, must give the
     same outputs, losses and variables as eagerly (a layer gated on
     ``tf.executing_eagerly()``).

   When the model draws random numbers (a generator found, or a global one used), a row's
   numbers depend on its position in the batch -- independent of the data, whatever the
   position, so no coupling -- and rows are compared at the same positions only: the row
   sets are redrawn (same shapes) instead of removed, the last row is removed as it is
   and the first with the batch rotated so that it is last; a deterministic output that
   depends on a row's position is refused only for models without randomness.
   *Non-finite values* (a draw or a weight point overflowing a legitimate model, e.g. a
   softmax of logits of ``1e4``): a row's values compare equal when the same entries are
   non-finite in both passes (a row that overflows does so in every pass) and the others
   agree; the Jacobian counts non-finite entries 0 (``0 * inf = nan`` in a row's own
   operations, even from a zero cotangent, says nothing about the other rows). A
   scenario on which an operation fails (an assertion on the inputs' range) is skipped
   and listed in :class:`ProbeResult` (``skipped``), never a refusal; the first one must
   run.

   Cost, once per model (``benchmarks/probe_cost.py``: the first training step with the
   probe on and off, each in a fresh process, medians of 3 rounds, two CPU cores shared
   with other jobs): 44 forward passes (5 taped, 37 eager of at most 8 rows but for 5 of
   ``b`` to ``b + 4 sqrt(b)`` rows, 2 traced), 25 backward passes and one trace. On the
   digits CNN of ``lipdp train`` (``b = 512``) it adds 1.5 s to a first step of 1.6 s in
   a fresh process and 0.9 s to one of 0.9 s in a process that has trained a model
   before (the probe of issue 26: 0.4 s and 0.09 s); on the small Keras CNN of ``lipdp
   train --method dp-sgd``, 0.7 s to 1.3 s and 0.6 s to 0.8 s (issue 26: 0.3 s and 0.2
   s); later steps take 0.01 s. Three test files that train some 70 small models
   (``tests/clipped/test_model.py``, ``tests/core/test_train_step.py``,
   ``tests/clipless/test_model.py``) run in 68 s instead of 60 s.
   Memory (issue 39): at most one large pass is held whole at a time -- the model-size
   one of the first scenario, the reference of the passes that follow it. A pass used in
   one comparison only (the larger batch, the model-size batch minus its last row) is
   compared stage by stage as its layers return their outputs and keeps the verdicts,
   not the outputs; kept outputs are numpy views of the tensors' buffers (no copy); the
   comparisons run in float64 pieces of :data:`COMPARE_CHUNK` entries. The same tests on
   the same values as when every pass was kept (``tests/core/test_batch_independence.py``:
   couplings only those passes show are refused), in about a quarter of the memory: on
   the CNN of ``benchmarks/large_batches.py`` at ``P = 512`` (passes of 512 and 603
   rows) the probe's peak went from +1 486 MB to +395 MB above the built model, below the
   clipped step's own peak.
   The model argument ``independence_probe=False`` skips it (the structural walk and the
   per-example check still run); :func:`lipdp.core.report.privacy_report` then says so.

**What the probe cannot prove.** It tests points, not every batch: a coupling that is
inactive on every pass it runs escapes it, whatever it draws -- gated on a band of
activations, of batch sizes or of input statistics it does not visit (e.g. features
between 20 and 100, batches of 9 to ``b - 2`` rows or of more than ``b + 4 sqrt(b)``),
on weights that training reaches and its three points do not, on the step count, or on
being traced together with another condition (the traced passes run one draw at two
sizes; for a model that draws random numbers they are not compared). A layer can always
be written to pass it. The guarantee that
cannot be outwitted is structural: each example's loss computed in isolation, as the
JAX backend's row-wise ``vmap`` does (issue 37 builds the same for the TensorFlow
step). The probe catches couplings that real data switches on by accident --
the red team's six constructions of issue 37 (``tests/couplings.py``) are refused at
every one of 20 weight initialisations (``benchmarks/probe_detection.py``) -- and the
walk and the per-example contract of the documentation remain the rule.

:func:`fix_batch_coupling` (:mod:`lipdp.core.coupling_fix`, re-exported here) returns a
copy of a model (``Sequential``, functional, nested sub-models, or a list of layers) with
every trainable ``BatchNormalization`` replaced by a ``GroupNormalization`` (per-example
statistics), and a :class:`BatchCouplingFix` report of what changed and of what it could
not fix.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as eager_context
from tensorflow.python.ops import stateful_random_ops

from lipdp.core.coupling import (  # the structural walk, re-exported (one module for every backend)
    COUPLES_EXAMPLES,
    coupling_layers,
    coupling_reason,
    is_batch_normalization,
    refuse_coupling_layers,
    runs_in_inference_mode,
)
from lipdp.core.coupling_fix import (  # the fixer, re-exported (its old import path)
    MIN_GROUP_VALUES,
    BatchCouplingFix,
    Replacement,
    Unfixed,
    fix_batch_coupling,
    group_count,
)
from lipdp.foundation import compat
from lipdp.foundation.layer_walk import nested_layers
from lipdp.foundation.variables import variable_key

logger = logging.getLogger(__name__)

#: Rows of the probe's small batch (the whole probe batch of issue 26).
PROBE_ROWS = 4

#: Most rows of the probe batch on which the Jacobian is taken and every row is removed in
#: turn: the model's batch size ``b`` when smaller (the probe then runs at ``b`` exactly).
#: Removing each of ``n`` rows costs ``n`` forward passes of ``n - 1`` rows (``2 n`` with
#: random layers), hence the cap; couplings that need more rows to show are left to the
#: large batch below.
REMOVE_EACH_ROWS = 8

#: Most rows of the probe's large batch, ``b + max(4, ceil(4 sqrt(b)))`` below the cap:
#: more than a Poisson batch of expected size ``b`` holds, but with probability
#: ``< 1e-4`` (its standard deviation is ``sqrt(b (1 - q)) <= sqrt(b)``). Two forward
#: passes of that size (it, and it minus its last row) per draw at the model's weights, no
#: gradient. Above the cap (``b > 930`` or so), batch sizes between the cap and ``b`` are
#: not probed.
MAX_PROBE_ROWS = 1024

#: The draws of float inputs: ``"gaussian"``, ``N(0, 1)`` (standardised features);
#: ``"unit"``, 8-bit pixels scaled to ``[0, 1]`` (``k / 255``, ``k`` uniform, and a share
#: :data:`PIXEL_ZEROS` of exact zeros: non-negative, as images); ``"large"``, mixed signs
#: of large magnitude (each row ``N(0, 1)`` times ``10**u``, ``u`` uniform over the
#: exponents of :data:`LARGE_MAGNITUDES`: unnormalised features, rows differing in scale
#: by up to 100x); ``"bytes"``, the pixels of ``"unit"`` not scaled (``0..255``, images
#: fed as they are stored).
DRAWS = ("gaussian", "unit", "large", "bytes")

#: Share of exact zeros in the ``"unit"`` draw (the background of an image).
PIXEL_ZEROS = 0.3

#: Range of the row magnitudes of the ``"large"`` draw.
LARGE_MAGNITUDES = (1e2, 1e4)

#: The weight points: the model's weights; every float trainable variable times
#: :data:`WEIGHT_SCALE`; every one plus Gaussian noise of its own root mean square (0.1 for
#: a variable of zeros). Each is put back exactly afterwards.
WEIGHT_POINTS = ("current", "scaled", "perturbed")

#: Factor of the ``"scaled"`` weight point (large activations behind a normalisation).
WEIGHT_SCALE = 3.0

#: The probe's scenarios, ``(weight point, draw)``: three draws at the model's weights
#: (with the batches of the model's size and larger; in the first, every row of the full
#: batch removed in turn and the traced passes), and one draw at each other weight point.
SCENARIOS = (
    ("current", "gaussian"),
    ("current", "unit"),
    ("current", "large"),
    ("scaled", "gaussian"),
    ("perturbed", "bytes"),
)

#: Seed of the probe's local generator (its inputs, labels and weight perturbations).
PROBE_SEED = 2602

#: Relative size, in squared norm, of an off-diagonal block of the probe's Jacobian, or
#: of a change of a row's loss or output (relative to the whole compared block), above
#: which rows are deemed coupled: exactly 0 for layers that treat rows separately (their
#: cotangents are exact zeros), about ``1 / B^2`` for a batch mean over ``B`` rows.
PROBE_TOLERANCE = 1e-10

#: Entries compared at once (float64) by the probe's comparisons: bounds their temporary
#: memory (8 MB a copy) whatever the size of the compared outputs.
COMPARE_CHUNK = 1 << 20


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
    # A batch of unknown size (every Poisson pipeline) has no static leading 1: a loss
    # that has one reduced over the batch (keepdims), and broadcasting would then give
    # every row the batch's mean.
    if shape[0] == 1 and rows[0] != 1:
        raise ValueError(
            f"The loss {name!r} returns a leading axis of 1 for a batch of any size (a "
            "reduction over the batch, e.g. keepdims=True): it must return one loss per "
            "example, shape (batch,) (rule S2)."
        )


# ------------------------------------------------------------------------- probe
@dataclass(frozen=True)
class ProbeResult:
    """What a probe checked: ``stages`` tensors watched by the Jacobian (inputs and
    top-level outputs), ``labels`` whether labels were perturbed, ``random_generators``
    the random generators replayed identically in every pass (Keras ``RandomGenerator``
    or ``SeedGenerator`` and ``tf.random.Generator`` objects of the layers), ``variables``
    the non-trainable variables checked for dependence on the data; ``sizes`` the
    ``(small, full, large)`` batch sizes; ``scenarios`` the ``"point/draw"`` pairs run,
    ``skipped`` those an operation failed on (``"point/draw: error"``); ``passes`` the
    forward passes run."""

    stages: int
    labels: bool
    random_generators: int
    variables: int
    sizes: tuple = ()
    scenarios: tuple = ()
    skipped: tuple = ()
    passes: int = 0


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


def probe_sizes(batch_size) -> tuple[int, int, int, int]:
    """``(small, full, batch, large)`` rows of the probe's batches for a model of batch
    size ``b = batch_size`` (``None``: unknown, taken as ``2 * PROBE_ROWS``):
    :data:`PROBE_ROWS`; ``b`` capped to :data:`REMOVE_EACH_ROWS` (at least
    ``PROBE_ROWS + 1``); ``b`` capped to :data:`MAX_PROBE_ROWS` (at least ``full``); and
    ``b + max(PROBE_ROWS, ceil(4 sqrt(b)))`` capped to :data:`MAX_PROBE_ROWS` (at least
    ``batch + 1``)."""
    b = 2 * PROBE_ROWS if batch_size is None else max(1, int(batch_size))
    full = min(max(b, PROBE_ROWS + 1), REMOVE_EACH_ROWS)
    batch = max(min(b, MAX_PROBE_ROWS), full)
    large = max(b, full) + max(PROBE_ROWS, math.ceil(4 * math.sqrt(b)))
    return PROBE_ROWS, full, batch, max(min(large, MAX_PROBE_ROWS), batch + 1)


def _model_batch_size(model):
    """The most rows one pass of the model's training step computes: the rows of its
    training batches (its metadata's), or its ``physical_batch_size`` when smaller (the
    step then runs the network on micro-batches of at most that many rows, so no coupling
    can involve more: probed at that size, in the memory of one micro-batch); ``None``
    when unknown."""
    metadata = getattr(model, "dataset_metadata", None)
    try:
        rows = int(metadata.rows_per_batch)
    except (AttributeError, TypeError, ValueError):
        return None
    physical = getattr(model, "physical_batch_size", None)
    return rows if physical is None else min(rows, int(physical))


def _token_range(model, wide=False) -> int:
    """Integer inputs are drawn in ``[0, k)``: ``k`` = the smallest ``input_dim`` of the
    model's ``Embedding`` layers (at most 8 unless ``wide``), 2 without one."""
    sizes = [
        int(layer.input_dim)
        for _, layer in nested_layers(model.layers_forward_order())
        if isinstance(layer, keras.layers.Embedding)
    ]
    if not sizes:
        return 2
    return max(1, min(sizes) if wide else min([8, *sizes]))


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


def _float_draw(rng, shape, draw):
    """Float values of one of the :data:`DRAWS`."""
    if draw in ("unit", "bytes"):  # 8-bit pixels with a dark background, scaled or not
        values = rng.integers(0, 256, shape) / (255.0 if draw == "unit" else 1.0)
        return np.where(rng.uniform(size=shape) < PIXEL_ZEROS, 0.0, values)
    values = rng.standard_normal(shape)
    if draw == "large":
        low, high = np.log10(LARGE_MAGNITUDES)
        scales = 10.0 ** rng.uniform(low, high, shape[:1])
        values *= scales.reshape([-1] + [1] * (len(shape) - 1))
    return values


def _random_values(spec, shape, rng, tokens, draw="gaussian"):
    dtype = spec.dtype
    if dtype.is_floating or dtype.is_complex:
        values = _float_draw(rng, shape, draw)
    elif dtype.is_integer:
        values = rng.integers(0, tokens, shape)
    elif dtype.is_bool:
        values = rng.integers(0, 2, shape).astype(bool)
    elif dtype == tf.string:
        return tf.constant(rng.choice(np.array(["a", "b"]), shape))
    else:
        raise TypeError(f"The batch-independence probe cannot draw inputs of dtype {dtype}.")
    return tf.constant(values, dtype=dtype)


def _probe_inputs(model, spec, rows, rng, draw="gaussian"):
    """Inputs of the spec (unknown axes from the shape the model was built for), of the
    draw ``draw`` (integers: token ids, over every id of the smallest ``Embedding`` for
    the ``"large"`` draw)."""
    fallback = compat.build_input_shape(model)
    if isinstance(fallback, tf.TensorShape):
        fallback = fallback.as_list() if fallback.rank is not None else None
    single = len(tf.nest.flatten(spec)) == 1
    if not single or not isinstance(fallback, (list, tuple)):
        fallback = None
    elif not all(d is None or isinstance(d, int) for d in fallback):
        fallback = None
    tokens = _token_range(model, wide=draw == "large")
    return tf.nest.map_structure(
        lambda s: _random_values(s, _probe_shape(s.shape, rows, fallback), rng, tokens, draw),
        spec,
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


def _changed_label(labels, rows, classes):
    """``labels`` with the rows ``rows`` (an index or a boolean mask) given another valid
    label each."""

    def change(t):
        values = t.numpy().copy()
        kind = _label_kind(list(values.shape), t.dtype, classes)
        if kind == "one-hot":
            values[rows] = np.roll(values[rows], 1, axis=-1)
        elif kind == "ids":
            values[rows] = (values[rows] + 1) % max(classes, 2)
        else:
            values[rows] = 1 - values[rows]
        return tf.constant(values, dtype=t.dtype)

    return tf.nest.map_structure(change, labels)


def _redrawn(x, rng, tokens, draw, rows):
    """``x`` with the rows ``rows`` (a boolean mask) drawn again, from the same draw."""

    def redraw(t):
        shape = t.shape.as_list()
        fresh = _random_values(tf.TensorSpec(t.shape, t.dtype), shape, rng, tokens, draw)
        keep = tf.reshape(tf.constant(~rows), [-1] + [1] * (t.shape.rank - 1))
        return tf.where(keep, t, fresh)

    return tf.nest.map_structure(redraw, x)


def _take(value, rows):
    """Rows ``rows`` (a list of indices) of every tensor of ``value``."""
    if value is None:
        return None
    return tf.nest.map_structure(lambda t: tf.gather(t, rows), value)


def _float_tensors(value) -> list:
    return [t for t in tf.nest.flatten(value) if t.dtype.is_floating]


def row_sets(rows) -> list:
    """Boolean masks of ``rows`` rows such that for every ordered pair of rows ``i != j``
    some set holds ``j`` and not ``i`` (a completely separating system): what row ``j``
    does to row ``i`` shows when that set is changed and row ``i`` is compared. With
    ``k`` sets, row ``r`` gets the ``r``-th subset of ``k // 2`` of them: distinct
    subsets of one size never contain one another. ``k`` is the least with
    ``C(k, k // 2) >= rows``: about ``log2(rows) + log2(log2(rows)) / 2`` (5 sets for 8
    rows, 6 for 16) instead of ``rows``. The probe's Jacobian differentiates the weighted
    loss sum of each set, and its removal and replacement checks change each set."""
    k = 2
    while math.comb(k, k // 2) < rows:
        k += 1
    members = list(itertools.combinations(range(k), k // 2))[:rows]
    sets = [np.array([s in member for member in members]) for s in range(k)]
    return [inside for inside in sets if inside.any() and not inside.all()]


def _moved(a, b) -> bool:
    """Whether two values differ beyond float round-off: relative to the squared norm of
    the whole block ``a`` (its finite entries); a non-finite entry must be the same
    non-finite value in both (a row that overflows does so in every pass).

    Computed in float64 over consecutive pieces of :data:`COMPARE_CHUNK` entries (the sums
    of squares accumulated over the pieces): the same test as on the whole arrays, with
    float64 temporaries of one piece instead of several copies of a stage of a large probe
    batch (issue 39: they set the probe's peak memory)."""
    a, b = np.ravel(a), np.ravel(b)
    change = norm = 0.0
    for start in range(0, a.size, COMPARE_CHUNK):
        piece_a = np.asarray(a[start : start + COMPARE_CHUNK], np.float64)
        piece_b = np.asarray(b[start : start + COMPARE_CHUNK], np.float64)
        finite_a, finite_b = np.isfinite(piece_a), np.isfinite(piece_b)
        if np.any(finite_a != finite_b):
            return True
        odd = ~finite_a
        if np.any(odd):
            x, y = piece_a[odd], piece_b[odd]
            if not np.all((x == y) | (np.isnan(x) & np.isnan(y))):
                return True
            piece_a, piece_b = piece_a[finite_a], piece_b[finite_a]
        change += float(np.sum(np.square(piece_a - piece_b)))
        norm += float(np.sum(np.square(piece_a)))
    return change > PROBE_TOLERANCE * max(norm, 1e-30)


def _rows_moved(a, b) -> bool:
    """Whether two values of the same rows differ (in shape, or beyond round-off)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape != b.shape or _moved(a, b)


def _detached(h):
    """``h`` with every tensor copied out of the tape's history."""
    return tf.nest.map_structure(
        lambda t: tf.constant(t.numpy()) if isinstance(t, tf.Tensor) else t, h
    )


class _Forward:
    """One forward pass in training mode, recording the float outputs of every top-level
    layer (``stages[k]``: layer ``k``'s; ``-1``: the inputs); with a ``tape``, those of
    stage ``cut`` and after are watched (``watched``: ``[(stage, tensor)]``), stage
    ``cut``'s copied out of the history of the layers before (:func:`_taped_pass`). A pass
    keeps its ``labels``, per-row ``losses`` and the values of the variables the replay
    tracks after it (``variables``); the taped pass also the weighted loss sums of the
    Jacobian's row sets (``targets``) and the ``extra`` losses.

    ``against = (reference, reference_rows, own_rows, own_first)``: a pass whose only use
    is one comparison with the pass ``reference`` (rows ``reference_rows`` of it against
    rows ``own_rows`` of this one; this pass in the role of ``first`` of
    :meth:`_Probe.difference` if ``own_first``) makes that comparison stage by stage as
    each layer returns its outputs, and keeps the verdicts (``compared``: ``{stage:
    moved}``), not the outputs: the same tests on the same values, without holding a
    second large batch's every activation (issue 39: the probe's peak memory)."""

    labels = losses = targets = sets = extra = variables = first_gradients = None

    def __init__(self, model, x, tape=None, cut=-1, against=None):
        self.stages, self.watched, self._arrays = {}, [], {}
        # A pass without a tape keeps its outputs as numpy arrays only (what its
        # comparisons read; views of the tensors' buffers, no copy), not the tensors.
        self._tensors = tape is not None
        self.against, self.compared = against, {}
        self._record(-1, x, tape if cut < 0 else None)

        def observe(index, h):
            if index == cut:
                h = _detached(h)
            return self._record(index, h, tape if index >= cut else None)

        self.y_pred = model.forward(x, training=True, observe=observe)

    def _record(self, stage, h, tape):
        self.stages[stage] = _float_tensors(h)
        if not self._tensors:
            self.stages[stage] = self._arrays[stage] = [np.asarray(t) for t in self.stages[stage]]
        if self.against is not None and stage >= 0:
            reference, reference_rows, own_rows, own_first = self.against
            theirs, mine = reference.arrays(stage), self._arrays.pop(stage)
            pairs = [(b[own_rows], a[reference_rows]) for a, b in zip(theirs, mine)]
            self.compared[stage] = len(mine) != len(theirs) or any(
                _rows_moved(*(pair if own_first else pair[::-1])) for pair in pairs
            )
            self.stages[stage] = None  # compared, not kept
        if tape is not None:
            for t in self.stages[stage]:
                tape.watch(t)
                self.watched.append((stage, t))
        return h

    def arrays(self, stage) -> list:
        """The outputs of ``stage`` as numpy arrays."""
        if stage not in self._arrays:
            self._arrays[stage] = [t.numpy() for t in self.stages[stage]]
        return self._arrays[stage]

    def loss_values(self) -> np.ndarray:
        if not isinstance(self.losses, np.ndarray):
            self.losses = tf.convert_to_tensor(self.losses).numpy()
        return self.losses


#: Plural of what a comparison found moved, in the singular.
_ONE = {"outputs": "output", "losses": "loss"}


def _describe_stage(model, stage) -> str:
    """What follows ``stage``: the next top-level layer, or the loss."""
    layers = model.layers_forward_order()
    if stage + 1 < len(layers):
        layer = layers[stage + 1]
        return f"layer {layer.name!r} ({type(layer).__name__})"
    return f"the loss {_loss_name(model.loss)!r}"


def _probe_error(subject, problem, fix) -> ValueError:
    """The probe's one-line refusal: what, why, the fix, the escape hatch."""
    return ValueError(
        f"Batch-independence probe: {subject} {problem}. {fix}, or pass "
        "independence_probe=False to the model if you are sure (the privacy report then "
        "says so)."
    )


def _refuse(what, how) -> None:
    if what.startswith("the loss"):
        fix = (
            "Use a loss whose value for row i depends on row i's prediction and label only "
            "(not on the other rows, nor on their number)"
        )
    else:
        fix = (
            "Make it treat each example on its own (no statistic over the batch axis, "
            "nothing that depends on the batch size)"
        )
    raise _probe_error(what, f"couples the examples of a batch in training ({how}; rule S2)", fix)


def _jacobian_sets(rows, rng) -> list:
    """``[(inside, weights)]``: the row sets of :func:`row_sets` and, for each, weights
    drawn in ``[1, 2]`` on its rows (0 elsewhere): the loss sums :func:`_check_jacobian`
    differentiates."""
    return [(inside, rng.uniform(1.0, 2.0, rows) * inside) for inside in row_sets(rows)]


def _check_jacobian(model, forward, tape, rows, where) -> None:
    """The block-diagonal check of the per-row losses' Jacobian, by row sets
    (:func:`row_sets`): the gradient of the weighted sum of the losses of a set
    (``forward.targets``) must vanish on the rows outside the set, at every watched
    stage. Exact zeros when rows are independent, whatever the backward pass does to a
    row's own cotangent (a per-example clipping of it is not linear); the weights, drawn
    in ``[1, 2]``, keep the rows of a set from cancelling but on a set of measure zero. A
    stage is coupled when the squared norm outside exceeds :data:`PROBE_TOLERANCE` times
    the squared norm inside; non-finite entries count 0 (a row whose own values overflow
    gets ``0 * inf = nan`` cotangents in its own operations even from a zero cotangent,
    which says nothing about other rows). ``len(row_sets(n))`` backward passes, 5 for 8
    rows, instead of the old probe's ``n``."""
    stages = sorted(forward.stages)
    for stage in stages[1:]:
        for t in forward.stages[stage]:
            if t.shape.rank == 0 or t.shape[0] != rows:
                _refuse(
                    _describe_stage(model, stage - 1),
                    f"its output of shape {t.shape} has no batch axis of {rows} rows",
                )
    coupled = set()
    for index, (inside, _) in enumerate(forward.sets):
        grads = forward.first_gradients if index == 0 else None
        if grads is None:
            grads = _target_gradients(tape, forward, index)
        for (stage, _), g in zip(forward.watched, grads):
            if stage in coupled:
                continue
            values = _row_values(g, rows)
            energies = np.square(np.where(np.isfinite(values), values, 0.0)).sum(axis=1)
            off, own = float(energies[~inside].sum()), float(energies[inside].sum())
            if off > 0 and off > PROBE_TOLERANCE * own:
                coupled.add(stage)
    if coupled:
        _refuse(
            _describe_stage(model, max(coupled)),
            f"one row's loss has a non-zero gradient with respect to another row's input{where}",
        )


def _row_values(gradient, rows) -> np.ndarray:
    """A gradient as a float64 array of shape ``(rows, -1)``."""
    return tf.convert_to_tensor(gradient).numpy().astype(np.float64).reshape(rows, -1)


def _target_gradients(tape, forward, index) -> list:
    """The gradients of ``forward.targets[index]`` w.r.t. the watched stages."""
    return tape.gradient(
        forward.targets[index],
        [t for _, t in forward.watched],
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )


def _extra_loss_total(model):
    """The sum of the model's ``add_loss`` terms (and weight penalties), or ``None``."""
    extra = list(model.losses)
    if not extra:
        return None
    return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in extra])


def _check_extra_losses(total, watched, tape) -> None:
    """``add_loss`` terms must not depend on the data (weight penalties do not)."""
    if total is None:
        return
    grads = tape.gradient(total, [t for _, t in watched])
    if any(g is not None and float(tf.reduce_sum(tf.abs(g))) > 0 for g in grads):
        _refuse(
            "the model's add_loss terms",
            "they depend on the inputs: one number for the whole batch, not a per-example loss",
        )


def _check_labels(model, labels, y_pred, losses, rows, where) -> bool:
    """The labels of each row set of :func:`row_sets` changed, on the same predictions:
    the other rows' losses must not move (per-batch class weights, as deel-lip's KR
    losses)."""
    if labels is None:
        return False
    classes = _classes(y_pred)
    for inside in row_sets(rows):
        changed = model.per_example_losses(_changed_label(labels, inside, classes), y_pred)
        if _rows_moved(losses[~inside], changed.numpy()[~inside]):
            _refuse(
                f"the loss {_loss_name(model.loss)!r}",
                f"one row's loss changes when another row's label changes{where}",
            )
    return True


# ------------------------------------------------------------ replayed passes
#: Keras 2's ``RandomGenerator`` draws through TensorFlow's stateless random ops with this
#: ``_rng_type``: a function of its seed and of the element's index, no state.
_STATELESS_RNG = "stateless"


def _is_keras_random_generator(value) -> bool:
    """What ``Dropout``, ``GaussianNoise`` and the random preprocessing layers draw from:
    Keras 2's ``backend.RandomGenerator`` (not public API: matched by what it has), Keras
    3's ``keras.random.SeedGenerator`` (a seed state variable; Keras 3's random ops on
    TensorFlow are stateless functions of the seed it hands out)."""
    if compat.keras_3():
        return isinstance(value, keras.random.SeedGenerator)
    return isinstance(getattr(value, "_rng_type", None), str) and callable(
        getattr(value, "make_legacy_seed", None)
    )


def _attribute_values(layer):
    """The values of ``layer``'s attributes, one level into lists, tuples and dicts."""
    for value in list(vars(layer).values()):
        if isinstance(value, Mapping):
            yield from list(value.values())
        elif isinstance(value, (list, tuple)):
            yield from list(value)
        else:
            yield value


def random_sources(layers) -> tuple[list, list]:
    """``(keras, tensorflow)``: the Keras ``RandomGenerator`` (Keras 3: ``SeedGenerator``)
    and the ``tf.random.Generator`` objects held by ``layers`` at any depth
    (:func:`nested_layers`), as ``[(path, generator)]``."""
    keras, tensorflow, seen = [], [], set()
    for path, layer in nested_layers(layers):
        for value in _attribute_values(layer):
            if id(value) in seen:
                continue
            if _is_keras_random_generator(value):
                keras.append((path, value))
            elif isinstance(value, tf.random.Generator):
                tensorflow.append((path, value))
            else:
                continue
            seen.add(id(value))
    return keras, tensorflow


class _Replay:
    """Every pass of the probe from the same state, and the user's state left as it was.

    A training pass may draw randomness (``Dropout``, ``GaussianNoise``, random
    augmentation) and update the model's non-trainable variables. Before each pass,
    :meth:`reset` puts back: the non-trainable variables' values; every Keras
    ``RandomGenerator`` of the model (what Keras' random layers draw from), switched to
    stateless random ops with a fixed seed each (Keras 2 supports its three generator
    types in every random layer; Keras 3's ``SeedGenerator`` always seeds stateless ops:
    its state is put back): the same numbers in every pass, and, indexed by element,
    the same numbers for the other rows of a batch minus its last row; the state of every
    ``tf.random.Generator`` the layers hold and of the global generator (and of Keras 3's
    global ``SeedGenerator``, of its random ops called without a seed);
    TensorFlow's eager op-seed sequence under the global seed :data:`PROBE_SEED`
    (for ``tf.random`` ops called directly); numpy's and Python's global random states.
    Stateful random kernels keep their state in TensorFlow's kernel cache: with
    ``clear_kernels`` each reset also clears it, as ``tf.random.set_seed`` does (slower:
    every kernel is built again; :func:`probe` does so only when two passes differ
    without it). :meth:`restore` puts everything back as it was before the probe (the
    user's generators are not advanced; after a cleared cache, eager random ops with an
    explicit op seed restart their sequence, as after ``tf.random.set_seed``). Randomness
    the probe does not know of is caught by comparing two passes on the same batch
    (:func:`_check_replayed`).
    """

    def __init__(self, model, clear_kernels=False, track_trainable=False):
        self.clear_kernels = clear_kernels
        self.context = eager_context.context()
        self.variables = list(model.non_trainable_variables)
        if track_trainable:
            self.variables += list(model.trainable_variables)
        self.values = [v.numpy() for v in self.variables]
        self.keras, self.tensorflow = random_sources(model.layers_forward_order())
        if compat.keras_3():  # a SeedGenerator is its state variable
            self.keras_saved = [g.state.numpy() for _, g in self.keras]
        else:
            self.keras_saved = [
                (g._rng_type, g._seed, g._built, getattr(g, "_generator", None))  # noqa: SLF001
                for _, g in self.keras
            ]
        self.tensorflow_states = [g.state.numpy() for _, g in self.tensorflow]
        #: Variables a pass advances by an amount that depends on the batch size only.
        self.generator_states = {variable_key(g.state) for _, g in self.tensorflow}
        self.global_seed = self.context._seed  # noqa: SLF001 - no public getter of both
        self.op_seeds = getattr(self.context, "_rng", None)
        self.numpy_state = np.random.get_state()
        self.python_state = random.getstate()
        # tf.random.get_global_generator()'s, if it exists (created on first use)
        self.global_generator = stateful_random_ops.global_generator
        if self.global_generator is not None:
            self.global_state = self.global_generator.state.numpy()
        # Keras 3's, of its random ops called without a seed (created on first use)
        self.keras_global = compat.keras_global_seed_generator()
        if self.keras_global is not None:
            self.keras_global_state = self.keras_global.state.numpy()

    def _seed_context(self, seed, op_seeds) -> None:
        """TensorFlow's global seed and op-seed sequence (not public API)."""
        if self.clear_kernels:
            self.context._set_global_seed(seed)  # noqa: SLF001 - clears the kernel cache
        else:
            self.context._seed = seed  # noqa: SLF001
        self.context._rng = op_seeds  # noqa: SLF001

    def reset(self) -> None:
        """The state every pass starts from."""
        self._seed_context(PROBE_SEED, random.Random(PROBE_SEED))
        if not compat.keras_3():  # Keras 3's generators are put back with the variables
            for index, (_, g) in enumerate(self.keras):
                g._rng_type, g._built, g._seed = _STATELESS_RNG, True, PROBE_SEED + index  # noqa: SLF001
        self._put_back_saved_state()

    def restore(self) -> None:
        """The state before the probe."""
        self._seed_context(self.global_seed, self.op_seeds)
        if not compat.keras_3():
            for (_, g), saved in zip(self.keras, self.keras_saved):
                g._rng_type, g._seed, g._built, g._generator = saved  # noqa: SLF001
        self._put_back_saved_state()

    def _put_back_saved_state(self) -> None:
        """What every pass and the end of the probe share: the variables, the
        ``tf.random.Generator`` states (and Keras 3's ``SeedGenerator`` states), the global
        generators, numpy's and Python's states."""
        for v, value in zip(self.variables, self.values):
            v.assign(value)
        for (_, g), state in zip(self.tensorflow, self.tensorflow_states):
            g.state.assign(state)
        if compat.keras_3():  # also held outside the tracked variables (a dict, a list)
            for (_, g), state in zip(self.keras, self.keras_saved):
                g.state.assign(state)
        self._reset_global_generator()
        np.random.set_state(self.numpy_state)
        random.setstate(self.python_state)

    def _reset_global_generator(self) -> None:
        """The global generator as it was (none: one a pass creates is dropped, so two
        passes differ, refused; the probe creates no variable: a ``tf.function``
        being traced again may not)."""
        stateful_random_ops.global_generator = self.global_generator
        if self.global_generator is not None:
            self.global_generator.state.assign(self.global_state)
        # Keras 3's: one a pass creates is dropped too; its seed comes from Python's random
        # state, reset before every pass, so every pass creates the same one.
        compat.set_keras_global_seed_generator(self.keras_global)
        if self.keras_global is not None:
            self.keras_global.state.assign(self.keras_global_state)

    def variable_values(self) -> list:
        return [v.numpy() for v in self.variables]

    def random(self, after_pass=False) -> bool:
        """Whether the model draws random numbers the probe replays: a random generator
        of its layers, or (``after_pass``: called after a pass, before the next reset) a
        global generator -- TensorFlow's or Keras 3's -- the pass created or advanced."""
        if self.keras or self.tensorflow:
            return True
        if not after_pass:
            return False
        found = stateful_random_ops.global_generator
        if found is not self.global_generator:
            return True
        if found is not None and not np.array_equal(found.state.numpy(), self.global_state):
            return True
        found = compat.keras_global_seed_generator()
        if found is not self.keras_global:
            return True
        return found is not None and not np.array_equal(
            found.state.numpy(), self.keras_global_state
        )


@contextlib.contextmanager
def _replayed(model, clear_kernels, track_trainable=False):
    replay = _Replay(model, clear_kernels, track_trainable)
    try:
        yield replay
    finally:
        replay.restore()


def _variable_owners(model) -> dict:
    """``variable_key(variable) -> (path of the deepest layer holding it, layer)``."""
    owners = {}
    for path, layer in nested_layers(model.layers_forward_order()):
        for v in layer.variables:
            owners[variable_key(v)] = (path, layer)  # later (deeper) layers overwrite
    return owners


def _short_name(variable) -> str:
    return variable.name.split(":")[0].rsplit("/", 1)[-1]


def _moved_variables(replay, before, after, skip=frozenset()) -> list:
    """The variables of ``replay`` whose values ``after`` differ from ``before``."""
    return [
        v
        for v, a, b in zip(replay.variables, before, after)
        if variable_key(v) not in skip and _rows_moved(a, b)
    ]


class _NotReplayed(Exception):
    """Two passes from the same state differ (:meth:`_Probe.check_replayed`); ``refusal``:
    the ``ValueError`` to raise if clearing the kernel cache does not help."""

    def __init__(self, refusal):
        super().__init__(str(refusal))
        self.refusal = refusal


class _TrainableAssigned(Exception):
    """A pass assigned a trainable variable: the scenario runs again with the trainable
    variables put back before every pass and compared (:class:`_Replay`)."""


def _describe_variable(model, variable) -> tuple:
    path, layer = _variable_owners(model).get(variable_key(variable), (model.name, model))
    return path, layer, _short_name(variable)


def _refuse_data_variables(model, moved, how) -> None:
    """Refuse a variable a training pass updates from the data."""
    if not moved:
        return
    path, layer, name = _describe_variable(model, moved[0])
    raise _probe_error(
        f"layer {path!r} ({type(layer).__name__})",
        f"updates its variable {name!r} from the private batch in training (it {how}): "
        "saved with the model, it is never noised (rule S2)",
        "Do not update variables from the training batch (compute such statistics on "
        "public data; GroupNormalization or LayerNormalization instead of batch statistics)",
    )


def _differentiable(tape, forward) -> bool:
    """Whether the losses can be differentiated with respect to the watched stages:
    TensorFlow's tape fails (``LookupError``) on an op without a registered gradient
    anywhere upstream of the loss (e.g. ``RandomContrast``'s ``AdjustContrastv2``). The
    gradients of the first row set's loss sum are kept for :func:`_check_jacobian`."""
    try:
        forward.first_gradients = _target_gradients(tape, forward, 0)
    except LookupError:
        return False
    return True


def _perturbed(value, rng):
    scale = float(np.sqrt(np.mean(np.square(value, dtype=np.float64)))) if value.size else 0.0
    noise = rng.standard_normal(value.shape) * (scale if scale > 0 else 0.1)
    return (value + noise).astype(value.dtype)


@contextlib.contextmanager
def _weight_point(model, point, rng):
    """The model's float trainable variables at the weight point ``point`` (one of
    :data:`WEIGHT_POINTS`) inside the block, put back exactly afterwards."""
    variables = [v for v in model.trainable_variables if tf.as_dtype(v.dtype).is_floating]
    saved = [v.numpy() for v in variables]
    try:
        for v, value in zip(variables, saved):
            if point == "scaled":
                v.assign((value * WEIGHT_SCALE).astype(value.dtype))
            elif point == "perturbed":
                v.assign(_perturbed(value, rng))
        yield variables
    finally:
        for v, value in zip(variables, saved):
            v.assign(value)


class _Probe:
    """One run of :func:`probe` (module docstring, item 3): every scenario (a weight point
    and a draw) from its own replayed state."""

    def __init__(self, model, x_spec, y_spec, seed, clear_kernels, batch_size=None):
        self.model, self.x_spec, self.y_spec = model, x_spec, y_spec
        self.seed, self.clear_kernels = seed, clear_kernels
        batch_size = _model_batch_size(model) if batch_size is None else batch_size
        self.small, self.full, self.batch, self.large = probe_sizes(batch_size)
        self.passes = 0
        # Whether rows draw random numbers by their position in the batch (module
        # docstring): random ops called directly (the kernel cache is cleared for them).
        self.positional = clear_kernels
        self.first = None  # (the first scenario's taped pass, whether labels were checked)
        self.replay = self.point = self.draw = None
        self.checked_variables = 0
        self.size_passes = {}
        self.traced_skipped = None

    def where(self, rows) -> str:
        return f" (probe batch of {rows} rows, {self.draw} inputs, {self.point} weights)"

    # ------------------------------------------------------------------ scenarios
    def run(self) -> ProbeResult:
        ran, skipped, generators = [], [], 0
        for index, (point, draw) in enumerate(SCENARIOS):
            name = f"{point}/{draw}"
            rng = np.random.default_rng([self.seed, index])
            try:
                generators = self.scenario(point, draw, rng, first=index == 0)
            except tf.errors.OpError as error:
                if index == 0:
                    raise
                # A draw or a weight point a legitimate model cannot run (an assertion on
                # the inputs' range, a kernel refusing a value): nothing to compare there.
                first_line = (str(error).strip().splitlines() or [""])[0]
                skipped.append(f"{name}: {type(error).__name__}: {first_line}"[:200])
                logger.info("batch-independence probe: scenario %s skipped: %s", name, error)
                continue
            ran.append(name)
        forward, labels = self.first
        if self.traced_skipped:
            skipped.append(self.traced_skipped)
        return ProbeResult(
            stages=len(forward.watched),
            labels=labels,
            random_generators=generators,
            variables=self.checked_variables,
            sizes=(self.small, self.full, self.batch, self.large),
            scenarios=tuple(ran),
            skipped=tuple(skipped),
            passes=self.passes,
        )

    def scenario(self, point, draw, rng, first) -> int:
        """The checks at one weight point and one draw (the large batch at the model's own
        weights only); returns the number of random generators replayed. If a pass
        assigns a trainable variable, the scenario runs again with the trainable
        variables put back before every pass and compared like the others."""
        self.point, self.draw = point, draw
        with _weight_point(self.model, point, rng) as trainable:
            at_point = [v.numpy() for v in trainable]
            state = rng.bit_generator.state
            try:
                return self._scenario(rng, first, trainable, at_point, track_trainable=False)
            except _TrainableAssigned:
                for v, value in zip(trainable, at_point):
                    v.assign(value)
                rng.bit_generator.state = state  # the same draws
                return self._scenario(rng, first, trainable, at_point, track_trainable=True)

    def _scenario(self, rng, first, trainable, at_point, track_trainable) -> int:
        def assigned():
            return not track_trainable and any(
                _rows_moved(v.numpy(), value) for v, value in zip(trainable, at_point)
            )

        try:
            generators = self._checks(rng, first, track_trainable)
        except (_NotReplayed, ValueError):
            if assigned():  # a pass moved a weight: passes differ for that reason first
                raise _TrainableAssigned() from None
            raise
        if assigned():
            raise _TrainableAssigned()
        return generators

    def _checks(self, rng, first, track_trainable) -> int:
        model, full = self.model, self.full
        large = self.point == WEIGHT_POINTS[0]  # the large batch at the model's weights
        x = _probe_inputs(model, self.x_spec, self.large if large else full, rng, self.draw)
        head = list(range(full))
        with _replayed(model, self.clear_kernels, track_trainable) as replay:
            self.replay = replay
            self.checked_variables = len(model.non_trainable_variables)
            label_rows = self.large if large else full
            forward, tape, labels = self.taped_pass(_take(x, head), rng, label_rows)
            self.positional = self.positional or replay.random(after_pass=True)
            if first:
                # A loss added in a call is refused by name first (the model's own check);
                # the probe catches what that check cannot see (a callable reading the data).
                refuse_named = getattr(model, "refuse_data_dependent_losses", None)
                if refuse_named is not None:
                    refuse_named()
            _check_jacobian(model, forward, tape, full, self.where(full))
            _check_extra_losses(forward.extra, forward.watched, tape)
            del tape
            checked_labels = _check_labels(
                model,
                forward.labels,
                forward.y_pred,
                forward.loss_values(),
                full,
                self.where(full),
            )
            if first:
                self.first = (forward, checked_labels)
                # Randomness it cannot replay shows at once, or not at all.
                self.check_replayed(_take(x, head), forward)
            if self.positional:
                self.check_replaced(_take(x, head), forward, rng)
            if first:
                self.check_removed(x, labels, forward)
            elif not self.positional:
                self.check_removed_sets(x, labels, forward)
            if large:
                self.check_prefix(x, labels, forward)
                self.check_large(x, labels, forward, first=first)
            if first:
                self.check_traced(x, labels)
                self.size_passes = {}  # the large passes released before the next scenario
            return len(replay.keras) + len(replay.tensorflow)

    # --------------------------------------------------------------------- passes
    def taped_pass(self, x, rng, label_rows):
        """The scenario's first pass, on the ``full`` rows, on a persistent tape:
        ``(forward, tape, labels)`` (labels drawn for ``label_rows`` rows, the first
        ``full`` used here). If a layer runs an op without a gradient (it trains nothing
        upstream of it), the pass is run again with the stages before the next layer out
        of the tape (``cut``): the Jacobian checks the stages after it; the other passes
        still compare every stage."""
        model, rows = self.model, self.full
        labels = None
        sets = _jacobian_sets(rows, rng)
        layers = len(model.layers_forward_order())
        for cut in range(-1, layers):
            self.replay.reset()
            self.passes += 1
            with tf.GradientTape(persistent=True) as tape:
                forward = _Forward(model, x, tape, cut)
                if labels is None:
                    labels = _probe_labels(self.y_spec, forward.y_pred, label_rows, rng)
                forward.labels = _take(labels, list(range(rows)))
                forward.losses = model.per_example_losses(forward.labels, forward.y_pred)
                check_per_example_values(forward.losses, forward.y_pred, model.loss)
                losses = tf.convert_to_tensor(forward.losses)
                forward.targets = [
                    tf.reduce_sum(
                        tf.gather(losses, np.flatnonzero(inside))
                        * tf.constant(weights[inside], losses.dtype)
                    )
                    for inside, weights in sets
                ]
                forward.extra = _extra_loss_total(model)  # on the tape: its dependence on x
            if cut == layers - 1 or _differentiable(tape, forward):
                break
        forward.sets = sets
        forward.variables = self.replay.variable_values()
        return forward, tape, labels

    def run_pass(self, x, labels, against=None) -> _Forward:
        """A pass (no tape) from the replayed state: outputs (or, with ``against``, their
        comparisons: :class:`_Forward`), losses, variables after."""
        self.replay.reset()
        self.passes += 1
        forward = _Forward(self.model, x, against=against)
        forward.labels = labels
        forward.losses = self.model.per_example_losses(labels, forward.y_pred)
        forward.variables = self.replay.variable_values()
        return forward

    def rows_pass(self, x, labels, rows, against=None) -> _Forward:
        return self.run_pass(_take(x, rows), _take(labels, rows), against)

    # ---------------------------------------------------------------- comparisons
    def difference(self, first, rows, other, other_rows=slice(None)):
        """The first top-level stage whose outputs differ between two passes (rows
        ``rows`` of ``first`` against rows ``other_rows`` of ``other``), ``"loss"`` if only
        the losses differ, or ``None``. ``other`` may have been compared with ``first`` as
        it ran (:class:`_Forward`, ``against``): its verdicts are read, stage by stage in
        the same order (a stage it did not reach counts as moved)."""
        streamed = None
        if getattr(first, "against", None) is not None:
            streamed, expected = first, (other, other_rows, rows, True)
        elif getattr(other, "against", None) is not None:
            streamed, expected = other, (first, rows, other_rows, False)
        if streamed is not None and (
            streamed.against[0] is not expected[0] or streamed.against[1:] != expected[1:]
        ):
            raise AssertionError("A streamed probe pass is compared with another pass.")
        reference = other if streamed is first else first
        for stage in sorted(k for k in reference.stages if k >= 0):
            if streamed is not None:
                if streamed.compared.get(stage, True):
                    return stage
                continue
            mine, theirs = first.arrays(stage), other.arrays(stage)
            if len(mine) != len(theirs):
                return stage
            if any(_rows_moved(a[rows], b[other_rows]) for a, b in zip(mine, theirs)):
                return stage
        if _rows_moved(first.loss_values()[rows], other.loss_values()[other_rows]):
            return "loss"
        return None

    def refuse_changes(self, first, rows, other, how, variables_how, other_rows=slice(None)):
        """Refuse if rows ``rows`` of ``first`` differ from rows ``other_rows`` of
        ``other`` (``how("outputs")`` or ``how("losses")`` says how), or if a variable
        (random generators' states aside) differs after the two passes."""
        model = self.model
        moved = self.difference(first, rows, other, other_rows)
        if moved == "loss":
            _refuse(_describe_stage(model, len(model.layers_forward_order()) - 1), how("losses"))
        if moved is not None:
            _refuse(_describe_stage(model, moved - 1), how("outputs"))
        skip = self.replay.generator_states
        variables = _moved_variables(self.replay, first.variables, other.variables, skip)
        _refuse_data_variables(model, variables, variables_how)

    def check_replayed(self, x, first) -> None:
        """A second pass on the same batch from the same state must reproduce the first
        (outputs, losses, variables); else some randomness escapes :class:`_Replay` and the
        comparisons that follow would mean nothing: :class:`_NotReplayed`, naming where it
        enters."""
        model = self.model
        again = self.run_pass(x, first.labels)
        where = self.difference(first, slice(None), again)
        moved = _moved_variables(self.replay, first.variables, again.variables)
        if where == "loss":
            subject = f"the loss {_loss_name(model.loss)!r}"
        elif where is not None:
            subject = _describe_stage(model, where - 1)
        elif moved:
            path, layer, name = _describe_variable(model, moved[0])
            subject = f"layer {path!r} ({type(layer).__name__}, variable {name!r})"
        else:
            return
        raise _NotReplayed(
            _probe_error(
                subject,
                "draws randomness the probe cannot replay (two training passes on the same "
                "batch from the same random state differ), so it cannot check that the "
                "examples of a batch do not interact (rule S2)",
                "Draw random numbers with tf.random ops or the layer's Keras RandomGenerator",
            )
        )

    def check_replaced(self, x, first, rng) -> None:
        """Each row set of :func:`row_sets` redrawn (from the same draw; same labels, same
        random state): the other rows' outputs and losses must not move, nor any variable
        (a statistic of the batch kept by a layer). Every pair of rows is so tested,
        whatever the positions random layers index their numbers by."""
        tokens = _token_range(self.model, wide=self.draw == "large")
        where = self.where(self.full)

        def how(what):
            return f"a row's {_ONE[what]} changes when other rows' inputs change{where}"

        for inside in row_sets(self.full):
            other = self.run_pass(_redrawn(x, rng, tokens, self.draw, inside), first.labels)
            outside = np.flatnonzero(~inside)
            self.refuse_changes(
                first,
                outside,
                other,
                how,
                f"changes when other rows' inputs change{where}",
                other_rows=outside,
            )

    def check_prefix(self, x, labels, full) -> None:
        """The first :data:`PROBE_ROWS` rows alone: their outputs and losses, and the
        variables, must be those of the full batch (what depends on the number of rows)."""
        fewer = self.rows_pass(x, labels, list(range(self.small)))
        where = self.where(self.full)
        self.refuse_changes(
            full,
            slice(0, self.small),
            fewer,
            lambda what: (
                f"the first rows' {what} change when other rows join the batch ({self.small} "
                f"rows, then {self.full}){where}"
            ),
            f"changes with the number of rows in the batch{where}",
        )

    def check_removed_sets(self, x, labels, full) -> None:
        """Each row set of :func:`row_sets` removed from the full batch: the other rows'
        outputs and losses, and the variables, must be as in the full batch. Every pair of
        rows is so tested (``2 ceil(log2 n)`` passes); the number of rows changes too."""
        where = self.where(self.full)

        def how(what):
            return f"the other rows' {what} change when rows are removed from the batch{where}"

        for inside in row_sets(self.full):
            kept = list(np.flatnonzero(~inside))
            fewer = self.rows_pass(x, labels, kept)
            self.refuse_changes(
                full, kept, fewer, how, f"changes when rows are removed from the batch{where}"
            )

    def check_removed(self, x, labels, full) -> None:
        """The remove-one relation itself, in the first scenario: every row of the full
        batch removed in turn, every other row's outputs and loss, and every variable
        (random generators' states aside), compared with the full batch. A deterministic
        output that depends on a row's position in the batch depends on the rows before
        it: refused. When the model draws random numbers, rows must keep their positions
        (random ops index their streams by element; a row's random numbers are
        independent of the data, whatever its position): the last row is removed as it
        is, and the first with the batch rotated so that it is last; the other pairs of
        rows are compared by :meth:`check_replaced`."""
        rows = self.full
        where = self.where(rows)

        def how(what):
            return f"the other rows' {what} change when one row is removed from the batch{where}"

        how_variables = f"changes when one row is removed from the batch{where}"
        if self.positional:
            order = [*range(1, rows), 0]  # row 0 last
            whole = self.rows_pass(x, labels, order)
            for first, kept in ((full, list(range(rows - 1))), (whole, order[:-1])):
                fewer = self.rows_pass(x, labels, kept)
                self.refuse_changes(first, slice(0, rows - 1), fewer, how, how_variables)
            return
        for j in range(rows):
            kept = [i for i in range(rows) if i != j]
            fewer = self.rows_pass(x, labels, kept)
            self.refuse_changes(full, kept, fewer, how, how_variables)

    def check_traced(self, x, labels) -> None:
        """Training steps usually run traced (in a ``tf.function``), the probe's passes
        eagerly: the full and the model-size batches run once more traced must give the
        same outputs, losses and variables, else what the probe checked is not what
        trains (a layer gated on ``tf.executing_eagerly()``). One trace, for any number of
        rows. Skipped for models that draw random numbers (traced random ops need not
        draw the eager ones) and, logged in ``skipped``, for a model the probe cannot
        trace so (a layer needing a static number of rows)."""
        if self.positional:
            return
        sizes = sorted({self.full, self.batch})
        results, failure = None, None
        # Without autograph first (a tenth of the time to trace); with it if the code
        # needs it (Python control flow on tensors), as training steps trace.
        for autograph in (False, True):
            try:
                results = self.traced_passes(x, labels, sizes, autograph)
                break
            except (TypeError, ValueError, NotImplementedError, tf.errors.OpError) as error:
                failure = error
        if results is None:
            first_line = (str(failure).strip().splitlines() or [""])[0]
            self.traced_skipped = f"traced: {type(failure).__name__}: {first_line}"[:200]
            logger.info("batch-independence probe: traced passes skipped: %s", failure)
            return
        model = self.model
        for rows in sizes:
            eager, traced_pass = self.size_passes[rows], results[rows]
            moved = self.difference(eager, slice(None), traced_pass)
            if moved == "loss":
                subject = _describe_stage(model, len(model.layers_forward_order()) - 1)
            elif moved is not None:
                subject = _describe_stage(model, moved - 1)
            else:
                variables = _moved_variables(self.replay, eager.variables, traced_pass.variables)
                if not variables:
                    continue
                path, layer, name = _describe_variable(model, variables[0])
                subject = f"layer {path!r} ({type(layer).__name__}, variable {name!r})"
            raise _probe_error(
                subject,
                "computes other values in a traced training pass (a tf.function, as "
                "training steps run) than in an eager one, where the probe checks that the "
                f"examples of a batch do not interact{self.where(rows)} (rule S2)",
                "Make its training call compute the same traced and eager",
            )

    def traced_passes(self, x, labels, sizes, autograph) -> dict:
        """``{rows: _Outputs}``: the first ``rows`` rows run by one traced function."""
        traced = _traced_forward(self.model, _take(x, [0]), _take(labels, [0]), autograph)
        results = {}
        for rows in sizes:
            kept = list(range(rows))
            self.replay.reset()
            self.passes += 1
            arguments = [_take(x, kept)] + ([] if labels is None else [_take(labels, kept)])
            stages, losses = traced(*arguments)
            results[rows] = _Outputs(stages, losses, self.replay.variable_values())
        return results

    def check_large(self, x, labels, full, first=False) -> None:
        """The batches of the model's size (``batch``; first scenario) and larger
        (``large``), no gradient: their first rows, and the variables after them, must be
        as in the next smaller batch (``full``, ``batch``). A coupling switched on from
        some number of rows below ``large`` changes the first rows' outputs across two of
        these sizes; one on at every size is found in the full batch. In the first
        scenario, the model-size batch minus its last row too (the remove-one relation at
        ``b``, and the batch size of a fixed-size pipeline)."""
        smaller, before = self.full, full
        # Kept for the traced passes (first scenario): the full and the model-size ones;
        # no other large pass outlives its comparisons (issue 39: the probe's memory).
        self.size_passes = {self.full: full} if first else {}
        sizes = {self.batch, self.large} if first else {self.large}
        remove_last = first
        for rows in sorted(sizes - {self.full}):
            where = self.where(rows)
            # The model-size batch of the first scenario is compared again below (kept);
            # any other is compared with the next smaller batch as it runs (streamed).
            kept = first and rows == self.batch
            against = None if kept else (before, slice(None), slice(0, smaller), True)
            everything = self.rows_pass(x, labels, list(range(rows)), against)
            if kept:
                self.size_passes[rows] = everything
            self.refuse_changes(
                everything,
                slice(0, smaller),
                before,
                lambda what, rows=rows, smaller=smaller, where=where: (
                    f"the first rows' {what} "
                    f"change when other rows join the batch ({smaller} rows, then {rows}){where}"
                ),
                f"changes with the number of rows in the batch{where}",
            )
            if remove_last and rows == self.batch:
                fewer = self.rows_pass(
                    x,
                    labels,
                    list(range(rows - 1)),
                    against=(everything, slice(0, rows - 1), slice(None), False),
                )
                self.refuse_changes(
                    everything,
                    slice(0, rows - 1),
                    fewer,
                    lambda what, where=where: (
                        f"the other rows' {what} change when one row "
                        f"is removed from the batch{where}"
                    ),
                    f"changes when one row is removed from the batch{where}",
                )
                del fewer
            smaller, before = rows, everything
            del everything


class _Outputs:
    """What a traced pass returns, shaped as a :class:`_Forward` for the comparisons."""

    def __init__(self, stages, losses, variables):
        # numpy views of the tensors' buffers (no copy): what the comparisons read.
        self.stages = {k: [np.asarray(t) for t in ts] for k, ts in enumerate(stages)}
        self.losses, self.variables = losses.numpy(), variables

    def arrays(self, stage) -> list:
        return self.stages[stage]

    def loss_values(self) -> np.ndarray:
        return self.losses


def _traced_forward(model, x, labels, autograph):
    """``tf.function`` of one training pass returning every top-level stage's float
    outputs and the per-row losses, traced once for any number of rows."""

    def unknown_rows(t):
        return tf.TensorSpec([None, *t.shape[1:]], t.dtype)

    def run(x, labels=None):
        stages = []

        def observe(index, h):
            stages.append(_float_tensors(h))
            return h

        y_pred = model.forward(x, training=True, observe=observe)
        return stages, model.per_example_losses(labels, y_pred)

    signature = [tf.nest.map_structure(unknown_rows, x)]
    if labels is not None:
        signature.append(tf.nest.map_structure(unknown_rows, labels))
    return tf.function(run, input_signature=signature, autograph=autograph)


def probe(model, x_spec, y_spec, seed=PROBE_SEED, batch_size=None) -> ProbeResult:
    """Check numerically that each row's training loss depends on its own input and label
    only (module docstring, item 3); raise ``ValueError`` naming what couples.

    ``model``: a :class:`lipdp.core.private_model.PrivateModel` (its ``forward`` loop and
    ``per_example_losses``); ``x_spec``, ``y_spec``: the ``tf.TensorSpec`` (or nests)
    of a training batch; ``batch_size``: the model's ``b`` if not its metadata's
    (:func:`probe_sizes`). Eager. The model's variables, the global seed, the op-seed
    sequence and every random generator are left as they were (:class:`_Replay`,
    :func:`_weight_point`). Run first with TensorFlow's kernel cache kept, then, if two
    passes from the same state differ (stateful random kernels: ``tf.random`` ops called
    by a layer), once more clearing it before every pass.
    """
    try:
        return _Probe(model, x_spec, y_spec, seed, False, batch_size).run()
    except _NotReplayed:
        pass
    try:
        return _Probe(model, x_spec, y_spec, seed, True, batch_size).run()
    except _NotReplayed as error:
        raise error.refusal from None


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
        with _eager_with_gradients():
            result = probe(model, x_spec, y_spec)
        logger.debug("batch-independence probe passed: %s", result)
        done.add(key)

    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        context.merge_call(run)
    else:
        run()


__all__ = [
    "COUPLES_EXAMPLES",
    "DRAWS",
    "LARGE_MAGNITUDES",
    "MAX_PROBE_ROWS",
    "MIN_GROUP_VALUES",
    "PIXEL_ZEROS",
    "PROBE_ROWS",
    "PROBE_SEED",
    "PROBE_TOLERANCE",
    "REMOVE_EACH_ROWS",
    "WEIGHT_POINTS",
    "WEIGHT_SCALE",
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
    "probe_sizes",
    "probe_when_traced",
    "random_sources",
    "refuse_coupling_layers",
    "runs_in_inference_mode",
    "spec_key",
]
