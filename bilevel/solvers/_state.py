"""The state a solver keeps between its steps.

The solvers are frozen dataclasses of their options: ``==`` and ``hash`` compare options only
(two AIDs with the same options are equal whatever either has seen), so a solver can key a
cache or a config. What must survive from one ``step`` to the next — a warm start, an
outer-step counter for a schedule, SAGA memories — lives in small mutable holders in fields
with ``init=False, compare=False``, and every solver exposes it the same way
(:class:`SolverState`): ``state_dict()`` (tensors, ints and lists only, so
``torch.load(path, weights_only=True)`` reads it back), ``load_state_dict(d)`` and ``reset()``.
"""

from __future__ import annotations

import dataclasses
import math
from numbers import Real

import torch

from .._checks import check_nonnegative, check_positive

__all__ = ["SolverState", "StepCounter", "WarmStart", "check_schedule", "linear_schedule"]


class WarmStart:
    """The previous step's vector (AID's v, SOBA's v, F2SA's y), offered to the next step.

    Only reused when it matches the new variables leaf for leaf (shape, dtype, device): a
    step on other inner variables starts afresh.
    """

    def __init__(self) -> None:
        self.v: list[torch.Tensor] | None = None

    def state_dict(self) -> dict:
        return {"v": None if self.v is None else [t.detach().clone() for t in self.v]}

    def load_state_dict(self, state: dict) -> None:
        v = state["v"]
        self.v = None if v is None else [t.clone() for t in v]

    def clear(self) -> None:
        self.v = None

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

    def state_dict(self) -> dict:
        return {"k": self.k}

    def load_state_dict(self, state: dict) -> None:
        k = state["k"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"load_state_dict: the step counter must be an int >= 0, got {k!r}")
        self.k = k

    def clear(self) -> None:
        self.k = 0


class SolverState:
    """``state_dict`` / ``load_state_dict`` / ``reset`` for a solver dataclass, over its
    state holders (fields with ``init=False`` whose value has ``state_dict``, ``load_state_dict``
    and ``clear``). A solver without such fields has the empty state ``{}``."""

    def _holders(self) -> dict:
        # ignored arg-type: the mixin itself is no dataclass; every class that uses it is one
        return {f.name.lstrip("_"): getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if not f.init and hasattr(getattr(self, f.name), "state_dict")}

    def state_dict(self) -> dict:
        """What this solver carries from one step to the next (copies; {} when nothing)."""
        return {name: h.state_dict() for name, h in self._holders().items()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict` of a solver of the same class and options."""
        holders = self._holders()
        if not isinstance(state, dict) or set(state) != set(holders):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{type(self).__name__}.load_state_dict: expected the keys "
                             f"{sorted(holders)}, got {got} (a state of another solver?)")
        for name, h in holders.items():
            h.load_state_dict(state[name])

    def reset(self) -> None:
        """Forget every state: the next step is that of a fresh solver with these options."""
        for h in self._holders().values():
            h.clear()


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
    if maximum < start:
        raise ValueError(
            f"{owner}: {name}_max={maximum} is below {name}={start}; raise {name}_max or lower "
            f"{name} (the schedule is min({name} + {name}_growth · k, {name}_max))"
        )
