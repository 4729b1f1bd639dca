"""The solver contract: what every solver's ``step`` takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..problem import Problem

__all__ = ["Solver", "StepResult"]


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


@runtime_checkable
class Solver(Protocol):
    """What :func:`bilevel.fit` and :func:`bilevel.apply` need of a solver: one outer step.

    ``step`` reads ``outer`` and ``inner`` (pytrees of tensors) and the two batches, and
    returns a :class:`StepResult` whose directions have the shapes of ``outer`` and ``inner``;
    it never writes to the variables (the optimizers do, in :func:`bilevel.apply`).
    """

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult: ...
