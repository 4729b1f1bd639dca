"""Validation of configuration values, shared by the linear solvers and the bilevel solvers.

Each check raises ``ValueError``/``TypeError`` naming the owner and the field, so that a bad
configuration fails at construction time rather than deep inside a training loop.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


def check_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    """``value`` must be an integer (not a bool) with ``value >= minimum``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}")


def check_positive(owner: str, name: str, value: object) -> None:
    """``value`` must be a finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    if not (math.isfinite(value) and float(value) > 0):
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value}")


def check_nonnegative(owner: str, name: str, value: object) -> None:
    """``value`` must be a finite real number >= 0."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    if not (math.isfinite(value) and float(value) >= 0):
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value}")
