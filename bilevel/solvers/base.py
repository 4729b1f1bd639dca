"""What every solver's ``step`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """Directions and diagnostics of one outer step (every tensor detached).

    Attributes:
        outer_grad: pytree shaped like ``outer``: the descent direction for α (ITD/AID: the
            hypergradient dF/dα; BOME: ∇_α f + λ ∇_α q̂).
        inner_grad: pytree shaped like ``inner``: the descent direction for θ (ITD/AID:
            ∇_θ g at the current θ; BOME: ∇_θ f + λ ∇_θ q̂).
        info: Python floats (losses, λ, norms, solver iterations).
        inner_solution: θ^(T), the approximate lower-level solution the solver computed,
            for warm starts (new storage; safe to copy into the caller's tensors).
    """

    outer_grad: Any
    inner_grad: Any
    info: dict[str, float] = field(default_factory=dict)
    inner_solution: Any = None
