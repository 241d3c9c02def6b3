"""The dynamic clipping model both backends are compared on, and the TensorFlow numbers,
computed in a subprocess under ``KERAS_BACKEND=tensorflow``
(``python -m tests.clipless.jax.tensorflow_dynamic_side in.npz out.npz``): the per-example
cotangent norms at the two dynamic clip layers, the clip values after one update of each
callback (same seeds, same kernels), and the ledger and epsilon after ``epochs`` epochs of
``fit`` with each callback."""

import json
import sys

import numpy as np

SPEC = {"n": 64, "b": 16, "features": 6, "classes": 4, "hidden": 8, "bound": 2.0,
        "tau": 2.0, "sigma": 1.2, "delta": 1e-5, "mid_clip": 0.05, "clip": 0.3,
        "epochs": 2}  # fmt: skip


def callback(kind, x, y, seed=5):
    """One of the two callbacks, seeded, measuring on ``(x, y)`` (batches of 24: a partial
    last batch)."""
    from lipdp.clipless.dynamic import AdaptiveQuantileClipping
    from lipdp.clipless.dynamic import LaplaceAdaptiveLossGradientClipping as Laplace

    if kind == "laplace":
        return Laplace((x, y), epsilon=0.7, quantile=0.8, num_bins=32, seed=seed)
    return AdaptiveQuantileClipping((x, y), noise_multiplier=2.0, quantile=0.6, seed=seed)


def model(spec, dynamic, kernels=None, strategy="global"):
    """``input -> d1 -> mid (dynamic clip) -> sort -> d2 -> clip (dynamic clip)``, compiled
    (SGD); ``kernels``: ``{name: kernel, u_name: power vector}`` to start from; ``strategy``:
    the noise strategy."""
    import keras

    from lipdp.clipless import layers as L
    from lipdp.clipless import losses
    from lipdp.clipless.model import DP_Sequential, DPParameters
    from lipdp.foundation.metadata import DatasetMetadata

    metadata = DatasetMetadata(
        input_shape=(spec["features"],), nb_classes=spec["classes"],
        nb_samples_train=spec["n"], batch_size=spec["b"], sampling="shuffle",
    )  # fmt: skip
    network = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(spec["features"],), upper_bound=spec["bound"]),
            L.DP_SpectralDense(spec["hidden"], name="d1"),
            L.DP_ClipGradient(spec["mid_clip"], mode="dynamic", name="mid"),
            L.DP_GroupSort(2, name="sort"),
            L.DP_SpectralDense(spec["classes"], name="d2"),
            L.DP_ClipGradient(spec["clip"], mode="dynamic", name="clip"),
        ],
        dp_parameters=DPParameters(
            strategy, spec["sigma"], spec["delta"], dynamic_clipping=dynamic
        ),
        dataset_metadata=metadata,
    )
    network.compile(
        loss=losses.DP_TauCategoricalCrossentropy(tau=spec["tau"]),
        optimizer=keras.optimizers.SGD(0.1),
    )
    for name in ("d1", "d2") if kernels is not None else ():
        network.get_layer(name).kernel.assign(kernels[name])
        network.get_layer(name).power_vector.assign(kernels[f"u_{name}"])
    return network


def updated_clip_values(spec, kind, x, y, kernels=None):
    """The clip values after one update of the ``kind`` callback (no training), and the
    callback's limits ``[(floor, U)]`` of each layer before it."""
    cb = callback(kind, x, y)
    network = model(spec, cb.spec, kernels)
    cb.set_model(network)
    cb.on_train_begin()
    limits = [cb._limits(index) for index, _ in cb._clip_layers]
    cb._update(0)
    cb.on_train_end()
    return [float(layer.clip_value.numpy()) for _, layer in cb._clip_layers], limits


def fitted_ledger(spec, kind, x, y, kernels=None):
    """``(ledger terms as text, epsilon, releases, kept)`` after ``epochs`` epochs of ``fit``
    with ``kind``; ``kept``: the clip values after ``fit`` are the callback's last ones (the
    end of ``fit`` did not write older values back)."""
    from lipdp.accounting import get_accountant

    cb = callback(kind, x, y)
    network = model(spec, cb.spec, kernels)
    network.fit(x, y, batch_size=spec["b"], epochs=spec["epochs"], callbacks=[cb], verbose=0)
    terms = network.privacy_ledger.terms()
    epsilon = float(get_accountant("rdp").epsilon(terms, spec["delta"]))
    last = [np.float32(value) for _, _, _, value in cb.history[-len(cb._clip_layers) :]]
    kept = [np.float32(layer.clip_value.numpy()) for _, layer in cb._clip_layers] == last
    return repr(terms), epsilon, cb.releases, kept


def main(source, target):
    from lipdp.clipless.dynamic import per_example_cotangent_norms

    given = np.load(source)
    spec = json.loads(str(given["spec"]))
    x, y = given["x"], given["y"]
    kernels = {k: given[k] for k in ("d1", "d2", "u_d1", "u_d2")}
    out = {}
    network = model(spec, callback("laplace", x, y).spec, kernels)
    out["norm_mid"], out["norm_clip"] = per_example_cotangent_norms(network, x, y)
    for kind in ("laplace", "quantiles"):
        out[f"clips_{kind}"] = np.asarray(updated_clip_values(spec, kind, x, y, kernels)[0])
        terms, epsilon, releases, _ = fitted_ledger(spec, kind, x, y)  # fresh kernels
        out[f"terms_{kind}"], out[f"epsilon_{kind}"] = np.asarray(terms), np.float64(epsilon)
        out[f"releases_{kind}"] = np.int64(releases)
    np.savez(target, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
