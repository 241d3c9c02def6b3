"""A run of ``lipdp train`` / ``lipdp evaluate`` without the command line: the data, the
seed, the training and the test metrics of a :class:`~lipdp.recipes.recipe_config.RunConfig`.

:func:`train` is what ``lipdp train`` does: :func:`prepare` (seed, data, the compiled model
of :mod:`lipdp.recipes.model_factory`, epochs within the budget), :func:`fit` (Poisson
batches, the accountant callback) and :func:`metrics_on_test_set`; what ``lipdp evaluate``
reports is :mod:`lipdp.recipes.run_evaluation`'s.

The configurations (:mod:`lipdp.recipes.recipe_config`) and the model factory
(:mod:`lipdp.recipes.model_factory`) were part of this module: their public names are
still importable from here (``from lipdp.recipes.runs import ModelRecipe, build_model``).

TensorFlow is imported by the functions that build or train a model, not by this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lipdp.foundation import validation
from lipdp.recipes import defaults as D
from lipdp.recipes import model_factory, recipe_config
from lipdp.recipes.model_factory import *  # noqa: F403  (the old names of this module)
from lipdp.recipes.model_factory import build_model, run_metadata
from lipdp.recipes.recipe_config import ModelRecipe, RunConfig


# -------------------------------------------------------------------------- the data
def set_seed(seed: int) -> None:
    """Seed Python, NumPy and TensorFlow (the initial weights of a run)."""
    import keras

    keras.utils.set_random_seed(seed)


def load_data(dataset: str, data_dir=None, *, data_dir_name="data_dir"):
    """The :class:`~lipdp.data.sources.ArrayDataset` of ``dataset`` (``data_dir``:
    fashion_mnist's IDX files; default: where :mod:`lipdp.data.sources` looks;
    ``data_dir_name``: its name in the error messages, ``--data-dir`` for the CLI)."""
    from lipdp.data import sources

    validation.choice("dataset", dataset, D.DATASETS)
    if dataset == "digits":
        return sources.load_digits()
    if dataset == "breast_cancer":
        return sources.load_breast_cancer()
    return sources.load_fashion_mnist(data_dir, data_dir_name=data_dir_name)


def data_dir_holds(dataset: str, data_dir) -> bool:
    """Whether ``data_dir`` holds ``dataset``'s files (``lipdp.data.sources.holds_dataset``;
    checked by name, nothing read)."""
    from lipdp.data import sources

    return sources.holds_dataset(data_dir, dataset)


def dataset_files(dataset: str) -> str:
    """The files ``dataset`` is read from, for messages."""
    from lipdp.data import sources

    return sources.dataset_files(dataset)


def checked_delta(delta, n, *, allow_large=False, name="delta", force="allow_large_delta=True"):
    """``delta`` for ``n`` training examples: refused at ``delta >= 1/n`` unless
    ``allow_large`` (:func:`lipdp.foundation.validation.delta_for_dataset`, the one rule)."""
    return validation.delta_for_dataset(delta, n, allow_large=allow_large, name=name, force=force)


def one_hot(labels, nb_classes):
    """Class indices as float32 one-hot rows (what the losses of both families take)."""
    import numpy as np

    return np.eye(nb_classes, dtype="float32")[labels]


def training_arrays(metadata, data):
    """``(x, y)``: the first ``metadata.nb_samples_train`` training examples, labels
    one-hot."""
    n_train = metadata.nb_samples_train
    return data.x_train[:n_train], one_hot(data.y_train[:n_train], data.nb_classes)


def model_and_arrays(recipe: ModelRecipe, data):
    """``(compiled model, x_train, y_train)`` of ``recipe`` on ``data``: :func:`run_metadata`,
    :func:`build_model` and :func:`training_arrays` in one call."""
    metadata = run_metadata(recipe, data)
    return (build_model(recipe, metadata), *training_arrays(metadata, data))


# ---------------------------------------------------------------------------- training
@dataclass
class PreparedRun:
    """A run ready to train (:func:`prepare`): its data, its compiled model, the training
    arrays, the number of epochs and ``front_end``, the number of leading layers of the
    model whose outputs :func:`fit` computes once (0: none; ``RunConfig.cache_features``)."""

    run: RunConfig
    data: object
    model: object
    x_train: object
    y_train: object
    epochs: int
    front_end: int = 0


class TrainedRun(NamedTuple):
    """What :func:`train` returns: the trained model, the Keras ``History`` (``epsilon``
    logged every epoch by ``DP_Accountant``) and the test metrics (:func:`metrics_on_test_set`)."""

    model: object
    history: object
    test_metrics: dict


def prepare(run: RunConfig, data=None, strategy=None) -> PreparedRun:
    """Seed, data (``load_data`` unless given), the compiled model under ``strategy``
    (a ``tf.distribute`` strategy; default: TensorFlow's current one) and the epochs:
    ``run.epochs``, or the most within ``run.epsilon`` (``get_max_epochs``)."""
    import tensorflow as tf

    from lipdp.accounting.budget import get_max_epochs

    run = RunConfig.coerce(run)
    set_seed(run.seed)
    if data is None:
        data = load_data(run.model.dataset, run.data_dir)
    with (strategy or tf.distribute.get_strategy()).scope():
        model, x_train, y_train = model_and_arrays(run.model, data)
    epochs = run.epochs or get_max_epochs(run.epsilon, model, accountant=run.accountant)
    return PreparedRun(run, data, model, x_train, y_train, epochs, _cached_front_end(run, model))


def _cached_front_end(run: RunConfig, model) -> int:
    """The leading layers :func:`fit` computes once (``RunConfig.cache_features``)."""
    from lipdp.clipless.features import fixed_front_end

    if not run.cache_features or getattr(model, "adversarial", None) is not None:
        return 0
    return fixed_front_end(list(model.layers))


def training_callbacks(run: RunConfig) -> list:
    """``DP_Accountant`` (epsilon in the logs, the budget enforced) and, with ``averaging``,
    ``ParameterAveraging``."""
    from lipdp.core.callbacks import DP_Accountant, ParameterAveraging

    callbacks = [DP_Accountant(epsilon_budget=run.epsilon, accountant=run.accountant)]
    if run.averaging is not None:
        callbacks.append(ParameterAveraging(decay=run.averaging))
    return callbacks


def fit(prepared: PreparedRun, callbacks=(), verbose=0):
    """Train ``prepared.model`` for ``prepared.epochs``: on Poisson batches of rate
    ``b / N`` (the mechanism the accountant analyses) or, with ``sampling="shuffle"``, on
    fixed-size batches of a shuffle. ``callbacks`` come after :func:`training_callbacks`.
    Returns the Keras ``History``.

    With ``prepared.front_end`` (a fixed front-end, ``RunConfig.cache_features``) the
    model's head is trained instead, on the front-end's outputs computed once
    (:func:`_fit_on_features`), and ``prepared.model`` is then the whole network rebuilt
    from the trained layers; ``callbacks`` see the head."""
    if prepared.front_end:
        return _fit_on_features(prepared, callbacks, verbose)
    return _fit_model(prepared, prepared.model, prepared.x_train, callbacks, verbose)


def _fit_model(prepared: PreparedRun, model, x, callbacks, verbose):
    from lipdp.data.sampling import poisson_batches

    y = prepared.y_train
    every = training_callbacks(prepared.run) + list(callbacks)
    options = dict(epochs=prepared.epochs, verbose=verbose, callbacks=every)
    metadata = model.dataset_metadata
    if metadata.sampling == "poisson":
        rate, steps = metadata.sampling_rate, metadata.nb_steps_per_epochs
        return model.fit(poisson_batches(x, y, rate, steps), **options)
    return model.fit(x, y, batch_size=metadata.batch_size, **options)


def _fit_on_features(prepared: PreparedRun, callbacks, verbose):
    """Train the layers after the fixed front-end on its outputs, computed once.

    Why it is the same mechanism: the front-end maps each record to its features by a
    fixed function (:func:`lipdp.clipless.features.fixed_front_end`: no weights, no
    statistic of the data), so neighbouring training sets give feature sets that differ
    in one row, and the head's training is the whole network's training -- the same
    layers, the same batches, the same per-variable sensitivities (the head opens with
    ``DP_BoundedInput`` at the front-end's public output bound, the bound the whole
    network's bound pass has there; checked below) and the same noise. The whole network
    is then rebuilt from the trained layers: it shares the head's privacy ledger
    (:func:`lipdp.core.ledger.inherited_ledger`) and step count.
    """
    head, features = feature_head(prepared)
    try:
        history = _fit_model(prepared, head, features, callbacks, verbose)
    except KeyboardInterrupt:  # the partial training is the whole network's too
        _rebuild_whole(prepared, head)
        raise
    _rebuild_whole(prepared, head)
    return history


def _rebuild_whole(prepared: PreparedRun, head) -> None:
    """``prepared.model``: the whole network rebuilt from the layers ``head`` trained,
    with its step count. Its optimizer is built on its variables: a ``.keras`` file of
    the whole network saved with an unbuilt optimizer holds two optimizer variables, and
    Keras, which builds the optimizer when it loads the file, warns that it skips them
    (``lipdp evaluate --model``)."""
    model, recipe = prepared.model, prepared.run.model
    with model.distribute_strategy.scope():
        whole = build_model(recipe, model.dataset_metadata, _with_input(model))
        if whole.optimizer is not None and not getattr(whole.optimizer, "built", True):
            whole.optimizer.build(whole.trainable_variables)
    whole.noisy_steps.assign(head.noisy_steps)
    prepared.model = whole


def feature_head(prepared: PreparedRun):
    """``(head, features)``: the compiled model of the layers after ``prepared``'s fixed
    front-end (sharing them with ``prepared.model``), opened by :func:`_head_input`, and
    the front-end's outputs on the training set, which it trains on (:func:`fit`). Its
    sensitivities are checked against the whole network's first."""
    from lipdp.clipless.features import apply_front_end

    if not prepared.front_end:
        raise ValueError("this run has no fixed front-end (PreparedRun.front_end is 0).")
    model = prepared.model
    front, rest = model.layers[: prepared.front_end], model.layers[prepared.front_end :]
    features = apply_front_end(front, prepared.x_train)
    with model.distribute_strategy.scope():
        layers = _head_input(front, features) + list(rest)
        head = build_model(prepared.run.model, model.dataset_metadata, layers)
    _refuse_smaller_sensitivities(head, model)
    return head, features


def _head_input(front, features) -> list:
    """The input layer of the head: ``DP_BoundedInput`` at the front-end's output bound
    (clipless), a plain input layer (dp-sgd: its sensitivity is its clipping norm)."""
    from lipdp.clipless.features import front_end_bound
    from lipdp.clipless.layers import DP_BoundedInput
    from lipdp.foundation import compat

    shape = features.shape[1:]
    if isinstance(front[0], DP_BoundedInput):
        return [DP_BoundedInput(shape, front_end_bound(front))]
    return [compat.input_layer(shape)]


def _with_input(model) -> list:
    """The layers of ``model``, with an input layer first when Keras keeps it out of
    ``model.layers`` (Keras 3's ``Sequential``)."""
    import keras

    from lipdp.clipless.layers import DP_BoundedInput
    from lipdp.foundation import compat

    layers = list(model.layers)
    if isinstance(layers[0], (keras.layers.InputLayer, DP_BoundedInput)):
        return layers
    return [compat.input_layer(model.dataset_metadata.input_shape), *layers]


def _refuse_smaller_sensitivities(head, model) -> None:
    """The head's sensitivities are the whole network's (clipless: its layers' bounds;
    dp-sgd: its clipping norms): a smaller one would under-state the noise the head needs."""
    whole = {entry.key: float(delta) for entry, delta in model.sensitivities()}
    for entry, delta in head.sensitivities():
        if float(delta) < whole[entry.key] * (1 - 1e-6):
            raise RuntimeError(
                f"the head trained on cached features bounds {entry.key} by {float(delta):g}, "
                f"below the whole network's {whole[entry.key]:g}: train without the cache "
                "(RunConfig(cache_features=False)) and report this."
            )


def metrics_on_test_set(model, data) -> dict:
    """``{"loss": ..., "accuracy": ...}`` of ``model`` on ``data``'s test set."""
    y_test = one_hot(data.y_test, data.nb_classes)
    return model.evaluate(data.x_test, y_test, verbose=0, return_dict=True)


def train(run: RunConfig, data=None, strategy=None, callbacks=(), verbose=0) -> TrainedRun:
    """``lipdp train`` without the printing: :func:`prepare`, :func:`fit`,
    :func:`metrics_on_test_set`. Returns ``(model, history, test_metrics)``."""
    prepared = prepare(run, data, strategy)
    history = fit(prepared, callbacks, verbose)
    return TrainedRun(prepared.model, history, metrics_on_test_set(prepared.model, prepared.data))


#: The run's names, then the old module's names now defined by the other two.
__all__ = [
    "PreparedRun",
    "TrainedRun",
    "set_seed",
    "load_data",
    "one_hot",
    "training_arrays",
    "model_and_arrays",
    "prepare",
    "feature_head",
    "training_callbacks",
    "fit",
    "metrics_on_test_set",
    "train",
    *recipe_config.__all__,
    *model_factory.__all__,
]
