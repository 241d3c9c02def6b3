"""TensorFlow's numbers for the JAX layer tests, computed in a subprocess under
``KERAS_BACKEND=tensorflow`` (``python -m tests.clipless.jax.layers_tensorflow_side in.npz
out.npz``):

* ``chains``: for each chain of :mod:`tests.clipless.jax.layer_cases`, given its weights, a
  batch ``x`` and a cotangent ``g``: the output and the vector-Jacobian products with
  respect to ``x`` and every trainable weight (``GradientTape``);
* ``catalogue``: for each case of ``tests/cases.py`` (LAYER_CASES, COMPOSITION_CASES), the
  built model's weights and the bound pass's sensitivities (forward order)."""

import json
import sys

import numpy as np


def chains(given, names):
    import tensorflow as tf

    from tests.clipless.jax import layer_cases

    out = {}
    for name in names:
        x = tf.constant(given[f"{name}/x"])
        model = layer_cases.build(name, x)
        for index, variable in enumerate(model.weights):
            variable.assign(given[f"{name}/w{index}"])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)
        grads = tape.gradient(
            y, [x, *model.trainable_variables], output_gradients=tf.constant(given[f"{name}/g"])
        )
        out[f"{name}/y"] = y.numpy()
        for index, grad in enumerate(grads):
            out[f"{name}/vjp{index}"] = grad.numpy()
    return out


def catalogue(names):
    from tests import cases

    out = {}
    for name in names:
        model, x, _ = cases.ALL_CASES[name]()
        model(x[:1])
        dp_weights = [v for layer in model.dp_layers for v in layer.weights]
        for index, variable in enumerate(dp_weights):  # the DP layers' (no ledger)
            out[f"{name}/w{index}"] = np.asarray(variable)
        deltas = [float(delta) for _, delta in model.sensitivities()]
        out[f"{name}/deltas"] = np.asarray(deltas, dtype=np.float64)
    return out


def main(source, target):
    given = np.load(source)
    spec = json.loads(str(given["spec"]))
    out = chains(given, spec.get("chains", []))
    out.update(catalogue(spec.get("catalogue", [])))
    np.savez(target, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
