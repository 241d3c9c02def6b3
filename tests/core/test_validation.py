"""lipdp.foundation.validation: the shared argument validators."""

import math

import numpy as np
import pytest

from lipdp.foundation import validation


def test_real_and_intervals():
    assert validation.real("x", 3) == 3.0 and isinstance(validation.real("x", 3), float)
    assert validation.real("x", np.float32(0.5), low=0.0, high=1.0) == 0.5
    assert validation.non_negative("x", 0) == 0.0
    assert validation.probability("q", 1.0) == 1.0
    for bad, call in [
        ("a", lambda v: validation.real("x", v)),
        (True, lambda v: validation.real("x", v)),
        (math.nan, lambda v: validation.real("x", v)),
        (math.inf, lambda v: validation.positive("x", v)),
        (0.0, lambda v: validation.positive("x", v)),
        (-1e-9, lambda v: validation.non_negative("x", v)),
        (0.0, lambda v: validation.probability("x", v)),
        (1.5, lambda v: validation.probability("x", v)),
        (1.0, lambda v: validation.open_unit("x", v)),
    ]:
        with pytest.raises(ValueError, match=r"^x must be"):
            call(bad)


def test_delta():
    assert validation.delta(1e-5) == 1e-5
    for bad in (0.0, 1.0, -1.0, "1e-5"):
        with pytest.raises(ValueError, match="open interval"):
            validation.delta(bad)


def test_count():
    assert validation.count("n", 3) == 3
    assert validation.count("n", 3.0) == 3
    assert validation.count("n", np.int64(4), minimum=1) == 4
    for bad in (-1, 2.5, True, "3", None):
        with pytest.raises(ValueError, match="n must be an integer >= 0"):
            validation.count("n", bad)


def test_choice_and_int_pair():
    assert validation.choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"mode must be one of \('a', 'b'\), got 'c'"):
        validation.choice("mode", "c", ("a", "b"))
    assert validation.int_pair("k", 3) == (3, 3)
    assert validation.int_pair("k", [2, 5]) == (2, 5)
    for bad in ((1, 2, 3), "ab", None, True):
        with pytest.raises(ValueError, match="k must be an int or a pair"):
            validation.int_pair("k", bad)
