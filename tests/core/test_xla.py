"""Every training step compiles with XLA (``compile(jit_compile=True)``) and gives the
result of the default step: noiseless runs from the same weights on the same batches."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.clipped.model import SharpnessAscent
from lipdp.core.adversarial import PGD
from lipdp.pipeline import poisson_batches
from tests import distribute_helpers as h

CASES = {
    "clipless": ("clipless", "shuffle", {}),
    "clipless-poisson": ("clipless", "poisson", {}),
    "clipless-adversarial": (
        "clipless",
        "shuffle",
        {"adversarial": PGD(0.1, steps=3, random_start=False, mix=0.5)},
    ),
    "dp-sgd-ghost": ("dp-sgd", "shuffle", {}),
    "dp-sgd-poisson": ("dp-sgd", "poisson", {}),
    "dp-sgd-jacobian": ("dp-sgd", "shuffle", {"gradient_method": "jacobian"}),
    "dp-sgd-bam": ("dp-sgd", "shuffle", {"ascent": SharpnessAscent("bam", 0.05)}),
    "dp-sgd-dp-sat": ("dp-sgd", "shuffle", {"ascent": SharpnessAscent("dp-sat", 0.05)}),
    "dp-sgd-adversarial": (
        "dp-sgd",
        "shuffle",
        {"adversarial": PGD(0.1, steps=3, random_start=False, mix=0.5)},
    ),
}


def _train(family, sampling, options, jit_compile):
    tf.keras.utils.set_random_seed(5)
    model = h.build(family, 0.0, 32, sampling, jit_compile=jit_compile, **options)
    x, y = h.data()
    if sampling == "poisson":  # random batch sizes, the same draws for both runs
        model.fit(poisson_batches(x, y, 0.5, 2, seed=11), epochs=2, verbose=0)
    else:
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    return model


#: In the default run; the other steps (seconds of XLA compilation each) are marked slow.
DEFAULT_CASES = ("clipless", "dp-sgd-ghost")


@pytest.mark.parametrize(
    "case",
    [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)],
)
def test_xla_step_gives_the_default_result(case):
    family, sampling, options = CASES[case]
    default = _train(family, sampling, options, jit_compile=False)
    compiled = _train(family, sampling, options, jit_compile=True)
    assert compiled.jit_compile is True
    tf.keras.utils.set_random_seed(5)
    initial = h.flat_weights(h.build(family, 0.0, 32, sampling, **options))
    trained = h.flat_weights(default)
    assert np.abs(trained - initial).max() > 1e-2  # the steps moved the weights
    np.testing.assert_allclose(h.flat_weights(compiled), trained, atol=1e-5)
    assert int(compiled.noisy_steps.numpy()) == 4


@pytest.mark.parametrize("family", h.FAMILIES)
def test_xla_fixed_size_steps_check_the_rows_on_the_host(family):
    """XLA drops the step's in-graph check of the batch size (rule S5: fixed-size batches
    of exactly b rows): a batch of 20 rows for b = 32 trained before; it is refused on the
    host, as is a pipeline whose batches may be partial."""
    model = h.build(family, 1.0, 32, "shuffle", jit_compile=True)
    x, y = h.data()
    with pytest.raises(ValueError, match="exactly 32 rows"):
        model.train_on_batch(x[:20], y[:20])
    assert int(model.noisy_steps.numpy()) == 0
    partial = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with pytest.raises(ValueError, match="drop_remainder=True"):
        model.fit(partial, epochs=1, verbose=0)
    model.train_on_batch(x[:32], y[:32])
    assert int(model.noisy_steps.numpy()) == 1


@pytest.mark.parametrize("family", h.FAMILIES)
def test_mixed_precision_is_refused_by_both_families(family):
    """Accelerator readiness, the other half: float16 round-off exceeds the slack of the
    bounds, so a mixed_float16 policy is refused when compiling, with the fix."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="set_global_policy\\('float32'\\)"):
            h.build(family, 1.0, 32)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
