"""The TensorFlow ``DP_Sequential`` numbers the JAX ``DP_Sequential`` is compared with,
computed in a subprocess under ``KERAS_BACKEND=tensorflow``
(``python -m tests.clipless.jax.tensorflow_model_side in.npz out.npz``): the same layers and
kernels, the sensitivities, the noise standard deviations of the one noise rule, and the
epsilon of the ledger after ``steps`` real ``train_on_batch`` steps (same accountant)."""

import json
import sys

import numpy as np


def main(source, target):
    import keras

    from lipdp.accounting import get_accountant
    from lipdp.clipless import layers as L
    from lipdp.clipless import losses
    from lipdp.clipless.model import DP_Sequential, DPParameters, compute_gradient_bounds
    from lipdp.foundation.metadata import DatasetMetadata
    from lipdp.foundation.variables import variable_key

    given = np.load(source)
    spec = json.loads(str(given["spec"]))
    x, y = given["x"], given["y"]
    metadata = DatasetMetadata(
        input_shape=x.shape[1:], nb_classes=y.shape[1], nb_samples_train=spec["n"],
        batch_size=spec["b"], sampling="shuffle",
    )  # fmt: skip

    def make(parameters, optimizer):
        model = DP_Sequential(
            [
                L.DP_BoundedInput(input_shape=x.shape[1:], upper_bound=spec["bound"], name="input"),
                L.DP_SpectralDense(
                    spec["hidden"],
                    weight_norm_bound=spec["radius"],
                    nm_coef=spec["coef"],
                    name="d1",
                ),  # fmt: skip
                L.DP_GroupSort(2, name="sort"),
                L.DP_SpectralDense(y.shape[1], name="d2"),
                *([L.DP_ClipGradient(spec["clip"], name="clip")] if spec["clip"] else []),
            ],
            dp_parameters=parameters,
            dataset_metadata=metadata,
        )
        model.compile(
            loss=losses.DP_TauCategoricalCrossentropy(tau=spec["tau"]), optimizer=optimizer
        )
        for name in ("d1", "d2"):  # the JAX model's kernels and power vectors
            model.get_layer(name).kernel.assign(given[name])
            model.get_layer(name).power_vector.assign(given[f"u_{name}"])
        return model

    # Noiseless steps (SGD with momentum, projections): the weights after them.
    reference = make(
        DPParameters(spec["strategy"], 0.0, spec["delta"], non_private=True),
        keras.optimizers.SGD(0.1, momentum=0.9),
    )
    for _ in range(spec["steps"]):
        reference.train_on_batch(x, y)
    model = make(
        DPParameters(spec["strategy"], spec["sigma"], spec["delta"]), keras.optimizers.SGD(0.1)
    )
    bounds = compute_gradient_bounds(model)
    stddevs = model.noise_stddevs()
    out = {f"after_{name}": reference.get_layer(name).kernel.numpy() for name in ("d1", "d2")}
    for name in ("d1", "d2"):
        out[f"delta_{name}"] = np.float64(bounds[f"{name}/kernel"])
        out[f"stddev_{name}"] = np.float64(stddevs[variable_key(model.get_layer(name).kernel)])
    for _ in range(spec["steps"]):
        model.train_on_batch(x, y)
    terms = model.privacy_ledger.terms()
    out["epsilon"] = np.float64(get_accountant("rdp").epsilon(terms, spec["delta"]))
    out["steps"] = np.int64(model.noisy_steps.numpy())
    np.savez(target, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
