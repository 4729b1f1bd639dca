"""What the meta-learning solvers share (private): θ_0 = α copied to every task, and the
reduction of a per-task quantity back to α's shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import tree
from .._internals import (
    CheckedObjectives,
    FlatVariables,
    batch_drawer,
    flatten_variables,
    inner_gradient_steps,
    stationarity,
)
from ..distributed import all_mean
from ..problem import Problem
from .base import StepResult

__all__ = [
    "Adapted",
    "adapt",
    "has_task_dim",
    "meta_result",
    "start_from_outer",
    "task_mean",
    "task_sum",
]


def has_task_dim(owner: str, alpha: list[torch.Tensor], theta: list[torch.Tensor]) -> bool:
    """True if every θ leaf is (B,) + α's shape, False if every one is α's shape; else an
    error naming the first leaf that is neither."""
    if len(alpha) != len(theta):
        raise ValueError(
            f"{owner}: inner must have the structure of outer (the adapted copy of the "
            f"initialization), got {len(theta)} inner leaves for {len(alpha)} outer leaves; "
            "build it with bilevel.task_copies(outer, tasks)"
        )
    batched = theta[0].shape != alpha[0].shape
    for k, (a, t) in enumerate(zip(alpha, theta)):
        if batched:
            ok = t.ndim == a.ndim + 1 and t.shape[1:] == a.shape
        else:
            ok = t.shape == a.shape
        if not ok:
            first = (
                f" like inner leaf 0, which has a task dimension ({tuple(theta[0].shape)} for "
                f"outer {tuple(alpha[0].shape)})"
                if batched and k > 0
                else ", the same for every leaf"
            )
            raise ValueError(
                f"{owner}: inner leaf {k} has shape {tuple(t.shape)}; it must be outer leaf "
                f"{k}'s shape {tuple(a.shape)} (one task) or (tasks,) + {tuple(a.shape)}"
                f"{first}; build inner with bilevel.task_copies(outer, tasks)"
            )
    if batched and len({t.shape[0] for t in theta}) > 1:
        raise ValueError(
            f"{owner}: inner leaves have different task counts {[t.shape[0] for t in theta]}"
        )
    return batched


def start_from_outer(
    alpha: list[torch.Tensor], theta: list[torch.Tensor], batched: bool
) -> list[torch.Tensor]:
    """θ_0 = α for every task, as a differentiable function of α (an ``expand`` view:
    no copy; the inner steps never write to it)."""
    return [a.expand_as(t) if batched else a.view_as(a) for a, t in zip(alpha, theta)]


def task_sum(xs: list[torch.Tensor], batched: bool) -> list[torch.Tensor]:
    """Σ_b x_b over the task dimension (the adjoint of :func:`start_from_outer`)."""
    return [x.sum(0) for x in xs] if batched else xs


def task_mean(xs: list[torch.Tensor], batched: bool) -> list[torch.Tensor]:
    """(1/B) Σ_b x_b over the task dimension."""
    return [x.mean(0) for x in xs] if batched else xs


def adapt(
    owner: str, problem: Problem, outer: Any, inner: Any, batch: Any, *, steps: int, lr: float,
    lower_batches: Callable[[], Any] | None = None,
) -> tuple[CheckedObjectives, FlatVariables, Adapted]:
    """The opening of a first-order meta step: the checked objectives, the flat variables
    and ``steps`` graph-free gradient steps on g from θ_0 = α (every task); see
    :func:`bilevel._internals.inner_gradient_steps`; ``lower_batches``: a fresh support
    batch per step instead of ``batch``)."""
    objectives = CheckedObjectives(problem, owner, through_inner=True)
    variables = flatten_variables(owner, outer, inner)
    batched = has_task_dim(owner, variables.outer, variables.inner)
    start = start_from_outer([a.detach() for a in variables.outer], variables.inner, batched)
    theta, first_grad, first_value = inner_gradient_steps(
        objectives, variables.replace(inner=start), batch, steps=steps, lr=lr,
        draw=batch_drawer(owner, lower_batches),
    )
    assert first_grad is not None and first_value is not None  # steps >= 1
    return objectives, variables, Adapted(batched, theta, first_grad, first_value)


@dataclass(frozen=True)
class Adapted:
    """θ_T after the inner steps from α, and what the first step saw (flat leaf lists)."""

    batched: bool  # θ has a leading task dimension
    solution: list[torch.Tensor]  # θ_T, detached new storage
    first_grad: list[torch.Tensor]  # ∇_θ g(α, θ_0)
    first_value: torch.Tensor  # g(α, θ_0)


def meta_result(
    objectives: CheckedObjectives,
    variables: FlatVariables,
    outer_grad: list[torch.Tensor],
    adapted: Adapted,
    scalars: dict[str, torch.Tensor | float],
) -> StepResult:
    """The StepResult every meta solver returns: ``outer_grad`` its meta-direction,
    ``inner_grad`` = ∇_θ g at θ_0 = α, ``inner_solution`` = θ_T (the adapted parameters),
    ``info`` = ``scalars`` + ``lower_loss`` (g at θ_0) and the two direction norms."""
    # Data parallelism: each rank holds its own tasks (θ, θ_T are this rank's); the
    # meta-gradient, a mean over this rank's tasks, is averaged over the ranks here, once.
    outer_grad = all_mean([x.detach() for x in outer_grad])
    if "lower_grad_norm" not in scalars:  # IMAML has it from its linearization
        scalars = {**scalars, **stationarity(objectives, variables, adapted.solution,
                                             "at θ_T (stationarity)")}
    scalars = {
        **scalars,
        "lower_loss": adapted.first_value,
        "outer_grad_norm": tree.sq_norm_list(outer_grad).sqrt(),
        "inner_grad_norm": tree.sq_norm_list(adapted.first_grad).sqrt(),
    }
    return StepResult(
        outer_grad=variables.outer_tree(outer_grad),
        inner_grad=variables.inner_tree(adapted.first_grad),
        info=objectives.finish(scalars),
        inner_solution=variables.inner_tree(adapted.solution),
    )
