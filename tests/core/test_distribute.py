"""Training under tf.distribute (lipdp.core.distribute): the same step as on one device, the
noise of one step drawn once, the same epsilon -- MirroredStrategy over two logical CPU
devices (split in conftest.py) and MultiWorkerMirroredStrategy with two processes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from lipdp.accounting import get_eps_delta
from lipdp.clipped.model import SharpnessAscent
from lipdp.core import noise
from lipdp.core.adversarial import PGD
from lipdp.core.callbacks import DP_Accountant
from lipdp.core.distribute import mirrored_strategy
from lipdp.foundation import compat
from lipdp.pipeline import distributed_poisson_batches, poisson_batches
from tests import distribute_helpers as h

ROOT = Path(__file__).resolve().parents[2]


def mirrored():
    """The process's one MirroredStrategy over the two logical CPU devices (a second
    strategy would fail in TensorFlow itself: lipdp.core.distribute.mirrored_strategy)."""
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    assert len(devices) == 2, "conftest.py splits the CPU into two logical devices"
    return mirrored_strategy(devices)


def _fit(model, x, y, pipeline, strategy):
    """Two steps of a noiseless run: fixed batches of 32 in order, Poisson at rate 1/2
    (seeded), or Poisson at rate 1 (every record in every batch, one step per epoch)
    through the global or the partitioned pipeline."""
    if pipeline.startswith("arrays"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    elif pipeline == "poisson":
        model.fit(poisson_batches(x, y, 1.0, 1), epochs=2, verbose=0)
    elif pipeline == "poisson-random-sizes":  # the same seeded draws for both runs
        model.fit(poisson_batches(x, y, 0.5, 2, seed=11), epochs=1, verbose=0)
    else:
        model.fit(distributed_poisson_batches(strategy, x, y, 1.0, 1), epochs=2, verbose=0)


def _noiseless_cases():
    """Every pipeline runs by default in DP-SGD; the clipless family keeps arrays with
    adversarial training (its clean and adversarial losses, mix = 0.5) and the partitioned
    Poisson pipeline by default; its plain arrays and global Poisson pipelines (4-9 s
    each, pipelines DP-SGD's default cases cover) run in make test-slow."""
    cases = []
    for family in h.FAMILIES:
        for pipeline in ["arrays", "arrays-adversarial", "poisson", "poisson-random-sizes"]:
            slow = family == "clipless" and pipeline != "arrays-adversarial"
            marks = [pytest.mark.slow] if slow else []
            cases.append(pytest.param(family, pipeline, marks=marks, id=f"{family}-{pipeline}"))
        cases.append(
            pytest.param(family, "partitioned", marks=pytest.mark.smoke, id=f"{family}-partitioned")
        )
    return cases


def _trained_pair(family, pipeline, batch, sampling, **replicated_options):
    """The same noiseless network (seeded initial weights, PGD with mix 0.5 for the
    adversarial pipeline) trained by :func:`_fit` on one device and under two replicas
    (with ``replicated_options`` too): ``(weights before, single, replicated)``."""
    x, y = h.data()
    options = {}
    if pipeline == "arrays-adversarial":
        options["adversarial"] = PGD(0.2, steps=3, random_start=False, mix=0.5)
    tf.keras.utils.set_random_seed(3)
    single = h.build(family, 0.0, batch, sampling, **options)
    initial = single.get_weights()
    before = h.flat_weights(single)
    strategy = mirrored()
    with strategy.scope():
        replicated = h.build(family, 0.0, batch, sampling, **options, **replicated_options)
    replicated.set_weights(initial)
    _fit(single, x, y, pipeline, tf.distribute.get_strategy())
    _fit(replicated, x, y, pipeline, strategy)
    return before, single, replicated


@pytest.mark.parametrize("family, pipeline", _noiseless_cases())
def test_noiseless_mirrored_steps_equal_single_device_steps(family, pipeline):
    """Same initial weights, same global batches, no noise: two replicas and one device
    reach the same weights (the replicas' losses are scaled for the global batch, summed
    once, and projected identically), also with adversarial training (its own loss)."""
    batch, sampling = (32, "shuffle") if pipeline.startswith("arrays") else (h.N, "poisson")
    if pipeline == "poisson-random-sizes":  # global batches of random size, split by Keras
        batch = 32
    before, single, replicated = _trained_pair(family, pipeline, batch, sampling)
    after = h.flat_weights(single)
    assert np.abs(after - before).max() > 1e-3  # the steps moved the weights (2e-6 below)
    np.testing.assert_allclose(h.flat_weights(replicated), after, atol=2e-6)
    assert int(replicated.noisy_steps.numpy()) == int(single.noisy_steps.numpy()) == 2


@pytest.mark.parametrize("family", h.FAMILIES)
@pytest.mark.parametrize("pipeline", ["poisson-random-sizes", "arrays-adversarial"])
def test_micro_batches_on_replicas_equal_whole_batches_on_one_device(family, pipeline):
    """``physical_batch_size=5`` under two replicas (each splits its own rows into
    micro-batches, the noise once globally): the weights of whole batches on one device,
    also for adversarial training (the micro-batches' adversarial rows as loss inputs)."""
    sampling = "shuffle" if pipeline.startswith("arrays") else "poisson"
    before, single, replicated = _trained_pair(
        family, pipeline, 32, sampling, physical_batch_size=5
    )
    assert np.abs(h.flat_weights(single) - before).max() > 1e-3
    np.testing.assert_allclose(h.flat_weights(replicated), h.flat_weights(single), atol=2e-6)
    assert int(replicated.noisy_steps.numpy()) == int(single.noisy_steps.numpy())


class _FixedNoise:
    """Stands for the noise generator: every draw is the same known vector ``Z`` (its
    standard deviation times a fixed pattern), so two runs add the same noise."""

    def normal(self, shape, stddev, dtype):
        pattern = tf.sin(tf.cast(tf.range(tf.reduce_prod(shape)), dtype) + 1.0)
        return stddev * tf.reshape(pattern, shape)


@pytest.mark.parametrize("family", h.FAMILIES)
def test_released_update_is_the_single_device_update_with_the_same_noise(family, monkeypatch):
    """The same noise ``Z`` drawn by both runs (a fixed draw): two replicas release
    ``sum_r g_r + Z``, the single device ``g + Z`` -- not ``R Z`` (each replica adding
    it), not the mean of the replicas' gradients."""
    monkeypatch.setattr(noise, "noise_generator", _FixedNoise)
    x, y = h.data()
    tf.keras.utils.set_random_seed(3)
    single = h.build(family, 1.0, 32)
    initial = single.get_weights()
    strategy = mirrored()
    with strategy.scope():
        replicated = h.build(family, 1.0, 32)
    replicated.set_weights(initial)
    for model in (single, replicated):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    tf.keras.utils.set_random_seed(3)
    noiseless = h.build(family, 0.0, 32)
    noiseless.set_weights(initial)
    noiseless.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    after = h.flat_weights(single)
    assert np.abs(after - h.flat_weights(noiseless)).max() > 1e-3  # the noise moved them
    np.testing.assert_allclose(h.flat_weights(replicated), after, atol=2e-6)


@pytest.mark.smoke
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("family", h.FAMILIES)
def test_released_noise_has_the_standard_deviation_of_one_step(family, replicas):
    """Zero inputs make every gradient 0: what the optimizer receives is the aggregated
    noise, whose standard deviation must be sigma x Delta (2 replicas adding their own
    noise would give sqrt(2) times more)."""
    zeros, y = h.data(zero_inputs=True)
    strategy = mirrored() if replicas == 2 else tf.distribute.get_strategy()
    recorder = h.RecordingSGD()
    with strategy.scope():
        model = h.build(family, 1.0, 32, optimizer=recorder)
        recorder.start(model.trainable_variables)
    # 16 steps: >= 4 608 noise coordinates (DP-SGD's model), the standard deviation's
    # relative standard error <= 1.1 %, a fifth of the tolerance below.
    model.fit(zeros, y, batch_size=32, epochs=8, verbose=0)
    mean, std = recorder.noise_statistics()
    expected = h.expected_stddev(model)
    samples = 16 * sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert float(recorder.steps.numpy()) == 16
    assert abs(std / expected - 1.0) < 0.05
    assert abs(mean) < 5 * expected / np.sqrt(samples)


@pytest.mark.parametrize("family", h.FAMILIES)
def test_replicas_stay_identical_and_epsilon_counts_global_steps(family):
    """Noisy training on two replicas: every copy of every weight is the same (one noise,
    one update, one projection) and epsilon is the one of a single device after the same
    number of global steps."""
    x, y = h.data()
    strategy = mirrored()
    with strategy.scope():
        model = h.build(family, 1.0, 32)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[DP_Accountant()])
    for variable in model.trainable_variables:
        copies = h.replica_copies(strategy, variable)
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1])
    assert int(model.noisy_steps.numpy()) == 3 * (h.N // 32)
    single = h.build(family, 1.0, 32)
    for epoch, epsilon in enumerate(history.history["epsilon"], start=1):
        assert epsilon == get_eps_delta(single, epoch)[0]


@pytest.mark.parametrize("family", h.FAMILIES)
def test_fit_on_arrays_of_a_poisson_model_samples_them_under_mirrored(family):
    """fit(x, y, batch_size=b) of a Poisson model under MirroredStrategy: the arrays are
    Poisson-sampled by fit (batches of random size split between the replicas), the copies
    stay identical, and epsilon is the plan's after the metadata's steps per epoch."""
    x, y = h.data()
    strategy = mirrored()
    with strategy.scope():
        model = h.build(family, 1.0, 16, sampling="poisson")
    plan = model.privacy_plan()
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[DP_Accountant()])
    for variable in model.trainable_variables:
        copies = h.replica_copies(strategy, variable)
        np.testing.assert_array_equal(copies[0], copies[1])
    assert int(model.noisy_steps.numpy()) == 2 * (h.N // 16)
    assert history.history["epsilon"] == [plan.epsilon(1), plan.epsilon(2)]


def test_uneven_batches_and_dp_sat_are_refused_with_the_fix():
    x, y = h.data()
    strategy = mirrored()
    with strategy.scope():
        odd = h.build("dp-sgd", 1.0, 1)
    with pytest.raises(ValueError, match="divisible by 2"):  # at the first step's trace
        odd.fit(x, y, batch_size=1, epochs=1, verbose=0)
    with strategy.scope():
        sat = h.build("dp-sgd", 1.0, 32, ascent=SharpnessAscent("dp-sat", 0.01))
    with pytest.raises(ValueError, match="DP-SAT .* not supported under a distribution"):
        sat.fit(x, y, batch_size=32, epochs=1, verbose=0)


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("clipless", marks=pytest.mark.smoke),
        pytest.param("dp-sgd", marks=pytest.mark.slow),
    ],
)  # ~30 s each: two TensorFlow processes
def test_two_workers_match_one_device_and_draw_the_noise_once(family, tmp_path):
    """MultiWorkerMirroredStrategy, two processes on localhost (bounded in time): arrays
    are refused, the noiseless steps equal a single device's on the same global batches,
    the aggregated noise has standard deviation sigma x Delta, steps are global and
    epsilon is a single device's."""
    ports = ",".join(str(p) for p in _free_ports(2))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    outputs = [tmp_path / f"worker{i}.json" for i in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.distribute_worker", str(i), ports, family, str(out)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for i, out in enumerate(outputs)
    ]
    try:
        errors = [w.communicate(timeout=300)[1].decode()[-3000:] for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert all(w.returncode == 0 for w in workers), errors
    results = [json.loads(out.read_text()) for out in outputs]

    x, y = h.data()
    single = h.build(family, 0.0, h.N, sampling="poisson")
    single.set_weights([np.array(w) for w in results[0]["initial"]])
    single.fit(poisson_batches(x, y, 1.0, 1), epochs=2, verbose=0)
    private = h.build(family, 1.0, 32, sampling="poisson")
    epsilons = [get_eps_delta(private, epoch)[0] for epoch in range(1, 17)]
    for result in results:
        assert result["replicas"] == 2
        assert "several workers" in result["arrays_refused"]
        assert result["initial"] == results[0]["initial"]
        np.testing.assert_allclose(result["noiseless"], h.flat_weights(single), atol=2e-6)
        assert result["noiseless_steps"] == 2 and result["private_steps"] == 32
        assert abs(result["noise_std"] / result["expected_std"] - 1.0) < 0.05
        assert result["epsilons"] == epsilons  # a single device's after the same steps


@pytest.mark.parametrize("kind", ["laplace", "quantile"])
def test_dynamic_clipping_under_mirrored_updates_every_copy_once(kind):
    """One process: the callback releases one clip value per update (counted by the plan)
    and writes it to every replica's copy of the threshold."""
    from lipdp.clipless.dynamic import AdaptiveQuantileClipping, LaplaceAdaptiveLossGradientClipping
    from tests.clipless.test_dynamic import datasets, make_data, make_model

    train, full = datasets(*make_data())
    if kind == "laplace":
        callback = LaplaceAdaptiveLossGradientClipping(full, patience=1, epsilon=2.0, seed=0)
    else:
        callback = AdaptiveQuantileClipping(
            full, noise_multiplier=1.0, quantile=0.5, learning_rate=0.5, seed=1
        )
    strategy = mirrored()
    with strategy.scope():
        model = make_model(dynamic=callback)
    history = model.fit(train, epochs=3, verbose=0, callbacks=[callback])
    copies = h.replica_copies(strategy, model.dp_layers[-1].clip_value)
    assert len(copies) == 2 and float(copies[0]) == float(copies[1])
    assert float(copies[0]) == pytest.approx(history.history["clip_value"][-1])
    assert float(copies[0]) != 1.0  # updated from the initial clip value
    assert model.privacy_plan().releases[1].count(3) == callback.releases >= 1


def _step_paths():
    """Every way into the compiled private step besides fit's distributed dataset, with the
    sampling it runs under (issue 37: Keras 3's train_on_batch handed each replica the
    whole batch, so every record counted twice)."""
    paths = [
        ("train_on_batch-poisson", "poisson"),
        ("train_on_batch-fixed", "shuffle"),
        ("strategy.run-train_step", "poisson"),
    ]
    if compat.keras_3():  # Keras 2's train_function takes its own data handler's iterator
        paths += [("train_function-arrays", "poisson"), ("train_function-tf.data", "poisson")]
    else:  # Keras 3 refuses steps_per_execution > 1 under a strategy (below)
        paths.append(("fit-steps_per_execution", "shuffle"))
    cases = []
    for family in h.FAMILIES:
        for path, sampling in paths:
            default = path.startswith("train_on_batch-poisson") or (
                family == "dp-sgd" and path == "strategy.run-train_step"
            )
            marks = [] if default else [pytest.mark.thorough]
            cases.append(pytest.param(family, path, sampling, marks=marks, id=f"{family}-{path}"))
    return cases


def _run_path(model, path, x, y, strategy):
    if path.startswith("train_on_batch"):
        model.train_on_batch(x, y)
    elif path == "fit-steps_per_execution":
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    elif path == "strategy.run-train_step":  # a custom loop on an undistributed batch

        @tf.function
        def step(batch):
            return strategy.run(model.train_step, args=(batch,))

        model.optimizer.build(model.trainable_variables)
        step((tf.constant(x), tf.constant(y)))
    else:
        model.make_train_function()
        if path == "train_function-arrays":
            model.train_function(iter([(x, y)]))
        else:
            model.train_function(iter(tf.data.Dataset.from_tensors((x, y))))


@pytest.mark.parametrize("family, path, sampling", _step_paths())
def test_every_path_into_the_step_counts_each_record_once_under_mirrored(family, path, sampling):
    """No noise, SGD(1), the same initial weights: one step on two replicas moves the
    weights exactly as one step on one device, whatever the path into the step -- not
    twice as far (every replica holding every row). Poisson batches of 21 rows split 11/10;
    fixed batches of 32 rows 16/16."""
    x, y = h.data()
    rows = 64 if path == "fit-steps_per_execution" else (21 if sampling == "poisson" else 32)
    x, y = x[:rows], y[:rows]
    options = {"steps_per_execution": 2} if path == "fit-steps_per_execution" else {}
    tf.keras.utils.set_random_seed(3)
    single = h.build(family, 0.0, 32, sampling, optimizer=tf.keras.optimizers.SGD(1.0), **options)
    initial = single.get_weights()
    before = h.flat_weights(single)
    strategy = mirrored()
    with strategy.scope():
        replicated = h.build(
            family, 0.0, 32, sampling, optimizer=tf.keras.optimizers.SGD(1.0), **options
        )
    replicated.set_weights(initial)
    _run_path(single, path, x, y, tf.distribute.get_strategy())
    _run_path(replicated, path, x, y, strategy)
    moved = h.flat_weights(single) - before
    assert np.abs(moved).max() > 1e-3
    ratio = np.linalg.norm(h.flat_weights(replicated) - before) / np.linalg.norm(moved)
    assert ratio == pytest.approx(1.0, abs=1e-5), f"the replicas moved the weights {ratio:.4f}x"
    np.testing.assert_allclose(h.flat_weights(replicated), h.flat_weights(single), atol=2e-6)
    assert int(replicated.noisy_steps.numpy()) == int(single.noisy_steps.numpy())


@pytest.mark.parametrize("rows", [0, 1, 3])
def test_train_on_batch_under_mirrored_takes_batches_smaller_than_the_replicas(rows):
    """Poisson batches may be empty or hold fewer rows than replicas: some parts are empty."""
    x, y = h.data()
    tf.keras.utils.set_random_seed(3)
    single = h.build("dp-sgd", 0.0, 32, "poisson", optimizer=tf.keras.optimizers.SGD(1.0))
    initial = single.get_weights()
    strategy = mirrored()
    with strategy.scope():
        replicated = h.build("dp-sgd", 0.0, 32, "poisson", optimizer=tf.keras.optimizers.SGD(1.0))
    replicated.set_weights(initial)
    single.train_on_batch(x[:rows], y[:rows])
    replicated.train_on_batch(x[:rows], y[:rows])
    np.testing.assert_allclose(h.flat_weights(replicated), h.flat_weights(single), atol=2e-6)


@pytest.mark.skipif(not compat.keras_3(), reason="Keras 2 runs steps_per_execution > 1 there")
def test_steps_per_execution_under_a_strategy_is_refused_on_keras_3():
    """Keras 3.15's loop over several steps fails under MirroredStrategy (plain models too):
    refused in one line before any step."""
    x, y = h.data()
    with mirrored().scope():
        model = h.build("dp-sgd", 1.0, 32, steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert int(model.noisy_steps.numpy()) == 0
