"""One worker of the multi-worker tests of tests/core/test_distribute.py (run as a process).

``python -m tests.distribute_worker INDEX PORT0,PORT1 FAMILY OUT.json``: joins a
two-worker ``MultiWorkerMirroredStrategy`` on localhost (``TF_CONFIG``), then

1. checks that ``fit`` refuses arrays (each worker would draw its own batches);
2. trains the noiseless model two steps on the partitioned Poisson pipeline at rate 1
   (every record every step, so the global batch is the whole data set);
3. trains the private model on all-zero inputs with a recording optimizer and the
   accountant callback;

and writes the initial and final weights, the recorded noise statistics, the expected
standard deviation, the step counts and the epsilons per epoch to ``OUT.json``.
"""

import json
import os
import sys


def main(index, ports, family, out):
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port}" for port in ports.split(",")]},
            "task": {"type": "worker", "index": int(index)},
        }
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from lipdp.core.callbacks import DP_Accountant
    from lipdp.pipeline import distributed_poisson_batches
    from tests import distribute_helpers as h

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result = {"replicas": strategy.num_replicas_in_sync}
    x, y = h.data()

    tf.keras.utils.set_random_seed(1234)
    with strategy.scope():
        model = h.build(family, 0.0, h.N, sampling="poisson")
    try:
        model.fit(x, y, batch_size=h.N, epochs=1, verbose=0)
        result["arrays_refused"] = ""
    except ValueError as error:
        result["arrays_refused"] = str(error)
    result["initial"] = [w.tolist() for w in model.get_weights()]
    model.fit(distributed_poisson_batches(strategy, x, y, 1.0, 1), epochs=2, verbose=0)
    result["noiseless"] = h.flat_weights(model).tolist()
    result["noiseless_steps"] = int(model.noisy_steps.numpy())

    zeros, _ = h.data(zero_inputs=True)
    recorder = h.RecordingSGD()
    with strategy.scope():
        private = h.build(family, 1.0, 32, sampling="poisson", optimizer=recorder)
        recorder.start(private.trainable_variables)
    history = private.fit(
        distributed_poisson_batches(strategy, zeros, y, 0.5, 2),
        epochs=16,
        verbose=0,
        callbacks=[DP_Accountant()],
    )
    result["epsilons"] = history.history["epsilon"]
    result["noise_mean"], result["noise_std"] = recorder.noise_statistics()
    result["expected_std"] = h.expected_stddev(private)
    result["private_steps"] = int(private.noisy_steps.numpy())
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
