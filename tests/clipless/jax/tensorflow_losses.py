"""The TensorFlow numbers of every clipless loss on :mod:`tests.clipless.jax.loss_cases`,
computed in a subprocess run under ``KERAS_BACKEND=tensorflow``
(``python -m tests.clipless.jax.tensorflow_losses out.npz``): per-row losses and the
gradient of their sum with respect to the logits (row ``i``'s part is the gradient of its
own loss: rows are independent), and the loss with sample weights."""

import sys

import numpy as np


def main(target):
    import tensorflow as tf

    from lipdp.clipless import losses
    from tests.clipless.jax.loss_cases import LOSS_CASES, inputs

    out = {}
    weights = np.linspace(0.0, 1.0, 24).astype(np.float32)
    for tag, name, kwargs in LOSS_CASES:
        rows = getattr(losses, name)(reduction="none", **kwargs)
        for case, (y, z) in inputs().items():
            z = tf.constant(z)
            with tf.GradientTape() as tape:
                tape.watch(z)
                values = rows(tf.constant(y), z)
                total = tf.reduce_sum(values)
            out[f"{tag}/{case}/rows"] = values.numpy()
            out[f"{tag}/{case}/grad"] = tape.gradient(total, z).numpy()
        y, z = inputs()["random"]
        mean = getattr(losses, name)(**kwargs)
        out[f"{tag}/weighted"] = mean(y, z, sample_weight=weights).numpy()
    np.savez(target, **out)


if __name__ == "__main__":
    main(sys.argv[1])
