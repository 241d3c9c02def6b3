"""The TensorFlow numbers the JAX ``DP_Sequential`` step is compared with
(``tests/clipless/jax/test_trainer_step.py``), computed in a subprocess run under
``KERAS_BACKEND=tensorflow`` (``python -m tests.clipless.jax.tensorflow_step_side in.npz
out.npz``): the very TensorFlow ``DP_Sequential``, given the JAX model's kernels."""

import json
import sys

import numpy as np


def main(source, target):
    import tensorflow as tf

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
        batch_size=spec["b"],
    )  # fmt: skip
    model = DP_Sequential(
        [
            L.DP_BoundedInput(input_shape=x.shape[1:], upper_bound=spec["bound"], name="input"),
            L.DP_SpectralDense(spec["hidden"], name="d1"),
            L.DP_GroupSort(2, name="sort"),
            L.DP_SpectralDense(y.shape[1], name="d2"),
            *([L.DP_ClipGradient(spec["clip"], name="clip")] if spec["clip"] else []),
        ],
        dp_parameters=DPParameters(spec["strategy"], spec["sigma"], 1e-5),
        dataset_metadata=metadata,
    )
    loss = losses.DP_TauCategoricalCrossentropy(tau=spec["tau"])
    model.compile(loss=loss, optimizer=tf.keras.optimizers.SGD(0.1))
    model(x[:1])
    for name in ("d1", "d2"):  # the JAX kernels as they are (no projection on the way)
        model.get_layer(name).kernel.assign(given[name])
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        rows = losses.DP_TauCategoricalCrossentropy(tau=spec["tau"], reduction="none")(y, y_pred)
        total = tf.reduce_sum(rows) / float(spec["b"])
    grads = tape.gradient(total, model.trainable_variables)
    bounds = compute_gradient_bounds(model)
    stddevs = model.noise_stddevs()
    stddevs = {
        name: float(stddevs[variable_key(model.get_layer(name).kernel)]) for name in ("d1", "d2")
    }
    out = {"y_pred": y_pred.numpy(), "rows": rows.numpy()}
    for name, grad in zip(("d1", "d2"), grads):
        out[f"grad_{name}"] = grad.numpy()
        out[f"delta_{name}"] = np.float64(bounds[f"{name}/kernel"])
        out[f"stddev_{name}"] = np.float64(stddevs[name])
    np.savez(target, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
