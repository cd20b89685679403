"""The small type checks every layer's argument validation shares (docs/plan.md, "Errors").

Each answers one question about a value and never raises; the caller words the error, naming the
argument. Python and numpy scalars count alike, and a ``bool`` (Python or numpy) is never a number:
``True`` passed for a size, a seed or a price is a mistake to refuse, not the integer 1.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import numpy as np

__all__ = ["is_bool", "is_finite", "is_int", "is_real"]


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A real number (Python or numpy; NaN and infinities included), not a bool."""
    return isinstance(value, Real) and not isinstance(value, (bool, np.bool_))


def is_finite(value: Any) -> bool:
    """A finite real number (Python or numpy), not a bool."""
    return is_real(value) and math.isfinite(value)


def is_bool(value: Any) -> bool:
    """``True`` or ``False`` (Python or numpy)."""
    return isinstance(value, (bool, np.bool_))
