r"""The privacy ledger: what a model has released, saved with its weights (rule S10).

A model's ``epsilon`` is the composition of the mechanisms that were actually run on its
training data -- not of the mechanisms its *current* configuration would run. Freezing
layers (fewer per-layer Gaussians), another noise multiplier, another batch size or
sampling rate, a reload: any of these changes the mechanism of the *next* steps, never
the price of the past ones.

**What is recorded.** One row per distinct mechanism, in order of first use, with the
number of times it ran:

* noisy gradient steps: a Poisson-subsampled Gaussian of multiplier ``sigma_eff`` (the
  effective multiplier of the step's Gaussians, :func:`~lipdp.accounting.mechanisms.
  effective_noise_multiplier`; 0 for a non-private step, whose ``epsilon`` is infinite)
  and rate ``q = b / N``, with ``b``, ``N``, the sampling scheme and the number of
  Gaussians for the report;
* dynamic-clipping releases (:mod:`lipdp.clipless.dynamic`): a Laplace mechanism of cost
  ``epsilon``, or a subsampled Gaussian count.

A training step records the mechanism it was *traced with* -- the noise multipliers and
the sampling rate baked into its graph -- in the graph itself, next to the step counter:
what is recorded is what ran, whatever path called the step (``fit``,
``train_on_batch``, a custom loop). Composition is commutative (Rényi DP curves add;
privacy loss distributions convolve), so a mechanism that runs again after a change
adds to its own row: the rows are the segments of the history up to their order, which
no accountant needs.

**Where it lives.** Two model variables (a ``float64`` table and an ``int64`` count per
row), saved and restored with the weights in every format that carries the step count:
``.keras`` files, ``save_weights`` checkpoints, ``BackupAndRestore``. Its state is the
lineage of the weights it is saved with: ``model.set_weights(other.get_weights())`` or
``load_weights`` copy the other model's ledger with its weights.

**Lineage: the ledger follows the weights** (rule S10). A private model tags every layer
holding weights with its ledger when it is built (:func:`tag_layers`; a model loaded from
a file: the ledger loaded with its weights) and when it trains. A model built later from
tagged layers starts from their ledger (:func:`inherited_ledger`: shared with one source,
the composition of several). Weights copied layer by layer as numpy arrays carry no tag;
in the same process they are recognised by their values (:func:`copied_ledgers`) and the
new model's ledger is made to hold at least the source's releases.

**Capacity.** ``CAPACITY`` rows; the last three are overflow rows, one per kind. A new
mechanism when the regular rows are full is merged into its kind's overflow row as a
mechanism that dominates both (smallest noise multiplier, largest sampling rate,
largest Laplace ``epsilon``): the privacy loss of a subsampled Gaussian grows as
``sigma`` falls and as ``q`` rises, so the merged row over-states, never under-states,
what ran.

**Adaptive choices.** When a later mechanism is chosen after looking at earlier outputs
(a user freezes layers or lowers the noise after evaluating the model), composing the
mechanisms that ran is the standard accounting (Opacus and TensorFlow Privacy do the
same). Strictly, such fully adaptive composition is covered by Rényi filters (Feldman &
Zrnic, NeurIPS 2021) when the budget is fixed in advance (``DP_Accountant(
epsilon_budget=...)``); without one, the reading is that of a privacy odometer, which
costs slightly more in theory (Whitehouse et al., 2023).
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lipdp.accounting.mechanisms import Laplace, SubsampledGaussian, dynamic_clipping_label
from lipdp.accounting.plan import GRADIENT_STEPS as STEPS_LABEL
from lipdp.accounting.tuning_cost import RandomSearch
from lipdp.foundation.layer_walk import nested_layers
from lipdp.foundation.variables import state_variable, variable_key

if TYPE_CHECKING:  # annotations only: TensorFlow is imported on use
    import tensorflow as tf

logger = logging.getLogger(__name__)

#: Rows of the ledger (the last ``len(KINDS)`` are overflow rows).
CAPACITY = 64

#: Columns of a row (``REPRODUCIBLE``: the step's noise came from a seeded generator).
KIND, SCALE, RATE, BATCH, SAMPLES, POISSON, GAUSSIANS, MERGED, REPRODUCIBLE = range(9)
WIDTH = 9

#: Kinds of row (column ``KIND``; 0 is an empty row). ``SEARCH`` rows are not releases:
#: they record that steps ran under a declared hyper-parameter search (``SCALE``: its
#: mean number of runs, ``RATE``: its shape), whose cost every later epsilon includes.
GRADIENT_STEPS, GAUSSIAN_RELEASE, LAPLACE_RELEASE, SEARCH = 1, 2, 3, 4
KINDS = (GRADIENT_STEPS, GAUSSIAN_RELEASE, LAPLACE_RELEASE, SEARCH)

#: The labels of the privacy plan's releases (lipdp.accounting.plan and lipdp.clipless.dynamic).
LABELS = {
    GRADIENT_STEPS: STEPS_LABEL,
    GAUSSIAN_RELEASE: dynamic_clipping_label("quantiles"),
    LAPLACE_RELEASE: dynamic_clipping_label("laplace"),
    SEARCH: "declared hyper-parameter search",
}


@dataclass(frozen=True)
class LedgerEntry:
    """One row: ``count`` runs of one mechanism.

    Attributes:
        label: what was released (a label of :data:`LABELS`).
        mechanism: :class:`SubsampledGaussian` or :class:`Laplace`; ``None`` for
            non-private steps (no noise: infinite ``epsilon``).
        count: how many times it ran.
        batch_size: ``b`` of the steps (0 for other releases).
        nb_samples: ``N`` of the steps (0 for other releases).
        sampling: ``"poisson"`` or ``"shuffle"`` (``""`` for other releases).
        gaussians: Gaussian mechanisms in one step (per-layer noise: one per variable).
        merged: an overflow row, dominating several mechanisms (module docstring).
        reproducible: the noise came from a seeded generator
            (:func:`lipdp.core.noise.use_reproducible_noise`): anyone with the seed can
            regenerate it.
        search: the :class:`~lipdp.accounting.tuning_cost.RandomSearch` of a search row.
    """

    label: str
    mechanism: SubsampledGaussian | Laplace | None
    count: int
    batch_size: int = 0
    nb_samples: int = 0
    sampling: str = ""
    gaussians: int = 1
    merged: bool = False
    reproducible: bool = False
    search: RandomSearch | None = None

    def describe(self) -> str:
        if self.search is not None:
            return f"{self.count} steps under a declared {self.search.describe()}"
        what = "no noise (non-private)" if self.mechanism is None else self.mechanism.describe()
        text = f"{self.count} x {self.label}: {what}"
        if self.reproducible:
            text += ", REPRODUCIBLE noise (seeded)"
        if self.label == LABELS[GRADIENT_STEPS]:
            text += f"; b = {self.batch_size}, N = {self.nb_samples}, {self.sampling} batches"
            if self.gaussians > 1:
                text += f", {self.gaussians} Gaussians per step"
        if self.merged:
            text += " (several mechanisms merged into one that dominates them)"
        return text


def step_row(
    noise_multiplier, batch_size, nb_samples, poisson, gaussians, reproducible=False
) -> np.ndarray:
    """The row of one noisy gradient step (``noise_multiplier = 0``: non-private)."""
    row = np.zeros(WIDTH)
    row[[KIND, SCALE, RATE]] = GRADIENT_STEPS, noise_multiplier, batch_size / nb_samples
    row[[BATCH, SAMPLES, POISSON, GAUSSIANS]] = batch_size, nb_samples, poisson, gaussians
    row[REPRODUCIBLE] = reproducible
    return row


def search_row(search: RandomSearch) -> np.ndarray:
    """The row recording one step run under a declared hyper-parameter search."""
    row = np.zeros(WIDTH)
    row[[KIND, SCALE, RATE]] = SEARCH, search.mean, search.shape
    return row


def release_row(mechanism) -> np.ndarray:
    """The row of one dynamic-clipping release (a :class:`Laplace` or a
    :class:`SubsampledGaussian` mechanism)."""
    row = np.zeros(WIDTH)
    if isinstance(mechanism, Laplace):
        row[[KIND, SCALE]] = LAPLACE_RELEASE, mechanism.epsilon
    else:
        row[[KIND, SCALE, RATE]] = (
            GAUSSIAN_RELEASE,
            mechanism.noise_multiplier,
            mechanism.sampling_rate,
        )
    row[GAUSSIANS] = 1
    return row


def minimum_columns(kind) -> tuple[int, ...]:
    """The columns an overflow row of ``kind`` merges by their minimum (every other column
    by its maximum, ``KIND`` kept, ``MERGED`` set to 1): the row then dominates every
    mechanism merged into it. A Gaussian's ``sigma`` (``SCALE`` of steps and Gaussian
    releases) costs more as it falls, as ``N`` does (``SAMPLES``) and shuffled batches do
    (``POISSON`` 0); a larger rate, batch, number of Gaussians, Laplace ``epsilon``, search
    mean or shape costs more, and one reproducible step makes the row reproducible. The one
    statement of the merge, used by :func:`_dominating` (TensorFlow),
    :func:`_dominating_numpy` and :mod:`lipdp.core.jax.ledger` (JAX)."""
    smaller_is_worse = kind in (GRADIENT_STEPS, GAUSSIAN_RELEASE)
    return (SCALE, SAMPLES, POISSON) if smaller_is_worse else (SAMPLES, POISSON)


def _dominating(old, new, kind):
    """A row that dominates ``old`` (an overflow row, maybe empty) and ``new``."""
    import tensorflow as tf

    low, high = tf.minimum(old, new), tf.maximum(old, new)
    by_minimum = np.zeros(WIDTH, bool)
    by_minimum[list(minimum_columns(kind))] = True
    merged = tf.where(tf.constant(by_minimum), low, high)
    is_kind, is_merged = np.arange(WIDTH) == KIND, np.arange(WIDTH) == MERGED
    merged = tf.where(tf.constant(is_kind), new, merged)
    merged = tf.where(tf.constant(is_merged), tf.ones_like(new), merged)
    return tf.where(tf.equal(old[KIND], 0.0), new, merged)


def placement(table, row) -> tuple[int, np.ndarray]:
    """``(index, written)``: the row of ``table`` (a ``(CAPACITY, WIDTH)`` float64 array)
    that :meth:`PrivacyLedger.record` adds a run of the mechanism ``row`` to, and what it
    writes there -- ``row`` itself in its own row or the first empty regular row, else,
    the regular rows being full, a row that dominates ``row`` and the overflow row of its
    kind. The rule of ``record`` in numpy: the reference that ``record`` (TensorFlow) and
    the JAX step's in-graph placement (:func:`lipdp.core.jax.ledger.recorded`) are
    tested against, on random, full and overflowing tables."""
    table, row = np.asarray(table, np.float64), np.asarray(row, np.float64)
    kind = int(row[KIND])
    regular = table[: CAPACITY - len(KINDS)]
    same = np.flatnonzero(np.all(regular == row[None], axis=1))
    if same.size:
        return int(same[0]), row
    empty = np.flatnonzero(regular[:, KIND] == 0.0)
    if empty.size:
        return int(empty[0]), row
    overflow = CAPACITY - len(KINDS) + KINDS.index(kind)
    return overflow, _dominating_numpy(table[overflow], row, kind)


def _dominating_numpy(old, new, kind) -> np.ndarray:
    """:func:`_dominating` in numpy."""
    if old[KIND] == 0.0:
        return new
    merged = np.maximum(old, new)
    columns = list(minimum_columns(kind))
    merged[columns] = np.minimum(old, new)[columns]
    merged[KIND] = new[KIND]
    merged[MERGED] = 1.0
    return merged


class PrivacyLedger:
    """A view of a model's ledger variables (module docstring)."""

    def __init__(self, table: tf.Variable, counts: tf.Variable):
        self.table = table
        self.counts = counts

    @property
    def storage(self):
        """The variable holding the table: what identifies a ledger (two views of the same
        variables are the same ledger; a backend that stores the table in another form
        names its variable here)."""
        return self.table

    @staticmethod
    def create_variables(name="privacy_ledger"):
        """The two variables of an empty ledger (create them as model attributes, so that
        they are saved with the weights)."""
        table = state_variable(np.zeros([CAPACITY, WIDTH]), "float64", f"{name}_table")
        counts = state_variable(np.zeros([CAPACITY], np.int64), "int64", f"{name}_counts")
        return table, counts

    # ------------------------------------------------------------------ recording
    def record(self, row, count=1):
        """Add ``count`` runs of the mechanism ``row`` (:func:`step_row`,
        :func:`release_row`): to its own row if it has one, else to the first empty
        regular row, else merged into its kind's overflow row. Graph-safe (the training
        step calls it once per step) and eager (the dynamic-clipping callbacks).
        :func:`placement` is the same rule on numpy arrays."""
        import tensorflow as tf

        row = np.asarray(row, np.float64)
        kind = int(row[KIND])
        overflow = CAPACITY - len(KINDS) + KINDS.index(kind)
        new = tf.constant(row)
        table = tf.convert_to_tensor(self.table)
        regular = table[: CAPACITY - len(KINDS)]
        same = tf.reduce_all(tf.equal(regular, new[None]), axis=1)
        empty = tf.equal(regular[:, KIND], 0.0)
        # The first row holding this mechanism, else the first empty row.
        score = 2 * tf.cast(same, tf.int32) + tf.cast(empty, tf.int32)
        best = tf.argmax(score, output_type=tf.int32)
        found = score[best] > 0
        target = tf.where(found, best, overflow)
        written = tf.where(found, new, _dominating(table[overflow], new, kind))
        # Whole-variable assignments (mirrored variables under tf.distribute support
        # them in cross-replica context, where the step count is updated too).
        at_target = tf.one_hot(target, CAPACITY, on_value=True, off_value=False)
        self.table.assign(tf.where(at_target[:, None], written[None], table))
        return self.counts.assign_add(tf.cast(at_target, tf.int64) * count)

    # -------------------------------------------------------------------- reading
    def entries(self) -> list[LedgerEntry]:
        """The rows that ran at least once, in order of first use (overflow rows last)."""
        table, counts = self.table.numpy(), self.counts.numpy()
        return [_entry(row, int(c)) for row, c in zip(table, counts) if c > 0]

    def releases(self) -> list[LedgerEntry]:
        """The entries that are releases (every row but the search rows)."""
        return [entry for entry in self.entries() if entry.search is None]

    def terms(self) -> tuple:
        """``((mechanism, count), ...)`` for the accountants; ``None`` mechanisms (no
        noise) are kept, the plan turns them into an infinite epsilon."""
        merged = {}
        for entry in self.releases():
            merged[entry.mechanism] = merged.get(entry.mechanism, 0) + entry.count
        return tuple(merged.items())

    def counts_by_label(self) -> dict:
        """``{label: total runs}`` of the releases (e.g. the gradient steps recorded)."""
        totals = {}
        for entry in self.releases():
            totals[entry.label] = totals.get(entry.label, 0) + entry.count
        return totals

    def searches(self) -> tuple:
        """The hyper-parameter searches some step ran under."""
        return tuple(entry.search for entry in self.entries() if entry.search is not None)

    def reproducible(self) -> bool:
        """Some step drew its noise from a seeded generator."""
        return any(entry.reproducible for entry in self.entries())

    # ------------------------------------------------------------------ lineage
    def snapshot(self) -> tuple:
        """The rows and counts now (numpy), for :meth:`keep_at_least`."""
        return self.table.numpy(), self.counts.numpy()

    def keep_at_least(self, snapshot) -> None:
        """Every row of ``snapshot`` counted at least as many times as there: after the
        variables were overwritten by older ones (weights restored to an earlier epoch,
        chosen after later epochs were released), nothing released is forgotten."""
        table, counts = self.table.numpy(), self.counts.numpy()
        for row, count in zip(*snapshot):
            if count == 0:
                continue
            same = np.all(table == row, axis=1)
            now = int(counts[same].sum()) if same.any() else 0
            if count > now:
                self.record(row, int(count - now))
                table, counts = self.table.numpy(), self.counts.numpy()

    def add(self, other: PrivacyLedger) -> None:
        """Record every run ``other`` holds (the composition of both ledgers' releases)."""
        for row, count in zip(*other.snapshot()):
            if count > 0:
                self.record(row, int(count))

    def describe(self) -> list[str]:
        return [entry.describe() for entry in self.entries()]


def _entry(row, count) -> LedgerEntry:
    kind = int(row[KIND])
    if kind == SEARCH:
        search = RandomSearch(float(row[SCALE]), float(row[RATE]))
        return LedgerEntry(LABELS[kind], None, count, search=search, merged=bool(row[MERGED]))
    if kind == LAPLACE_RELEASE:
        mechanism = Laplace(float(row[SCALE]))
    elif row[SCALE] == 0.0:
        mechanism = None  # a non-private step
    else:
        mechanism = SubsampledGaussian(float(row[SCALE]), float(row[RATE]))
    steps = kind == GRADIENT_STEPS
    return LedgerEntry(
        label=LABELS[kind],
        mechanism=mechanism,
        count=count,
        batch_size=int(row[BATCH]) if steps else 0,
        nb_samples=int(row[SAMPLES]) if steps else 0,
        sampling=("poisson" if row[POISSON] else "shuffle") if steps else "",
        gaussians=int(row[GAUSSIANS]),
        merged=bool(row[MERGED]),
        reproducible=bool(row[REPRODUCIBLE]),
    )


# ------------------------------------------------------------ layers and their ledger
#: The ledger of the private model each layer with weights belongs to, in this process
#: (rule S10: the ledger follows the weights). Set when a private model is built -- from
#: new layers, or from a file, whose weights the loaded ledger priced -- and when it
#: trains.
_TRAINED_BY = weakref.WeakKeyDictionary()
#: Per layer, the digests of the values its trainable weights held when it was first tagged
#: with a ledger that had released nothing (nor received any copied spending): values that
#: no data of this process has touched (a seeded initialisation). A layer still holding
#: them after training (learning rate 0, weights reset to their initial values) is not the
#: source of a copy: a fresh model seeded alike holds them without copying anything.
_UNTRAINED_VALUES = weakref.WeakKeyDictionary()


def tag_layers(layers, ledger: PrivacyLedger) -> None:
    """Record that the weights of ``layers`` (every layer holding weights, at any depth,
    trainable or frozen) are priced by ``ledger``: a model built from them later starts
    from its releases (:func:`inherited_ledger`)."""
    untouched = not ledger.entries()
    for _, layer in nested_layers(layers):
        if _weights(layer):
            _TRAINED_BY[layer] = ledger
            if untouched and layer not in _UNTRAINED_VALUES:
                _UNTRAINED_VALUES[layer] = {
                    _digest(np.asarray(v.numpy())) for v in _own_weights(layer, trainable=True)
                }


def ledgers_of(layers) -> dict:
    """``{path: ledger}`` of the layers of ``layers`` (at any depth) that belong to a
    private model of this process (:func:`tag_layers`)."""
    found = {}
    for path, layer in nested_layers(layers):
        ledger = _TRAINED_BY.get(layer)
        if ledger is not None:
            found[path] = ledger
    return found


def inherited_ledger(layers, new_ledger=None) -> PrivacyLedger | None:
    """The ledger a private model built from ``layers`` starts from, or ``None`` (no
    layer belongs to a private model):

    * the layers of one private model: *its* ledger, shared (both models then record
      into the same variables, so each one's epsilon holds the other's steps on the
      shared weights);
    * layers of several: a new ledger holding every row of each (the releases compose:
      ``epsilon`` of the new model is at least that of the composition of the sources'
      mechanisms -- more than needed if they trained on disjoint data, never less). The
      layers then belong to the new ledger: their former models can no longer train them
      (refused in :meth:`~lipdp.core.private_base.PrivateModelBase._check_lineage`).

    ``new_ledger()`` makes the empty ledger of that composition (the backend's variables;
    default: TensorFlow's).
    """
    distinct = {}
    for ledger in ledgers_of(layers).values():
        distinct.setdefault(id(ledger.storage), ledger)
    if len(distinct) <= 1:
        return next(iter(distinct.values()), None)
    merged = (
        new_ledger() if new_ledger is not None else PrivacyLedger(*PrivacyLedger.create_variables())
    )
    for source in distinct.values():
        merged.add(source)
    logger.info(
        "The model's layers were trained by %d private models: its ledger starts from the "
        "composition of their %d releases.",
        len(distinct),
        sum(entry.count for entry in merged.entries()),
    )
    return merged


def copied_ledgers(layers, own: PrivacyLedger | None = None) -> dict:
    """``{path: ledger}``: the layers of ``layers`` (at any depth) holding, in a variable of
    their own, exactly the values of a trainable variable of a *different* layer of this
    process that belongs to another private model whose ledger has released something --
    weights copied by hand from a private model (``layer.set_weights(private_layer.
    get_weights())``), which carry no ledger of their own. Variables whose entries are all
    equal (zero biases, unit scales) are ignored: they match without being copies. A match
    that is not a copy (equal trained values by chance: not a coincidence of random
    weights) would only over-state epsilon. Values a source layer held before its ledger
    released anything (:data:`_UNTRAINED_VALUES`) are not copies of anything private."""
    released = {}  # storage id -> whether that ledger has released something (read once)
    sources = []
    for layer, ledger in list(_TRAINED_BY.items()):
        if own is not None and ledger.storage is own.storage:
            continue
        key = id(ledger.storage)
        if key not in released:
            released[key] = bool(ledger.entries())
        if released[key]:
            sources.append((layer, ledger))
    if not sources:  # no other private model has released anything: nothing to hash
        return {}
    wanted = {}
    for path, layer in nested_layers(layers):
        for variable in _own_weights(layer):
            value = np.asarray(variable.numpy())
            if value.size > 1 and not np.all(value == value.flat[0]):
                wanted.setdefault(_digest(value), []).append((path, variable_key(variable)))
    if not wanted:
        return {}
    shapes = {shape for shape, _ in wanted}
    found = {}
    for layer, ledger in sources:
        untrained = _UNTRAINED_VALUES.get(layer, set())
        for variable in _own_weights(layer, trainable=True):
            if tuple(variable.shape) not in shapes:
                continue
            digest = _digest(np.asarray(variable.numpy()))
            if digest in untrained:
                continue
            for path, key in wanted.get(digest, ()):
                if key != variable_key(variable):
                    found.setdefault(path, ledger)
    return found


def _own_weights(layer, trainable=False) -> list:
    """The variables ``layer`` holds itself (its sublayers' apart): Keras' ``weights`` of a
    container include its sublayers'."""
    inner = {
        variable_key(v)
        for sub in layer._flatten_layers(include_self=False)  # noqa: SLF001 - Keras' walk
        for v in _weights(sub)
    }
    return [v for v in _weights(layer, trainable) if variable_key(v) not in inner]


def _weights(layer, trainable=False) -> list:
    """``layer``'s (trainable) weights; none for a Keras 2 model not built yet (whose
    ``weights`` raise)."""
    try:
        return list(layer.trainable_weights if trainable else layer.weights)
    except ValueError:
        return []


def _digest(value) -> tuple:
    """A key of an array's shape, dtype and bytes."""
    return tuple(value.shape), hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()


def is_non_private(terms) -> bool:
    """Some recorded step had no noise."""
    return any(mechanism is None and count > 0 for mechanism, count in terms)


__all__ = [
    "CAPACITY",
    "LABELS",
    "copied_ledgers",
    "LedgerEntry",
    "PrivacyLedger",
    "inherited_ledger",
    "is_non_private",
    "ledgers_of",
    "minimum_columns",
    "placement",
    "tag_layers",
    "release_row",
    "search_row",
    "step_row",
]
