"""The shared type checks: numpy and Python scalars alike, a bool never a number."""

import math

import numpy as np
import pytest

from ringpack._checks import is_bool, is_finite, is_int, is_real


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int8(4), np.uint64(7)])
def test_integers_of_python_and_numpy_are_ints(value):
    assert is_int(value) and is_real(value) and is_finite(value) and not is_bool(value)


@pytest.mark.parametrize("value", [True, False, np.True_, np.False_])
def test_a_bool_is_no_number(value):
    assert is_bool(value)
    assert not (is_int(value) or is_real(value) or is_finite(value))


@pytest.mark.parametrize("value", [1.5, np.float32(2.0), math.inf, -math.inf, math.nan, np.float64("nan")])
def test_reals_are_real_and_finite_only_when_finite(value):
    assert is_real(value) and not is_int(value)
    assert is_finite(value) == math.isfinite(value)


@pytest.mark.parametrize("value", [None, "3", b"3", [3], 3 + 0j, np.array([3])])
def test_other_values_are_neither(value):
    assert not (is_int(value) or is_real(value) or is_finite(value) or is_bool(value))
