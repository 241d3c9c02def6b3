"""One private model of each family, made and trained through the public API on whatever
backend Keras runs (``make_private``, ``compile``, ``train_on_batch``), and the attacker's
measurement on it: how far the released update moves when one record leaves the batch.

The released update is read from the weights: the models train with SGD of learning rate
1 and no momentum, so ``theta_before - theta_after`` is the released (noisy) gradient,
to float32 round-off of ``theta`` (relative ``2^-24`` of each weight, far below
``ROUNDOFF_SLACK`` of the sensitivities used here). The clipless family's projection runs
after the update; it is switched off for the measurement (:func:`without_projection`),
so that what is compared is the release itself, as the TensorFlow harness
(``tests/remove_one.py``) compares it. Identical noise: every model of a comparison trains
its first step right after ``use_reproducible_noise(seed)``; each backend then derives
the noise of that step from the seed alone (TensorFlow's generator and JAX's key are
created at the first step of the model)."""

from __future__ import annotations

import keras
import numpy as np

from lipdp import make_private  # noqa: F401 (used by the tests)
from lipdp.core import noise
from lipdp.foundation import compat
from lipdp.foundation.variables import variable_key

FEATURES, CLASSES = 6, 3
FAMILIES = ("clipped", "clipless")
BACKEND = keras.backend.backend()


def network(family, seed=0):
    """A small network of the family, initialised from ``seed`` alone."""
    if family == "clipped":
        dense = keras.layers.Dense
        init = keras.initializers.GlorotUniform
        return [
            compat.input_layer((FEATURES,)),
            dense(8, activation="tanh", kernel_initializer=init(seed=10 * seed)),
            dense(CLASSES, kernel_initializer=init(seed=10 * seed + 1)),
        ]
    from lipdp.clipless import layers as dp

    orthogonal = keras.initializers.Orthogonal
    return [
        dp.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=2.0),
        dp.DP_SpectralDense(8, kernel_initializer=orthogonal(seed=10 * seed)),
        dp.DP_GroupSort(2),
        dp.DP_SpectralDense(CLASSES, kernel_initializer=orthogonal(seed=10 * seed + 1)),
    ]


def layers_of(model) -> list:
    """The layers a private model was made from (a loaded one included), to build another
    model on: ``dp_layers`` of the TensorFlow models and of the clipless JAX model, the
    network's layers of the clipped JAX model."""
    network = getattr(model, "network", None)
    if network is not None:
        return [compat.input_layer((FEATURES,)), *network.layers]
    return list(model.dp_layers)


def loss(family):
    if family == "clipped":
        return keras.losses.CategoricalCrossentropy(from_logits=True)
    from lipdp.clipless.losses import DP_TauCategoricalCrossentropy

    return DP_TauCategoricalCrossentropy(2.0)


def private(family, *, batch_size=8, dataset_size=64, seed=0, noise="global", layers=None,
            **options):  # fmt: skip
    """A compiled private model of ``family`` on ``layers`` (default: a new
    :func:`network`; Poisson sampling: a batch minus one row is a legal batch; SGD of rate
    1: the update is minus the release)."""
    model = make_private(
        network(family, seed) if layers is None else layers, epsilon=3.0, delta=1e-5,
        epochs=1, batch_size=batch_size, dataset_size=dataset_size, method=family, noise=noise,
        **options,
    )  # fmt: skip
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss(family))
    return model


def data(rows, seed=0, scales=None):
    """``rows`` records (rows scaled by ``scales`` if given) and one-hot labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    if scales is not None:
        x = (x.astype("float64") * np.asarray(scales, "float64")[:, None]).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.integers(0, CLASSES, rows)]
    return x, y


def weights(model) -> np.ndarray:
    values = [np.asarray(v) for v in model.trainable_variables]
    return np.concatenate([np.ravel(v).astype("float64") for v in values])


def without_projection(model):
    """The clipless model's projections switched off (the release is measured before them):
    the TensorFlow step calls ``project()``, the JAX step the pure ``_projected``."""
    model.project = lambda: None
    model._projected = lambda trainable, non_trainable: (trainable, non_trainable)
    return model


def released(model, x, y, noise_seed=7) -> np.ndarray:
    """The released gradient of ``model``'s first real step on ``(x, y)``, its noise drawn
    from ``noise_seed``."""
    noise.use_reproducible_noise(noise_seed)
    try:
        before = weights(model)
        model.train_on_batch(x, y)
        return before - weights(model)
    finally:
        noise.use_reproducible_noise(None)


def global_sensitivity(model) -> float:
    """``sqrt(sum Delta^2)`` of the model's declared mechanisms (one Gaussian of the
    whole gradient under global noise)."""
    return float(np.sqrt(sum(float(d) ** 2 for _, d in model.sensitivities())))


def remove_one_ratios(family, x, y, rows, **options) -> list[float]:
    """``||release(B) - release(B \\ {row})|| / Delta`` for each of ``rows``: fresh
    identical models, identical noise (the attacker's check, rule S1)."""
    full = without_projection(private(family, **options))
    delta = global_sensitivity(full)  # of the weights the step starts from (adaptive bounds)
    release = released(full, x, y)
    ratios = []
    for row in rows:
        keep = np.arange(len(x)) != row
        without = without_projection(private(family, **options))
        moved = np.linalg.norm(release - released(without, x[keep], y[keep]))
        ratios.append(float(moved / delta))
    return ratios


def mechanism_parts(model) -> list[tuple[float, slice]]:
    """``[(Delta_v, part of weights(model))]``: the Gaussian mechanisms of one step of a
    clipless model under ``"per-layer"`` noise -- one per trainable variable ``v`` (noise
    ``sigma c_v Delta_v`` on ``v`` alone), each with its own ``Delta_v`` (the grouping of
    ``tests/remove_one.py``'s ``mechanism_groups`` on TensorFlow)."""
    parts, start = {}, 0
    for variable in model.trainable_variables:
        size = int(np.prod(variable.shape))
        parts[variable_key(variable)] = slice(start, start + size)
        start += size
    return [(float(delta), parts[variable_key(e.variable)]) for e, delta in model.sensitivities()]


def mechanism_ratios(family, x, y, rows, **options) -> np.ndarray:
    """``ratios[k, g]``: ``||part_g(release(B) - release(B \\ {rows[k]}))|| / Delta_g`` for
    each mechanism ``g`` of :func:`mechanism_parts` (``"per-layer"`` noise), fresh identical
    models, identical noise (rule S1 mechanism by mechanism: the accountant composes one
    Gaussian of sensitivity ``Delta_g`` per part)."""
    options = {**options, "noise": "per-layer"}
    full = without_projection(private(family, **options))
    release, parts = released(full, x, y), mechanism_parts(full)
    ratios = []
    for row in rows:
        keep = np.arange(len(x)) != row
        without = without_projection(private(family, **options))
        moved = release - released(without, x[keep], y[keep])
        ratios.append([float(np.linalg.norm(moved[part]) / delta) for delta, part in parts])
    return np.asarray(ratios)
