"""The value-function gap shared by the penalty family (BOME, V-PBGD): with θ^(T) from T
gradient steps on g(α, ·) started at θ,

    q̂(α, θ) = g(α, θ) − g(α, stopgrad(θ^(T)))       (≥ 0 up to the inner solver's error)
    ∇q̂      = (∇_α g(α, θ) − ∇_α g(α, θ^(T)),  ∇_θ g(α, θ))

at its cost floor: T + 1 calls of g, the first inner step's gradient reused as ∇g(α, θ)
(private)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._autodiff import grad, leaf_aliases
from .._internals import (
    Batches,
    CheckedObjectives,
    FlatVariables,
    flatten_variables,
    inner_gradient_steps,
)
from ..problem import Problem
from .base import StepResult

__all__ = ["PenaltyPoint", "ValueGapTerms", "penalty_point", "value_gap_terms"]


@dataclass(frozen=True)
class ValueGapTerms:
    """What the penalty family needs from the lower level (flat leaf lists)."""

    value: torch.Tensor  # g(α, θ), detached (the mean over data-parallel ranks)
    grad_alpha: list[torch.Tensor]  # ∇_α g(α, θ)
    grad_theta: list[torch.Tensor]  # ∇_θ g(α, θ)
    solution: list[torch.Tensor]  # θ^(T), detached
    value_at_solution: torch.Tensor  # g(α, θ^(T)), detached (likewise)
    grad_alpha_at_solution: list[torch.Tensor]  # ∇_α g(α, θ^(T))

    def gap_grad(self) -> list[torch.Tensor]:
        """∇q̂ as one flat list (the α leaves, then the θ leaves)."""
        dq = [a0 - aT for a0, aT in zip(self.grad_alpha, self.grad_alpha_at_solution)]
        return dq + list(self.grad_theta)

    def gap(self) -> torch.Tensor:
        """q̂ = g(α, θ) − g(α, θ^(T)), detached."""
        return self.value.detach() - self.value_at_solution.detach()


def value_gap_terms(
    objectives: CheckedObjectives, point: FlatVariables, lower_batch: Any, steps: int, lr: float,
    draw: Callable[[], Any] | None = None,
) -> ValueGapTerms:
    """g and ∇g at the current point (leaf aliases in ``point``), θ^(T), and g and ∇_α g at
    θ^(T), for T = ``steps`` ≥ 1 gradient steps of size ``lr``. With ``draw`` the T steps
    use fresh batches ``draw()`` and q̂'s two terms the step's ``lower_batch`` (one more
    forward-backward of g: the first step's gradient is on another batch)."""
    T = steps
    alpha, theta = point.outer, point.inner
    # Inner step 1, differentiated jointly: ∇g(α, θ) for q̂ at no extra pass.
    where = f"inner step 1 of {T}" if draw is None else "at the current (α, θ)"
    g0 = objectives.lower(point.outer_tree(), point.inner_tree(), lower_batch, where)
    # Data parallelism: g's values enter BOME's λ (φ = c·q̂), so they are averaged over the
    # ranks together with their gradients, in the same collective.
    g0, *dg0 = objectives.mean([g0.detach().reshape(1)] + grad(g0, alpha + theta))
    g_alpha0, g_theta0 = dg0[: len(alpha)], dg0[len(alpha) :]
    if draw is None:
        with torch.no_grad():
            theta_hat = list(torch._foreach_add([x.detach() for x in theta], g_theta0, alpha=-lr))
        theta_T, _, _ = inner_gradient_steps(
            objectives, point.replace(inner=theta_hat), lower_batch,
            steps=T - 1, lr=lr, first=1, total=T,
        )
    else:
        theta_T, _, _ = inner_gradient_steps(
            objectives, point.replace(inner=[x.detach() for x in theta]), lower_batch,
            steps=T, lr=lr, draw=draw,
        )
    # ∇_α g(α, θ^(T)) with θ^(T) detached: autograd only runs the ops that touch α. (So no
    # ‖∇_θ g(α, θ^(T))‖ here: it would need a backward through the network, above this
    # family's cost floor; docs/bilevel.md, "Diagnostics: what `info` holds".)
    g_T = objectives.lower(
        point.outer_tree(), point.inner_tree(theta_T), lower_batch, f"at θ^(T) after {T} inner steps"
    )
    g_T, *g_alpha_T = objectives.mean([g_T.detach().reshape(1)] + grad(g_T, alpha))
    return ValueGapTerms(g0.reshape(()), g_alpha0, g_theta0, theta_T, g_T.reshape(()), g_alpha_T)


@dataclass(frozen=True)
class PenaltyPoint:
    """Everything a penalty-family step needs at the current (α, θ): the checked
    objectives, the variables, the value-gap terms, f and ∇f = (∇_α f, ∇_θ f)."""

    objectives: CheckedObjectives
    variables: FlatVariables
    low: ValueGapTerms
    f: torch.Tensor
    df: list[torch.Tensor]
    f_solution: torch.Tensor  # f(α, θ^(T)), reported only (info's upper_loss)

    def losses(self) -> dict[str, torch.Tensor]:
        """The info keys every solver reports, at their documented points (docs/bilevel.md,
        "Diagnostics: what `info` holds")."""
        return {
            "upper_loss": self.f_solution,
            "upper_loss_current": self.f.detach(),
            "lower_loss": self.low.value.detach(),
            "lower_loss_solution": self.low.value_at_solution.detach(),
        }

    def result(
        self, direction: list[torch.Tensor], info: dict[str, float]
    ) -> StepResult:
        """The joint direction split into its α and θ parts, with θ^(T) as inner_solution."""
        na, v = len(self.variables.outer), self.variables
        return StepResult(
            outer_grad=v.outer_tree(direction[:na]),
            inner_grad=v.inner_tree(direction[na:]),
            info=info,
            inner_solution=v.inner_tree(self.low.solution),
        )


def penalty_point(
    owner: str, problem: Problem, outer: Any, inner: Any, batches: Batches, steps: int, lr: float,
    draw: Callable[[], Any] | None = None,
) -> PenaltyPoint:
    """Evaluate q̂'s terms (``steps`` inner steps of size ``lr``), f and ∇f at (outer, inner)."""
    objectives = CheckedObjectives(problem, owner)
    variables = flatten_variables(owner, outer, inner)
    point = variables.replace(outer=leaf_aliases(variables.outer), inner=leaf_aliases(variables.inner))
    low = value_gap_terms(objectives, point, batches.lower, steps, lr, draw)
    f = objectives.upper(point.outer_tree(), point.inner_tree(), batches.upper, "at the current (α, θ)")
    df = objectives.mean(grad(f, point.outer + point.inner))
    with torch.no_grad():  # one forward of f, for upper_loss at the returned θ^(T)
        f_T = objectives.upper(point.outer_tree(), point.inner_tree(low.solution), batches.upper,
                               f"at θ^(T) after {steps} inner steps (reported only)")
    return PenaltyPoint(objectives, variables, low, f, df, f_T)
