r"""Private, accounted updates of the threshold of ``DP_ClipGradient(mode="dynamic")``.

A :class:`~lipdp.clipless.layers.DP_ClipGradient` layer clips, in the backward pass, the cotangent
of every example (the gradient of that example's loss w.r.t. the layer output) to the
norm ``C = layer.clip_value``. A good ``C`` depends on the data: choosing it from the
private training set is a data-dependent choice, so (rule S6) it goes through a DP
mechanism whose cost the accountant composes with the training steps. This module
provides two Keras callbacks that do so every ``patience`` epochs:

* :class:`LaplaceAdaptiveLossGradientClipping` -- pure ``epsilon``-DP Laplace
  mechanism on the whole training set (a private quantile from a noisy histogram, or
  a private clipped mean), ``C`` set from the released value;
* :class:`AdaptiveQuantileClipping` -- the geometric update of Andrew et al. (2021),
  *Differentially Private Learning with Adaptive Clipping*, with a Gaussian mechanism
  on a Poisson subsample.

Notation
--------
For one example ``x`` and one dynamic clip layer, ``n(x)`` is the Euclidean norm of the
cotangent at the layer *before* its clipping, i.e. of the gradient of ``x``'s own loss
w.r.t. the layer output (clip layers further down the network do clip it, as in
training). ``U`` is the public upper bound on ``n(x)``: the cotangent bound at the
layer's output in the model's bound pass (:mod:`lipdp.clipless.bounds`, from ``model.loss.get_L()``
through the layers after the clip layer) -- ``U = get_L()`` for a clip layer right after
the logits. ``N`` is the public
training-set size ``model.dataset_metadata.nb_samples_train``.

Why the statistics are functions of single examples
---------------------------------------------------
The weights, the other clip values and ``U`` are outputs of earlier DP releases (or
public choices): conditioned on them, ``n(x)`` is a fixed function of ``x`` alone (rule
S2: every layer and the loss act per example), so each statistic below is a sum over the
examples of a function of one example, and the sensitivity is that of one summand.
Releases are composed adaptively by the accountant.

Neighbouring relation and the data passed to the callbacks
-----------------------------------------------------------
Add/remove one example. The derivations assume that one pass over ``ds_train`` yields
every example of the private training set exactly once (order and batching are
irrelevant; a partial last batch is fine and expected). A dataset batched with
``drop_remainder=True`` breaks this: if ``N`` is a multiple of the batch size, removing
one example makes the last batch partial, which then drops ``b - 1`` other examples,
so one example changes up to ``b`` summands. A Poisson-sampled pipeline
(:func:`lipdp.pipeline.poisson_batches`) is not a full pass either. The callbacks refuse
a ``ds_train`` with a static batch dimension (the signature of ``drop_remainder=True``);
pass ``ds_train`` batched *without* ``drop_remainder`` (the training pipeline itself
may keep it).

Accounting: declared before training
------------------------------------
The releases are part of the model's privacy plan (rule S11): the model declares them in
``DPParameters(..., dynamic_clipping=callback)`` (or the callback's
:class:`DynamicClippingSpec`), so that ``get_eps_delta``, ``get_max_epochs``,
calibration, ``DP_Accountant`` and the report count them *before* ``fit``. A callback
refuses to run on a model that declared something else. The plan counts
(:meth:`DynamicClippingSpec.release`):

* ``"laplace"``: ``n`` Laplace mechanisms, each ``eps``-DP, with privacy loss exactly
  that of the scalar Laplace mechanism with ``scale / sensitivity = 1 / eps``; no
  subsampling;
* ``"quantiles"``: ``n`` Gaussian mechanisms on a sensitivity-1 count with noise
  multiplier ``s``, each on its own Poisson subsample of rate
  ``q = model.dataset_metadata.sampling_rate``.

``n`` counts every release: ``(epochs // patience)`` update rounds times the number of
dynamic clip layers (times ``steps_per_update`` for :class:`AdaptiveQuantileClipping`).
Rounds follow the model's epochs (counted from its optimizer steps, across ``fit``
calls), so that the releases after ``E`` epochs are exactly the plan's. The release at
the end of the last epoch is counted, as the value is published in the logs and in the
model. With several dynamic clip layers, :class:`AdaptiveQuantileClipping`
draws a fresh Poisson subsample per layer: composing ``L`` subsampled Gaussian mechanisms
assumes independent subsamples (``L`` counts on one shared subsample would be a single
subsampled Gaussian with multiplier ``s / sqrt(L)``, whose amplified RDP can exceed the
``L``-fold composition).

Caveat: the noise is drawn with numpy's floating-point samplers; like most DP libraries
this does not defend against floating-point side channels of the Laplace/Gaussian
samplers (Mironov, 2012).
"""

from __future__ import annotations

import logging
import math

import keras
import numpy as np
import tensorflow as tf

from lipdp.clipless.layers import DP_ClipGradient
from lipdp.core import distribute
from lipdp.core.callbacks import epochs_trained
from lipdp.core.ledger import release_row
from lipdp.core.parameters import DynamicClippingSpec
from lipdp.foundation import compat, validation

logger = logging.getLogger(__name__)

__all__ = [
    "LaplaceAdaptiveLossGradientClipping",
    "AdaptiveQuantileClipping",
    "CotangentNorms",
    "DynamicClippingSpec",
    "dynamic_clip_layers",
    "per_example_cotangent_norms",
    "find_dynamic_clip_layers",
    "cotangent_upper_bound",
    "laplace_clipped_mean",
    "histogram_edges",
    "histogram_counts",
    "laplace_histogram_quantile",
    "noisy_fraction",
    "geometric_update",
    "poisson_mask",
]

#: Default lower limit of any clip value set by the callbacks (absolute).
DEFAULT_MIN_CLIP_VALUE = 1e-3


# ------------------------------------------------------------------- layers and bounds
def dynamic_clip_layers(layers) -> list[tuple[int, DP_ClipGradient]]:
    """``[(position, layer)]`` of the ``DP_ClipGradient(mode="dynamic")`` layers.

    Raises ``ValueError`` if one is wrapped in a residual block (its cotangent bound is
    one entry of a pair: not supported).
    """
    found = []
    for index, layer in enumerate(layers):
        block = getattr(layer, "block", None)
        if isinstance(block, DP_ClipGradient) and block.mode == "dynamic":
            raise ValueError(
                f"DP_ClipGradient {block.name!r} is wrapped in a residual block: dynamic "
                "clipping is only supported for clip layers on the main path."
            )
        if isinstance(layer, DP_ClipGradient) and layer.mode == "dynamic":
            found.append((index, layer))
    return found


def find_dynamic_clip_layers(model) -> list[tuple[int, DP_ClipGradient]]:
    """``[(index in model.layers_forward_order(), layer)]`` of the dynamic clip layers.

    Raises ``ValueError`` if there is none, if a ``DP_ClipGradient`` has mode
    ``"fixed"`` (a callback of this module updates every clip layer, and a fixed one
    must not be changed from data), or if a dynamic one is wrapped in a residual
    block.
    """
    layers = model.layers_forward_order()
    found = dynamic_clip_layers(layers)
    for layer in layers:
        if isinstance(layer, DP_ClipGradient) and layer.mode != "dynamic":
            raise ValueError(
                f"DP_ClipGradient {layer.name!r} has mode={layer.mode!r}: the dynamic "
                "clipping callbacks update every clip layer of the model. Build it with "
                'DP_ClipGradient(clip_value, mode="dynamic") to let it be updated, or remove '
                "the callback."
            )
    if not found:
        raise ValueError(
            "The model has no DP_ClipGradient(..., mode='dynamic') layer: there is no "
            "clip value to update. Add one (typically right after the logits) or remove "
            "the dynamic clipping callback."
        )
    return found


def cotangent_upper_bound(model, index: int) -> float:
    """``U``: bound on one example's cotangent norm at the output of layer ``index``.

    Read from the model's bound pass (:mod:`lipdp.clipless.bounds`): clip layers further down
    count with their current clip value.
    """
    bound = model.bounds().output_cotangent_bounds[index]
    if isinstance(bound, (tuple, list)):
        raise ValueError(
            f"Layer {model.layers_forward_order()[index].name!r} sits inside a residual block "
            "(its cotangent bound is a pair): dynamic clipping is not supported there."
        )
    return float(np.asarray(bound))


# --------------------------------------------------------------- per-example cotangents
class CotangentNorms:
    """Per-example norms of the cotangent at the output of the given layers.

    ``CotangentNorms(model, indices)(x, y)`` returns one ``(batch,)`` tensor per index in
    ``indices`` (positions in ``model.layers_forward_order()``): for example ``i``, the
    norm of the gradient of its own loss ``model.per_example_losses(y, f(x))[i]`` w.r.t. the
    layer's output.

    Differentiating w.r.t. the *output* of a ``DP_ClipGradient`` gives its cotangent
    before its own clipping (the layer clips what it passes to its input). The
    gradient is taken of ``sum_i loss_i / s`` and multiplied by ``s``, where ``s`` is
    the model's loss normaliser (:attr:`lipdp.foundation.metadata.DatasetMetadata.loss_normalizer`,
    the number of rows when the model has no metadata), the one the clip layers receive:
    clip layers further down then clip ``g_i / s`` at ``C / s``, exactly as in training
    (differentiating the plain sum would let them clip ``g_i`` at ``C / s``). Rows are
    per-example because the loss is a sum of per-example terms and every layer acts per
    example (rule S2).

    Per backend (the tap): TensorFlow watches the outputs on a ``GradientTape`` in a
    ``tf.function``; Keras 3's JAX backend adds zero probes at the outputs and takes
    ``jax.grad`` w.r.t. them in a ``jax.jit`` function
    (:class:`lipdp.clipless.jax.dynamic.JaxCotangentNorms`, numpy arrays out). The release
    mechanisms and the clip-value updates are host code, the same on every backend.
    """

    def __init__(self, model, indices):
        self.model = model
        self.indices = [int(i) for i in indices]
        count = len(model.layers_forward_order())
        if not self.indices or any(not 0 <= i < count for i in self.indices):
            raise ValueError(f"indices must be layer positions in [0, {count}), got {indices}.")
        self._function = None

    def _norms(self, x, y):
        wanted = set(self.indices)
        outputs = {}

        with tf.GradientTape() as tape:

            def watch(index, output):
                if index in wanted:
                    tape.watch(output)
                    outputs[index] = output
                return output

            # As in training: a row with an unusable label has loss 0 (rule S9).
            losses = self.model.per_example_losses(y, self.model.forward(x, observe=watch))
            batch = tf.shape(losses)[0]
            normalizer = self.model.loss_normalizer
            if normalizer is None:
                scale = tf.cast(batch, losses.dtype)
            else:
                scale = tf.constant(float(normalizer), losses.dtype)
            total = tf.reduce_sum(losses) / scale
        grads = tape.gradient(total, [outputs[i] for i in self.indices])
        return [
            tf.norm(tf.reshape(g * tf.cast(scale, g.dtype), tf.stack([batch, -1])), axis=1)
            for g in grads
        ]

    def __call__(self, x, y):
        if compat.keras_backend() == "jax":  # the tap (the rest is the same measurement)
            if self._function is None:
                from lipdp.clipless.jax.dynamic import JaxCotangentNorms

                self._function = JaxCotangentNorms(self.model, self.indices)
            return self._function(x, y)
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        y = tf.convert_to_tensor(y)
        if self._function is None:
            # One trace for every batch size (partial batches, Poisson subsamples).
            def spec(t):
                return tf.TensorSpec([None, *t.shape[1:]], t.dtype)

            signature = [tf.nest.map_structure(spec, x), spec(y)]
            self._function = tf.function(self._norms, input_signature=signature)
        return self._function(x, y)


def per_example_cotangent_norms(model, x, y, indices=None):
    """Norms (numpy, one ``(batch,)`` array per dynamic clip layer) of the cotangents.

    ``indices`` defaults to the positions of the dynamic clip layers.
    """
    if indices is None:
        indices = [i for i, _ in find_dynamic_clip_layers(model)]
    return [np.asarray(n) for n in CotangentNorms(model, indices)(x, y)]


# ------------------------------------------------------------------------- mechanisms
def laplace_clipped_mean(norm_sum, upper, nb_samples, epsilon, rng):
    r"""Laplace mechanism on the mean of clipped norms with a public denominator.

    Releases ``S / N + Lap(scale)`` where ``S = sum_x min(n(x), U)`` is computed by the
    caller, ``N = nb_samples`` is public and ``scale = U / (N epsilon)``.

    Sensitivity (add/remove): with ``N`` a public constant,
    ``|S(D u {x}) / N - S(D) / N| = min(n(x), U) / N <= U / N``. (Dividing by the private
    count ``|D|`` instead would give a data-dependent sensitivity.) The Laplace
    mechanism with ``scale = sensitivity / epsilon`` is ``epsilon``-DP.

    Returns ``(noisy_mean, scale)``.
    """
    scale = float(upper) / (float(nb_samples) * float(epsilon))
    return float(norm_sum) / float(nb_samples) + float(rng.laplace(0.0, scale)), scale


def histogram_edges(lower, upper, num_bins):
    """Bin edges on ``[0, U]``: ``[0, lower]`` then ``num_bins - 1`` geometric bins to ``U``.

    Geometric bins give the same *relative* resolution, ``(U / lower)^(1 / (k - 1))``,
    at every scale, which suits gradient norms spread over orders of magnitude.
    """
    upper = float(upper)
    lower = min(float(lower), upper)
    return np.concatenate([[0.0], np.geomspace(lower, upper, int(num_bins))])


def histogram_counts(norms, edges):
    """Counts of ``min(norm, U)`` in the bins ``[0, e_1], (e_1, e_2], ..., (e_{k-1}, U]``.

    Every norm falls in exactly one bin (norms are clipped to ``[0, U]`` first).
    """
    norms = np.clip(np.asarray(norms, dtype=np.float64).ravel(), 0.0, edges[-1])
    inner = edges[1:-1]
    return np.bincount(np.searchsorted(inner, norms, side="left"), minlength=len(edges) - 1)


def laplace_histogram_quantile(counts, edges, quantile, epsilon, rng):
    r"""Private ``quantile`` of the norms from a Laplace-noised histogram.

    Adds independent ``Lap(1 / epsilon)`` noise to every bin count and returns the upper
    edge of the first bin whose noisy cumulative count reaches ``quantile`` times the
    noisy total (the last edge, ``U``, if none does or if the noisy total is <= 0).

    Sensitivity (add/remove): every example falls in exactly one bin, so adding or
    removing one changes exactly one count by 1: the L1 sensitivity of the count vector
    is 1, carried by a single coordinate. The privacy loss of the vector Laplace
    mechanism is then that of the scalar Laplace mechanism with
    ``scale / sensitivity = 1 / epsilon`` (the other coordinates cancel): pure
    ``epsilon``-DP, with the Laplace RDP curve. Selecting the bin is post-processing.
    The result lies in ``[edges[1], U]``.

    Returns ``(value, noisy_counts)``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    noisy = counts + rng.laplace(0.0, 1.0 / float(epsilon), size=counts.shape)
    total = noisy.sum()
    if not total > 0:
        return float(edges[-1]), noisy
    reached = np.nonzero(np.cumsum(noisy) >= float(quantile) * total)[0]
    j = int(reached[0]) if reached.size else len(counts) - 1
    return float(edges[j + 1]), noisy


def poisson_mask(size, rate, rng):
    """Poisson subsampling: each of ``size`` examples kept independently w.p. ``rate``."""
    return rng.random(int(size)) < float(rate)


def noisy_fraction(count_below, expected_size, noise_multiplier, rng):
    r"""Gaussian mechanism on a count, divided by the public expected subsample size.

    ``(count_below + N(0, noise_multiplier^2)) / expected_size``. Adding/removing one
    example changes ``count_below`` (a count of indicators) by at most 1: sensitivity 1,
    so the noise multiplier is the noise standard deviation.
    """
    noise = rng.normal(0.0, float(noise_multiplier))
    return (float(count_below) + float(noise)) / float(expected_size)


def geometric_update(clip_value, fraction, quantile, learning_rate):
    """Andrew et al. (2021): ``C <- C * exp(-learning_rate * (fraction - quantile))``.

    ``fraction`` is the (noisy) fraction of examples with norm ``<= C``: if more than the
    target ``quantile`` are below ``C``, ``C`` decreases, and conversely; the fixed point
    is ``C`` at the ``quantile``-quantile of the norms.
    """
    return float(clip_value) * math.exp(-float(learning_rate) * (float(fraction) - quantile))


# --------------------------------------------------------------------------- callbacks
class _DynamicClipping(keras.callbacks.Callback):
    """Common machinery: validation, scheduling, bounds, per-example norms, logs."""

    mode = None

    def __init__(self, ds_train, patience, min_clip_value, seed):
        super().__init__()
        if ds_train is None:
            raise ValueError("`ds_train` is required: the training data (x, y) batches.")
        self.ds_train = ds_train
        self.patience = validation.count("`patience`", patience, 1)
        self.min_clip_value = validation.positive("`min_clip_value`", min_clip_value)
        self.rng = np.random.default_rng(seed)
        #: ``[(epoch, layer name, old clip value, new clip value)]``, one per update.
        self.history = []
        #: Number of DP releases made (mechanism invocations), what the plan counts.
        self.releases = 0
        self._active = False
        self._norms = None
        self._clip_layers = []
        self._dataset = None

    # -- declaration ------------------------------------------------------------------
    @property
    def spec(self) -> DynamicClippingSpec:
        """What this callback releases: declare it in ``DPParameters(dynamic_clipping=...)``."""
        raise NotImplementedError

    # -- training -----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model = self.model
        self._check_declared(model)
        other = getattr(model, "_running_dynamic_clipping", None)
        if other is not self and other is not None and getattr(other, "_active", False):
            raise ValueError(
                "Two dynamic clipping callbacks are used in the same fit: the privacy plan "
                "declares the releases of one. Use a single one. (If an earlier fit with "
                "another dynamic clipping callback was interrupted, call its on_train_end() "
                "first.)"
            )
        if distribute.worker_count(getattr(model, "distribute_strategy", None)) > 1:
            # Every worker runs the callbacks: each would release its own noisy clip value
            # (uncounted releases, and copies of the weights that disagree).
            raise ValueError(
                f"{type(self).__name__} is not supported on several workers: train on one "
                "worker (MirroredStrategy over its devices) or use fixed clip values."
            )
        model._running_dynamic_clipping = self
        loss = getattr(model, "loss", None)
        if not callable(getattr(loss, "get_L", None)) or not callable(getattr(loss, "call", None)):
            raise ValueError(
                f"{type(self).__name__} needs the model compiled with a lipdp loss "
                "(get_L() and per-example call())."
            )
        if getattr(model, "dataset_metadata", None) is None:
            raise ValueError(
                f"{type(self).__name__} needs the model's dataset_metadata (public N and "
                "batch size)."
            )
        self._clip_layers = find_dynamic_clip_layers(model)
        self._norms = CotangentNorms(model, [i for i, _ in self._clip_layers])
        self._dataset = self._prepare_dataset(self.ds_train)
        self._active = True

    def _check_declared(self, model):
        """Rule S11: the model's privacy plan must already contain these releases."""
        parameters = getattr(model, "dp_parameters", None)
        declared = getattr(parameters, "dynamic_clipping", None)
        if declared != self.spec:
            raise ValueError(
                f"{type(self).__name__} releases {self.spec} but the model declares "
                f"dynamic_clipping={declared}: the privacy plan (epsilon before, during and "
                "after training) would not count these releases. Build the model with "
                "DPParameters(..., dynamic_clipping=<this callback>)."
            )

    def on_train_end(self, logs=None):
        self._active = False
        if getattr(self.model, "_running_dynamic_clipping", None) is self:
            self.model._running_dynamic_clipping = None

    def on_epoch_end(self, epoch, logs=None):
        # Rounds follow the model's epochs (its optimizer steps), as the privacy plan
        # counts them: after E epochs in any number of fit calls, E // patience rounds.
        epochs_done = epochs_trained(self.model)
        if epochs_done % self.patience == 0:
            self._update(epoch)
        if logs is not None and self._clip_layers:
            values = [float(layer.clip_value.numpy()) for _, layer in self._clip_layers]
            logs["clip_value"] = values[0]
            if len(values) > 1:
                for (_, layer), value in zip(self._clip_layers, values):
                    logs[f"clip_value/{layer.name}"] = value

    def _update(self, epoch):
        raise NotImplementedError

    def _record_release(self):
        """One release made: counted here and in the model's privacy ledger (rule S10),
        the record its epsilon is computed from."""
        self.releases += 1
        rate = self.model.dataset_metadata.sampling_rate
        mechanism = self.spec.release(1, rate).mechanism
        self.model.privacy_ledger.record(release_row(mechanism))

    def _prepare_dataset(self, ds):
        if not isinstance(ds, tf.data.Dataset):
            if isinstance(ds, (tuple, list)) and len(ds) == 2:
                ds = tf.data.Dataset.from_tensor_slices(tuple(ds)).batch(256)
            else:
                raise ValueError("`ds_train` must be a tf.data.Dataset or a tuple (x, y).")
        spec = tf.nest.flatten(ds.element_spec)[0]
        input_rank = len(self.model.dataset_metadata.input_shape)
        if spec.shape.rank == input_rank:  # unbatched examples
            ds = ds.batch(256)
        elif spec.shape.rank is not None and spec.shape[0] is not None:
            raise ValueError(
                f"{type(self).__name__}: ds_train yields batches of static size "
                f"{spec.shape[0]} (batched with drop_remainder=True?). The sensitivity of the "
                "clipping statistic assumes one pass yields every training example exactly "
                "once; with drop_remainder, adding or removing one example changes which "
                "examples are dropped. Pass ds_train batched without drop_remainder, e.g. "
                "tf.data.Dataset.from_tensor_slices((x, y)).batch(256)."
            )
        return ds

    def _batches(self):
        for element in self._dataset:
            x, y, weight = keras.utils.unpack_x_y_sample_weight(element)
            if weight is not None:
                raise ValueError("ds_train must yield (x, y): sample weights are not supported.")
            yield x, y

    def _limits(self, index):
        upper = cotangent_upper_bound(self.model, index)
        return min(self.min_clip_value, upper), upper

    def _set(self, epoch, layer, value, detail):
        old = float(layer.clip_value.numpy())
        layer.clip_value.assign(value)
        self.history.append((int(epoch), layer.name, old, float(value)))
        logger.info(
            "%s, epoch %d: clip value of %r %.6g -> %.6g (%s)",
            type(self).__name__,
            epoch + 1,
            layer.name,
            old,
            value,
            detail,
        )


class LaplaceAdaptiveLossGradientClipping(_DynamicClipping):
    r"""Sets every dynamic clip value from a pure ``epsilon``-DP Laplace release.

    Every ``patience`` epochs (at the end of epochs ``patience - 1, 2 patience - 1, ...``,
    counted from 0), for every dynamic ``DP_ClipGradient`` of the model, the
    per-example cotangent norms ``n(x)`` at the layer output (before its clipping) are
    computed over one full pass of ``ds_train``, clipped to ``[0, U]`` (``U`` the public
    bound on them, see :mod:`lipdp.clipless.dynamic`), and one statistic is released with the
    Laplace mechanism:

    * ``statistic="quantile"`` (default): histogram of the norms on ``num_bins`` bins of
      ``[0, U]`` (``[0, floor]`` then geometric bins up to ``U``), ``Lap(1/epsilon)``
      noise on every count. Add/remove sensitivity: one count changes by 1 (L1
      sensitivity 1 on a single coordinate), so the release is ``epsilon``-DP with the
      privacy loss of a scalar Laplace mechanism of ``scale / sensitivity = 1/epsilon``.
      The new clip value is ``multiplier`` times the upper edge of the first bin whose
      noisy cumulative count reaches ``quantile`` times the noisy total: a
      ``quantile``-quantile up to one bin (relative resolution
      ``(U / floor)^(1/(num_bins - 1))``) plus the noise, which moves the cumulative
      counts by ``O(sqrt(num_bins) / epsilon)`` examples.
    * ``statistic="mean"``: ``m = (1/N) sum_x min(n(x), U)`` with ``N`` the public
      ``dataset_metadata.nb_samples_train``; add/remove sensitivity
      ``min(n(x), U) / N <= U / N`` (``N`` is a constant, not the private count);
      release ``m + Lap(U / (N epsilon))``; new clip value ``multiplier * m_noisy``.

    In both cases the value is then clipped into ``[floor, U]`` with
    ``floor = min(min_clip_value, U)`` (post-processing; ``C > U`` would clip nothing).
    The statistics are sums over examples of functions of one example given the public
    state (weights and other clip values come from earlier DP releases): see
    :mod:`lipdp.clipless.dynamic` for this argument and for the requirement that one pass of
    ``ds_train`` yield every example exactly once (no ``drop_remainder``).

    Cost: each update of each layer is one ``epsilon``-DP Laplace mechanism, not
    subsampled: ``(epochs // patience) * L`` releases in ``epochs`` epochs, with ``L``
    the number of dynamic clip layers (``spec``, to declare in ``DPParameters``).

    Args:
        ds_train: the private training data, ``(x, y)`` batches (a partial last batch is
            fine; see above), or a tuple of arrays ``(x, y)``.
        patience: update every ``patience`` epochs (integer >= 1).
        epsilon: privacy cost of one release (> 0).
        quantile: target quantile in ``(0, 1)`` (``statistic="quantile"``).
        statistic: ``"quantile"`` or ``"mean"``.
        multiplier: the clip value is ``multiplier`` times the released statistic (> 0).
        num_bins: number of histogram bins (integer >= 2).
        min_clip_value: lower limit of the clip value (> 0).
        seed: seed of the noise generator (``None``: fresh entropy).
    """

    mode = "laplace"
    STATISTICS = ("quantile", "mean")

    def __init__(
        self,
        ds_train,
        patience=1,
        epsilon=1.0,
        quantile=0.9,
        statistic="quantile",
        multiplier=1.0,
        num_bins=64,
        min_clip_value=DEFAULT_MIN_CLIP_VALUE,
        seed=None,
    ):
        super().__init__(ds_train, patience, min_clip_value, seed)
        self.epsilon = validation.positive("`epsilon`", epsilon)
        self.quantile = validation.open_unit("`quantile`", quantile)
        if statistic not in self.STATISTICS:
            raise ValueError(f"`statistic` must be one of {self.STATISTICS}, got {statistic!r}.")
        self.statistic = statistic
        self.multiplier = validation.positive("`multiplier`", multiplier)
        self.num_bins = validation.count("`num_bins`", num_bins, 2)

    @property
    def spec(self) -> DynamicClippingSpec:
        return DynamicClippingSpec("laplace", self.patience, epsilon=self.epsilon)

    def _update(self, epoch):
        limits = [self._limits(index) for index, _ in self._clip_layers]
        edges = [histogram_edges(lo, up, self.num_bins) for lo, up in limits]
        sums = [0.0] * len(limits)
        counts = [np.zeros(self.num_bins, dtype=np.int64) for _ in limits]
        for x, y in self._batches():
            for k, norms in enumerate(self._norms(x, y)):
                norms = np.clip(np.asarray(norms).astype(np.float64), 0.0, limits[k][1])
                sums[k] += float(norms.sum())
                counts[k] += histogram_counts(norms, edges[k])
        nb_samples = int(self.model.dataset_metadata.nb_samples_train)
        for k, (_, layer) in enumerate(self._clip_layers):
            lower, upper = limits[k]
            if self.statistic == "mean":
                released, scale = laplace_clipped_mean(
                    sums[k], upper, nb_samples, self.epsilon, self.rng
                )
                self._record_release()
                detail = f"noisy clipped mean {released:.4g}, Laplace scale {scale:.3g}"
            else:
                released, _ = laplace_histogram_quantile(
                    counts[k], edges[k], self.quantile, self.epsilon, self.rng
                )
                self._record_release()
                detail = f"noisy {self.quantile:g}-quantile {released:.4g}"
            value = float(np.clip(self.multiplier * released, lower, upper))
            self._set(epoch, layer, value, f"{detail}, limits [{lower:.3g}, {upper:.3g}]")


class AdaptiveQuantileClipping(_DynamicClipping):
    r"""Geometric quantile tracking of Andrew et al. (2021), with a private count.

    Every ``patience`` epochs, for every dynamic ``DP_ClipGradient`` and
    ``steps_per_update`` times:

    1. Poisson subsample: every example of one pass of ``ds_train`` is kept
       independently with probability ``q = model.dataset_metadata.sampling_rate``
       (``b / N``), a fresh subsample per layer and per step;
    2. ``count`` = number of kept examples whose cotangent norm at the layer output
       (before its clipping) is ``<= C``, the current clip value;
    3. ``fraction = (count + N(0, noise_multiplier^2)) / (q N)`` -- the expected
       subsample size ``q N`` is public;
    4. ``C <- C * exp(-learning_rate * (fraction - quantile))``, then ``C`` clipped into
       ``[floor, U]`` (``floor = min(min_clip_value, U)``, ``U`` the public bound on the
       norms; post-processing).

    Privacy: adding/removing one example changes ``count`` by at most 1 (sensitivity 1),
    so step 3 is a Gaussian mechanism with noise multiplier ``noise_multiplier``,
    amplified by the Poisson subsampling of step 1: ``n = (epochs // patience) *
    steps_per_update * L`` releases in ``epochs`` epochs (``L`` dynamic clip layers), each
    a subsampled Gaussian mechanism on its own subsample (``spec``, to declare in
    ``DPParameters``). As in :class:`LaplaceAdaptiveLossGradientClipping`, one pass of
    ``ds_train`` must yield every training example exactly once.

    The fixed point of the update is ``C`` at the ``quantile``-quantile of the norms; one
    step multiplies ``C`` by at most ``exp(learning_rate * max(quantile, 1 - quantile))``
    plus the noise term, so ``steps_per_update`` > 1 speeds up tracking at the cost of
    more releases. Noise on ``fraction`` has standard deviation
    ``noise_multiplier / (q N)``.

    Args:
        ds_train: the private training data, ``(x, y)`` batches, or a tuple ``(x, y)``.
        patience: update every ``patience`` epochs (integer >= 1).
        noise_multiplier: standard deviation of the noise on the count (> 0).
        quantile: target fraction of examples with norm ``<= C``, in ``(0, 1)``.
        learning_rate: step size of the geometric update (> 0).
        steps_per_update: number of (subsample, release, update) rounds per update
            (integer >= 1).
        min_clip_value: lower limit of the clip value (> 0).
        seed: seed of the subsampling and of the noise (``None``: fresh entropy).
    """

    mode = "quantiles"

    def __init__(
        self,
        ds_train,
        patience=1,
        noise_multiplier=1.0,
        quantile=0.9,
        learning_rate=0.2,
        steps_per_update=1,
        min_clip_value=DEFAULT_MIN_CLIP_VALUE,
        seed=None,
    ):
        super().__init__(ds_train, patience, min_clip_value, seed)
        self.noise_multiplier = validation.positive("`noise_multiplier`", noise_multiplier)
        self.quantile = validation.open_unit("`quantile`", quantile)
        self.learning_rate = validation.positive("`learning_rate`", learning_rate)
        self.steps_per_update = validation.count("`steps_per_update`", steps_per_update, 1)

    def _sampling_rate(self) -> float:
        if self.model is None or getattr(self.model, "dataset_metadata", None) is None:
            raise ValueError(
                "AdaptiveQuantileClipping needs model.dataset_metadata (sampling rate b / N)."
            )
        return float(self.model.dataset_metadata.sampling_rate)

    @property
    def spec(self) -> DynamicClippingSpec:
        return DynamicClippingSpec(
            "quantiles",
            self.patience,
            noise_multiplier=self.noise_multiplier,
            steps_per_update=self.steps_per_update,
        )

    def count_below(self, position, clip_value):
        """Count of a fresh Poisson subsample with norm ``<= clip_value`` at one layer.

        ``position`` indexes the dynamic clip layers. Returns ``(count, subsample size)``.
        """
        rate = self._sampling_rate()
        count, size = 0, 0
        for x, y in self._batches():
            keep = poisson_mask(int(compat.flatten(x)[0].shape[0]), rate, self.rng)
            if not keep.any():
                continue
            if compat.keras_backend() == "jax":  # numpy rows for the JAX tap
                x_kept = keras.tree.map_structure(lambda t, m=keep: np.asarray(t)[m], x)
                y_kept = np.asarray(y)[keep]
            else:
                x_kept = tf.nest.map_structure(lambda t, m=keep: tf.boolean_mask(t, m), x)
                y_kept = tf.boolean_mask(y, keep)
            norms = np.asarray(self._norms(x_kept, y_kept)[position])
            count += int(np.sum(norms <= clip_value))
            size += int(keep.sum())
        return count, size

    def _update(self, epoch):
        rate = self._sampling_rate()
        expected = rate * int(self.model.dataset_metadata.nb_samples_train)
        for position, (index, layer) in enumerate(self._clip_layers):
            lower, upper = self._limits(index)
            clip = float(layer.clip_value.numpy())
            fractions = []
            for _ in range(self.steps_per_update):
                count, _ = self.count_below(position, clip)
                fraction = noisy_fraction(count, expected, self.noise_multiplier, self.rng)
                self._record_release()
                fractions.append(fraction)
                clip = geometric_update(clip, fraction, self.quantile, self.learning_rate)
                clip = float(np.clip(clip, lower, upper))
            detail = ", ".join(f"{f:.3f}" for f in fractions)
            self._set(
                epoch,
                layer,
                clip,
                f"noisy fraction(s) below C: {detail}, target {self.quantile:g}, "
                f"limits [{lower:.3g}, {upper:.3g}]",
            )
