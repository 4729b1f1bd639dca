"""The state a solver keeps between its steps (private).

The solvers are frozen dataclasses (hashable, comparable options); what must survive from
one ``step`` to the next — a warm start, an outer-step counter for a schedule — lives in a
small mutable holder in a field with ``init=False, compare=False``, so it never changes the
solver's identity, and each solver has a reset method that forgets it (``reset``,
``reset_schedule``, ``reset_warm_start``).
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from .._checks import check_nonnegative, check_positive

__all__ = ["StepCounter", "WarmStart", "check_schedule", "linear_schedule"]


class WarmStart:
    """The previous step's vector (AID's v, SOBA's v, F2SA's y), offered to the next step.

    Only reused when it matches the new variables leaf for leaf (shape, dtype, device): a
    step on other inner variables starts afresh.
    """

    def __init__(self) -> None:
        self.v: list[torch.Tensor] | None = None

    def init_for(self, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        v = self.v
        if v is None or len(v) != len(like):
            return None
        for a, b in zip(v, like):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                return None
        return v


class StepCounter:
    """How many outer steps a solver instance has taken (for its penalty schedule)."""

    def __init__(self) -> None:
        self.k = 0


def linear_schedule(start: float, growth: float, maximum: float, k: int) -> float:
    """min(start + growth · k, maximum): a constant (growth = 0) or linearly increasing
    penalty, capped."""
    return min(start + growth * k, maximum)


def check_schedule(owner: str, name: str, start: object, growth: object, maximum: object) -> None:
    """``name`` > 0 finite, ``name``_growth ≥ 0 finite, ``name``_max ≥ ``name`` (may be inf)."""
    check_positive(owner, name, start)
    check_nonnegative(owner, f"{name}_growth", growth)
    if isinstance(maximum, bool) or not isinstance(maximum, Real) or math.isnan(maximum):
        raise TypeError(f"{owner}: {name}_max must be a number (inf for no cap), got {maximum!r}")
    if maximum < start:  # type: ignore[operator]
        raise ValueError(
            f"{owner}: {name}_max={maximum} is below {name}={start}; raise {name}_max or lower "
            f"{name} (the schedule is min({name} + {name}_growth · k, {name}_max))"
        )
