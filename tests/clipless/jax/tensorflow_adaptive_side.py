"""The TensorFlow numbers of a norm-adaptive ``DP_Sequential`` (``adaptive_norm=True``), in a
subprocess under ``KERAS_BACKEND=tensorflow``
(``python -m tests.clipless.jax.tensorflow_adaptive_side in.npz out.npz``): the same layers
(:func:`layers`, shared with the JAX test) and kernels, each kernel's certified norm, the
sensitivities of its bound pass and the noise standard deviations of the TensorFlow graph
(float32 tensors)."""

import json
import sys

import numpy as np

FEATURES, CLASSES, BATCH, SAMPLES = 6, 4, 16, 64


def layers(L):
    """Two norm-adaptive kernels (spectral ball of radius 2, Frobenius ball of radius 1.5)
    around a GroupSort; ``L``: :mod:`lipdp.clipless.layers`."""
    return [
        L.DP_BoundedInput(input_shape=(FEATURES,), upper_bound=2.0, name="input"),
        L.DP_SpectralDense(
            8,
            constraint="spectral",
            weight_norm_bound=2.0,
            adaptive_norm=True,
            nm_coef=1.5,
            name="d1",
        ),  # fmt: skip
        L.DP_GroupSort(2, name="sort"),
        L.DP_QuickFrobeniusDense(
            CLASSES, constraint="frobenius", weight_norm_bound=1.5, adaptive_norm=True, name="d2"
        ),
    ]


def main(source, target):
    from lipdp.clipless import layers as L
    from lipdp.clipless import losses, projections
    from lipdp.clipless.model import DP_Sequential, DPParameters
    from lipdp.foundation.metadata import DatasetMetadata
    from lipdp.foundation.variables import variable_key

    given = np.load(source)
    spec = json.loads(str(given["spec"]))
    metadata = DatasetMetadata(
        input_shape=(FEATURES,), nb_classes=CLASSES, nb_samples_train=SAMPLES,
        batch_size=BATCH, sampling="shuffle",
    )  # fmt: skip
    model = DP_Sequential(
        layers(L),
        dp_parameters=DPParameters(spec["strategy"], spec["sigma"], 1e-5),
        dataset_metadata=metadata,
    )
    model.compile(loss=losses.DP_TauCategoricalCrossentropy(2.0), optimizer="sgd")
    out = {}
    for name, norm in (("d1", "spectral"), ("d2", "frobenius")):
        layer = model.get_layer(name)
        layer.kernel.assign(given[name])
        out[f"norm_{name}"] = projections.certified_operator_norm(
            layer.kernel_matrix(), norm
        ).numpy()
    stddevs = model.noise_stddevs()
    for entry, delta in model.sensitivities():
        name = entry.key.split("/")[0]
        out[f"delta_{name}"] = np.asarray(delta.numpy())
        out[f"stddev_{name}"] = np.asarray(stddevs[variable_key(entry.variable)].numpy())
    kernels = sorted(k for k in given.files if k.startswith("kernel_"))
    for norm in ("spectral", "frobenius"):  # the certificates of other kernels
        out[f"certificates_{norm}"] = np.asarray(
            [projections.certified_operator_norm(given[k], norm).numpy() for k in kernels]
        )
    np.savez(target, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
