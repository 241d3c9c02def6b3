"""Tabular data as batched ``tf.data`` pipelines: split, feature scaling, norm bound.

:func:`prepare_tabular_data`: stratified split -> feature scaling
(:data:`TABULAR_SCALINGS`) -> per-example norm clipping (:mod:`lipdp.data.input_bounds`)
-> batches (:mod:`lipdp.data.sampling`). :func:`~lipdp.data.sources.load_adbench_data`
(re-exported from :mod:`lipdp.data.sources`) reads the anomaly-detection data sets it
is used with.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import tensorflow as tf

from lipdp.data.input_bounds import _parse_bound_fct
from lipdp.data.sampling import (
    _check_batch_size,
    _one_hot,
    _ordered_batches,
    _partial_last_batch,
    _training_batches,
)
from lipdp.data.sources import load_adbench_data
from lipdp.foundation.metadata import SAMPLING_MODES, DatasetMetadata
from lipdp.foundation.validation import choice

logger = logging.getLogger(__name__)

#: Feature scalings of :func:`prepare_tabular_data`.
TABULAR_SCALINGS = ("ranges", "none", "standardize")


def _feature_ranges(feature_ranges, d):
    low, high = (np.broadcast_to(np.asarray(v, "float64"), (d,)) for v in feature_ranges)
    if not np.all(np.isfinite(low) & np.isfinite(high) & (high > low)):
        raise ValueError("feature_ranges must be finite (low, high) with high > low per feature.")
    return low, high


def prepare_tabular_data(
    x,
    y,
    test_size=0.2,
    batch_size=256,
    bound_fct=None,
    seed=0,
    drop_remainder=True,
    *,
    scaling=None,
    feature_ranges=None,
    one_hot=True,
    shuffle_seed=None,
    sampling="shuffle",
):
    """Tabular data ``(x, y)`` -> ``(ds_train, ds_test, metadata)``.

    1. Stratified split (scikit-learn, ``random_state=seed``); ``len(test) =
       ceil(test_size * n)`` for a fraction.
    2. Feature scaling, ``scaling`` one of :data:`TABULAR_SCALINGS`:

       * ``"ranges"`` (sound; the default when ``feature_ranges`` is given): each
         feature is clipped to its *public* range ``feature_ranges = (low, high)``
         (scalars or one value per feature, from domain knowledge or a data
         dictionary -- not from the private data) and mapped affinely to ``[-1, 1]``.
         No private statistic is used, and every example has norm ``<= sqrt(d)``.
       * ``"none"``: features are used as given.
       * ``"standardize"``: mean and standard deviation of every feature, fitted on
         the *training split only* (the test split does not influence them).
         **Non-private**: these statistics of the private training set are not
         released through a DP mechanism, so the (epsilon, delta) guarantee does not
         cover them (rule S6). ``metadata.notes`` records it, a warning is logged.
         For a comparison with published results only.

       With neither ``scaling`` nor ``feature_ranges`` a ``ValueError`` asks for a choice.
    3. Per-example norm bound: ``bound_fct`` is ``None``, a number ``c`` (each example
       clipped to norm ``c``) or a ``(fn, bound)`` pair
       (:func:`~lipdp.data.input_bounds.bound_clip_value`,
       :func:`~lipdp.data.input_bounds.bound_normalize`). ``None`` is allowed with
       ``"ranges"`` only (bound ``sqrt(d)``); the other scalings have no public bound
       and need one.

    The set of label values (``np.unique(y)``) is treated as public. Labels are one-hot
    float32 (``one_hot=True``) or class indices as a float32 column ``(n, 1)``.
    ``shuffle_seed`` seeds the per-epoch shuffle (or the Poisson draws) of the training set.
    ``sampling``: ``"shuffle"`` (fixed-size batches of a shuffle, the default of this call
    form) or ``"poisson"`` (each example joins each batch with probability ``b / N``, the
    mechanism the accountant analyses; ``N // b`` steps per epoch).
    """
    from sklearn.model_selection import train_test_split

    x = np.asarray(x, dtype="float32")
    if x.ndim != 2:
        raise ValueError(f"x must have shape (n, d), got {x.shape}.")
    y = np.asarray(y).reshape(-1)
    if len(y) != len(x):
        raise ValueError(f"x has {len(x)} rows but y has {len(y)} labels.")
    d = x.shape[1]
    if scaling is None:
        if feature_ranges is None:
            raise ValueError(
                "Choose a feature scaling: feature_ranges=(low, high) with public ranges "
                "(sound), scaling='none', or scaling='standardize' (fitted on the private "
                "training split: not covered by the DP guarantee)."
            )
        scaling = "ranges"
    choice("scaling", scaling, TABULAR_SCALINGS)
    if (scaling == "ranges") != (feature_ranges is not None):
        raise ValueError("feature_ranges is required with scaling='ranges' and only then.")
    fn, bound = _parse_bound_fct(bound_fct)
    if bound is None and scaling != "ranges":
        raise ValueError(
            f"With scaling={scaling!r} the norm of an example has no public bound: pass "
            "bound_fct=c (clip every example to norm c) or a (fn, bound) pair."
        )

    classes = np.unique(y)
    labels = np.searchsorted(classes, y)
    x_train, x_test, y_train, y_test = train_test_split(
        x, labels, test_size=test_size, random_state=seed, stratify=labels
    )
    notes = []
    if scaling == "ranges":
        low, high = _feature_ranges(feature_ranges, d)

        def scale(v):
            v = np.clip(v.astype("float64"), low, high)
            return (2.0 * (v - low) / (high - low) - 1.0).astype("float32")

        x_train, x_test = scale(x_train), scale(x_test)
        if bound is None:
            bound = math.sqrt(d)
    elif scaling == "standardize":
        mean = x_train.astype("float64").mean(axis=0)
        std = x_train.astype("float64").std(axis=0)
        std = np.where(std > 0, std, 1.0)
        x_train = ((x_train - mean) / std).astype("float32")
        x_test = ((x_test - mean) / std).astype("float32")
        note = (
            "non-private preprocessing: features standardised with the mean and standard "
            "deviation of the private training split; the (epsilon, delta) guarantee does "
            "not cover these statistics."
        )
        notes.append(note)
        logger.warning(note)
    if fn is not None:
        x_train = np.asarray(fn(tf.constant(x_train)))
        x_test = np.asarray(fn(tf.constant(x_test)))

    nb_classes = len(classes)
    if one_hot:
        y_train, y_test = _one_hot(y_train, nb_classes), _one_hot(y_test, nb_classes)
    else:
        y_train = y_train.astype("float32")[:, None]
        y_test = y_test.astype("float32")[:, None]
    n_train = len(x_train)
    batch_size = _check_batch_size(batch_size, n_train)
    tensors = {
        "train": (tf.constant(x_train), tf.constant(y_train)),
        "test": (tf.constant(x_test), tf.constant(y_test)),
    }

    def gather(split):
        xs, ys = tensors[split]
        return lambda indices, *_: (tf.gather(xs, indices), tf.gather(ys, indices))

    choice("sampling", sampling, SAMPLING_MODES)
    metadata = DatasetMetadata(
        input_shape=(d,),
        nb_classes=nb_classes,
        nb_samples_train=n_train,
        nb_samples_test=len(x_test),
        class_names=[str(c) for c in classes],
        batch_size=batch_size,
        max_norm=float(bound),
        partial_last_batch=sampling == "shuffle"
        and _partial_last_batch(n_train, batch_size, drop_remainder),
        notes=notes,
        sampling=sampling,
    )
    ds_train = _training_batches(metadata, drop_remainder, shuffle_seed, gather("train"))
    ds_test = _ordered_batches(len(x_test), batch_size, gather("test"))
    return ds_train, ds_test.prefetch(tf.data.AUTOTUNE), metadata


__all__ = ["TABULAR_SCALINGS", "load_adbench_data", "prepare_tabular_data"]
