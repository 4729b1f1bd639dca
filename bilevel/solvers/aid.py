"""AID: approximate implicit differentiation as a solver with the shared ``step`` interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import tree
from .._checks import check_int, check_positive
from ..hypergrad import Implicit, _gradient_steps
from ..linalg import CG, LinearSolver
from ..problem import Problem, Tape, prepare
from .base import StepResult

__all__ = ["AID"]


@dataclass(frozen=True)
class AID:
    """``inner_steps`` graph-free gradient steps to θ^(T), then the implicit hypergradient
    at θ^(T):  dF/dα = ∇_α f − ∇²_{αθ} g · v,  ∇²_{θθ} g · v = ∇_θ f  (``linear_solver``).

    ``inner_grad`` is ∇_θ g(α, θ) at the current θ (the first inner step's gradient), and
    ``inner_solution`` is θ^(T). With ``inner_steps=0`` the current θ is taken as the solution.

    Cost per step: T forward-backward passes of g (no graph), one forward of g with a
    double-backward graph, one backward per solver matvec, one forward-backward of f.
    Memory: O(|θ|) + one double-backward graph of g, independent of T and of iterations.
    """

    inner_steps: int
    inner_lr: float
    linear_solver: LinearSolver = field(default_factory=CG)

    def __post_init__(self) -> None:
        check_int("AID", "inner_steps", self.inner_steps, minimum=0)
        check_positive("AID", "inner_lr", self.inner_lr)
        Implicit(self.linear_solver)  # validates the solver type

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One outer step; see the class docstring."""
        tape = Tape(problem, "AID.step")
        o, ospec, i, ispec = prepare("AID.step", outer, inner)
        theta, first_grad, first_value = _gradient_steps(
            tape, o, ospec, i, ispec, lower_batch, steps=self.inner_steps, lr=self.inner_lr
        )
        where = f"at θ^(T) after {self.inner_steps} inner steps"
        est = Implicit(self.linear_solver).estimate(
            tape,
            o,
            ospec,
            theta,
            ispec,
            upper_batch,
            lower_batch,
            where=where,
            copy_solution=self.inner_steps == 0,  # θ^(T) is already fresh storage when T > 0
        )
        scalars = dict(est.scalars)
        scalars["lower_loss_solution"] = scalars["lower_loss"]
        if first_grad is not None:
            scalars["lower_loss"] = first_value
        else:
            first_grad = est.first_inner_grad
        scalars["outer_grad_norm"] = tree.sq_norm_list(est.outer_grad).sqrt()
        scalars["inner_grad_norm"] = tree.sq_norm_list(first_grad).sqrt()
        info = tape.finish(scalars)
        return StepResult(
            outer_grad=tree.unflatten(est.outer_grad, ospec),
            inner_grad=tree.unflatten(first_grad, ispec),
            info=info,
            inner_solution=tree.unflatten(est.inner_solution, ispec),
        )
