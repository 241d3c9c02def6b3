"""The TensorFlow side of ``test_cross_backend_file.py``, run in a subprocess under
``KERAS_BACKEND=tensorflow`` (``python -m tests.clipless.jax.file_side DIR``), and the model
both sides build (:func:`build`, backend-neutral).

For every noise strategy of ``DIR/spec.json``: a TensorFlow ``DP_Sequential`` trained
``steps`` real steps and saved to ``DIR/tf_<strategy>.keras``; the JAX file
``DIR/jax_<strategy>.keras`` loaded here and trained one more step. What each model holds
(weights per layer, the ledger's table and counts, the step count, epsilon, the
configuration) goes to ``DIR/tf.npz``."""

import json
import sys

import numpy as np

FEATURES, CLASSES = 6, 4
SPEC = {"n": 64, "b": 16, "sigma": 1.3, "delta": 1e-5, "steps": 2}


def build(strategy, seed=0):
    """A compiled clipless ``DP_Sequential`` (seeded initial weights) of noise ``strategy``."""
    import keras

    from lipdp.clipless import layers as L
    from lipdp.clipless.losses import DP_TauCategoricalCrossentropy
    from lipdp.clipless.model import DP_Sequential, DPParameters
    from lipdp.foundation.metadata import DatasetMetadata

    keras.utils.set_random_seed(seed)
    metadata = DatasetMetadata(
        input_shape=(FEATURES,), nb_classes=CLASSES, nb_samples_train=SPEC["n"],
        batch_size=SPEC["b"], sampling="shuffle",
    )  # fmt: skip
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=2.0, name="input"),
            L.DP_SpectralDense(8, weight_norm_bound=2.0, nm_coef=1.5, name="d1"),
            L.DP_GroupSort(2, name="sort"),
            L.DP_SpectralDense(CLASSES, name="d2"),
        ],
        dp_parameters=DPParameters(strategy, SPEC["sigma"], SPEC["delta"]),
        dataset_metadata=metadata,
    )
    model.compile(loss=DP_TauCategoricalCrossentropy(2.0), optimizer=keras.optimizers.SGD(0.1))
    return model


def build_clipped():
    """A clipped model of this backend (``make_private``: ``DPSGD_Sequential`` on
    TensorFlow, ``DPSGD_JaxModel`` on JAX), one step trained."""
    import keras

    import lipdp

    keras.utils.set_random_seed(0)
    network = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
         keras.layers.Dense(CLASSES)]
    )  # fmt: skip
    model = lipdp.make_private(
        network, method="clipped", epsilon=3.0, delta=SPEC["delta"], epochs=2,
        batch_size=SPEC["b"], dataset_size=SPEC["n"], sampling="shuffle",
    )  # fmt: skip
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    model.train_on_batch(*data())
    return model


def data(seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(SPEC["b"], FEATURES).astype("float32")
    y = np.eye(CLASSES, dtype="float32")[rng.randint(0, CLASSES, SPEC["b"])]
    return x, y


def state(model, prefix) -> dict:
    """What a model holds, as numpy: every layer weight by its path, the ledger's table
    (float64) and counts, the step count, epsilon of the ledger, the configuration."""
    from lipdp.accounting import get_accountant

    out = {
        f"{prefix}/w/{layer.name}/{w.name}": np.asarray(w.numpy())
        for layer in model.layers
        for w in layer.weights
    }
    out[f"{prefix}/table"] = np.asarray(model.privacy_ledger.table.numpy(), np.float64)
    out[f"{prefix}/counts"] = np.asarray(model.privacy_ledger.counts.numpy(), np.int64)
    out[f"{prefix}/steps"] = np.int64(model.noisy_steps.numpy())
    terms = model.privacy_ledger.terms()
    out[f"{prefix}/epsilon"] = np.float64(get_accountant("rdp").epsilon(terms, SPEC["delta"]))
    config = model.get_config()
    out[f"{prefix}/config"] = json.dumps(
        [config["dp_parameters"], config["dataset_metadata"]], sort_keys=True
    )
    return out


def main(directory):
    import keras

    import lipdp.clipless.losses  # noqa: F401 (registers the loss of the files)
    import lipdp.clipless.model  # noqa: F401

    spec = json.load(open(f"{directory}/spec.json"))
    x, y = data()
    out = {}
    for strategy in spec["strategies"]:
        model = build(strategy)
        for _ in range(SPEC["steps"]):
            model.train_on_batch(x, y)
        model.save(f"{directory}/tf_{strategy}.keras")
        out.update(state(model, f"tf_{strategy}"))
        loaded = keras.models.load_model(f"{directory}/jax_{strategy}.keras")
        out.update(state(loaded, f"from_jax_{strategy}"))
        loaded.train_on_batch(x, y)
        out.update(state(loaded, f"from_jax_{strategy}_trained"))
    if spec.get("clipped"):  # the clipped family: each backend's file refused on the other
        import lipdp.clipped.model  # noqa: F401 (registers the clipped classes)

        build_clipped().save(f"{directory}/tf_clipped.keras")
        try:
            keras.models.load_model(f"{directory}/jax_clipped.keras")
            out["clipped_refusal"] = "loaded"
        except ValueError as error:
            out["clipped_refusal"] = str(error)
    np.savez(f"{directory}/tf.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1])
