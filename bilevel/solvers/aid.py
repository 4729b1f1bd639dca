"""AID: approximate implicit differentiation as a solver with the shared ``step`` interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import tree
from .._checks import check_int, check_positive
from .._hypergrad import Implicit
from .._internals import Batches, start_step
from ..linalg import CG, LinearSolve, LinearSolver
from ..problem import Problem
from ._state import WarmStart
from .base import StepResult

__all__ = ["AID"]


@dataclass(frozen=True)
class AID:
    """``inner_steps`` graph-free gradient steps to θ^(T), then the implicit hypergradient
    at θ^(T):  dF/dα = ∇_α f − ∇²_{αθ} g · v,  ∇²_{θθ} g · v = ∇_θ f  (``linear_solver``).

    ``inner_grad`` is ∇_θ g(α, θ) at the current θ (the first inner step's gradient), and
    ``inner_solution`` is θ^(T). With ``inner_steps=0`` the current θ is taken as the solution
    (meaningful, so accepted: θ solved elsewhere, or kept near θ* by the inner optimizer's
    one step per outer step; ``inner_lr`` is then unused).

    ``warm_start=True`` passes the previous step's v as ``init`` to the linear solver (CG,
    FixedPoint: fewer iterations when α and θ move little between outer steps; Neumann:
    continues the series from it, a different truncation). It is off by default: the
    solver instance then keeps a θ-sized v alive between steps, and a step's result
    depends on the steps before it (equal only to the solver's tolerance).
    :meth:`reset_warm_start` forgets v.

    Cost per step: T forward-backward passes of g (no graph), one forward of g with a
    double-backward graph, one backward per solver matvec, one forward-backward of f.
    Memory: O(|θ|) + one double-backward graph of g, independent of T and of iterations.
    """

    inner_steps: int
    inner_lr: float
    linear_solver: LinearSolver | LinearSolve = field(default_factory=CG)
    warm_start: bool = False
    _last: WarmStart = field(
        default_factory=WarmStart, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_int("AID", "inner_steps", self.inner_steps, minimum=0)
        check_positive("AID", "inner_lr", self.inner_lr)
        if not isinstance(self.warm_start, bool):
            raise TypeError(f"AID: warm_start must be a bool, got {self.warm_start!r}")
        Implicit(self.linear_solver)  # validates the solver type

    def reset_warm_start(self) -> None:
        """Forget the stored v: the next step's linear solve starts from 0."""
        self._last.v = None

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One outer step; see the class docstring."""
        start = start_step(
            "AID.step", problem, outer, inner, lower_batch, steps=self.inner_steps, lr=self.inner_lr
        )
        objectives, variables = start.objectives, start.variables
        theta, first_grad, first_value = start.theta, start.first_grad, start.first_value
        est = Implicit(self.linear_solver).estimate(
            objectives,
            variables.replace(inner=theta),
            Batches(upper=upper_batch, lower=lower_batch),
            where=f"at θ^(T) after {self.inner_steps} inner steps",
            copy_solution=self.inner_steps == 0,  # θ^(T) is already fresh storage when T > 0
            init=self._last.init_for(theta) if self.warm_start else None,
        )
        scalars = dict(est.scalars)
        scalars["lower_loss_solution"] = scalars["lower_loss"]
        if first_grad is not None:
            scalars["lower_loss"] = first_value
        else:
            first_grad = est.first_inner_grad
        scalars["outer_grad_norm"] = tree.sq_norm_list(est.outer_grad).sqrt()
        scalars["inner_grad_norm"] = tree.sq_norm_list(first_grad).sqrt()
        info = objectives.finish(scalars)
        if self.warm_start:  # only after the finiteness check: a failed step keeps no NaN v
            self._last.v = est.linear_solution
        return StepResult(
            outer_grad=variables.outer_tree(est.outer_grad),
            inner_grad=variables.inner_tree(first_grad),
            info=info,
            inner_solution=variables.inner_tree(est.inner_solution),
        )
