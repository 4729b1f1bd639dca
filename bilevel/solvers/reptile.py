"""Reptile (Nichol, Achiam & Schulman, "On First-Order Meta-Learning Algorithms", 2018) on a
meta-learning problem (``bilevel.meta_problem``; docs/bilevel.md, "Meta-learning")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import check_int, check_positive
from .._internals import check_lower_batches
from ..problem import Problem
from ._meta import adapt, meta_result, task_mean
from ._state import SolverState
from .base import StepResult

__all__ = ["Reptile"]


@dataclass(frozen=True)
class Reptile(SolverState):
    """Reptile: adapt to each task from the initialization, then move the initialization
    towards the mean adapted parameters.

        θ_T from ``inner_steps`` graph-free steps of size β on g from θ_0 = α (every task)
        outer_grad = α − (1/B) Σ_b θ_{b,T}

    so that plain SGD on α with step ε is Nichol et al.'s update α ← α + ε(mean θ_T − α)
    (their Algorithm 2, batched). The upper objective f does not enter the direction; it is
    evaluated once at θ_T, without a graph, only to report ``upper_loss`` (the query loss
    after adaptation). ``inner_grad`` = ∇_θ g(α, θ_0), ``inner_solution`` = θ_T.

    ``lower_batches`` (a callable ``() -> batch``): each of the T inner steps draws its own
    support batch B_t (T draws per ``step``, in order) instead of the step's ``lower_batch`` (then unused);
    ``inner_grad`` and ``lower_loss`` are the first step's on B_1; f uses ``upper_batch``.

    Cost per step: T + 1 forward-backward passes of g (the last at θ_T, for
    ``info['lower_grad_norm']``), one forward of f.
    Memory: O(|θ|) + one graph of g at a time.
    """

    inner_steps: int
    inner_lr: float
    lower_batches: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        check_lower_batches("Reptile", self.lower_batches)
        check_int("Reptile", "inner_steps", self.inner_steps, minimum=1)
        check_positive("Reptile", "inner_lr", self.inner_lr)

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One meta-step on a batch of tasks; see the class docstring."""
        objectives, variables, adapted = adapt(
            "Reptile.step", problem, outer, inner, lower_batch,
            steps=self.inner_steps, lr=self.inner_lr, lower_batches=self.lower_batches,
        )
        mean_theta = task_mean(adapted.solution, adapted.batched)
        direction = [a.detach() - m for a, m in zip(variables.outer, mean_theta)]
        with torch.no_grad():
            f = objectives.upper(
                variables.outer_tree([a.detach() for a in variables.outer]),
                variables.inner_tree(adapted.solution),
                upper_batch,
                f"after {self.inner_steps} inner steps (reported only)",
            )
        return meta_result(objectives, variables, direction, adapted, {"upper_loss": f})
