"""lipdp.data.input_bounds: per-example norm bounds, exact even after float32 rounding."""

import numpy as np
import pytest
import tensorflow as tf

from lipdp.data.input_bounds import (
    ROUNDING_MARGIN,
    _parse_bound_fct,
    bound_clip_value,
    bound_normalize,
)
from tests.data_helpers import norms


def test_bound_functions(rng):
    x = tf.constant(rng.normal(size=(8, 3, 4)) * np.arange(8)[:, None, None], tf.float32)
    fn, bound = bound_clip_value(3.0)
    clipped = fn(x).numpy()
    before = norms(x)
    assert bound == 3.0 and norms(clipped).max() <= 3.0
    small = before <= 3.0
    np.testing.assert_array_equal(clipped[small], x.numpy()[small])
    np.testing.assert_allclose(norms(clipped)[~small], 3.0, rtol=1e-5)
    x_out, label = fn(x, "label")  # usable in a map over (x, y) batches
    assert label == "label" and np.array_equal(x_out, clipped)
    fn, bound = bound_normalize()
    out = norms(fn(x))  # the first example is 0
    assert bound == 1.0 and out[0] == 0.0 and np.all(out <= 1.0)
    np.testing.assert_allclose(out[1:], 1.0, rtol=1e-5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="value"):
            bound_clip_value(bad)


def test_clipping_direction_and_margin(rng):
    """Clipped examples keep their direction; their norm is ``c (1 - margin)``, in float64."""
    x = rng.normal(size=(64, 7)) * 10.0 ** rng.uniform(-3.0, 1.0, size=(64, 1))
    c = 1.0 / 3.0  # not a float32 number
    fn, _ = bound_clip_value(c)
    out = fn(tf.constant(x, tf.float64)).numpy()
    big = norms(x) > c
    assert big.sum() > 10 and (~big).sum() > 0
    expected = x[big] / norms(x[big])[:, None] * c * (1.0 - ROUNDING_MARGIN)
    np.testing.assert_allclose(out[big], expected, rtol=1e-12)
    np.testing.assert_array_equal(out[~big], x[~big])


def test_float32_rounding_never_exceeds_the_bound(rng):
    # Many scales and a bound that float32 cannot represent: the margin must absorb the
    # rounding of every coordinate (norms measured in float64 on the float32 output).
    scales = np.logspace(-3, 4, 4000)[:, None]
    x = tf.constant(rng.normal(size=(4000, 33)) * scales, tf.float32)
    for value in (0.1, 1.0 / 3.0, 7.3, 1e3):
        fn, bound = bound_clip_value(value)
        out = fn(x)
        assert out.dtype == tf.float32
        assert norms(out.numpy()).max() <= bound
    normalized = norms(bound_normalize()[0](x).numpy())
    assert normalized.max() <= 1.0 and normalized.min() >= 1.0 - 4 * ROUNDING_MARGIN


def test_bound_functions_need_a_batch():
    fn, _ = bound_clip_value(1.0)
    with pytest.raises(ValueError, match="rank"):
        fn(tf.constant(3.0))
    # rank 1: every entry is an example of dimension 0 (norm |x_i|)
    np.testing.assert_allclose(fn(tf.constant([0.5, -4.0])), [0.5, -(1.0 - ROUNDING_MARGIN)])


def test_bound_functions_map_over_batched_datasets():
    x = np.arange(24, dtype="float32").reshape(6, 4)
    y = np.arange(6, dtype="float32")
    fn, _ = bound_clip_value(5.0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(3).map(fn)
    xs = np.concatenate([b.numpy() for b, _ in ds])
    ys = np.concatenate([t.numpy() for _, t in ds])
    np.testing.assert_array_equal(ys, y)
    np.testing.assert_allclose(norms(xs), np.minimum(norms(x), 5.0 * (1 - ROUNDING_MARGIN)))


def test_parse_bound_fct():
    assert _parse_bound_fct(None) == (None, None)
    for number in (2, 2.5, np.float32(2.5), np.int64(3)):
        fn, bound = _parse_bound_fct(number)
        assert bound == float(number) and isinstance(bound, float)
        out = fn(tf.constant([[30.0, 40.0]]))  # norm 50: clipped to the number
        assert norms(out.numpy())[0] == pytest.approx(float(number), rel=1e-5)
    normalize, one = bound_normalize()
    assert _parse_bound_fct((normalize, 1)) == (normalize, 1.0)
    assert _parse_bound_fct([normalize, 2.0])[1] == 2.0
    for bad in (True, "1.0", (1.0, 2.0), (normalize,), object()):
        with pytest.raises(TypeError, match="bound_fct"):
            _parse_bound_fct(bad)
    for bad_bound in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="the bound of bound_fct"):
            _parse_bound_fct((normalize, bad_bound))
    with pytest.raises(ValueError, match="value"):
        _parse_bound_fct(-2.0)
