"""iMAML (Rajeswaran, Finn, Kakade & Levine, "Meta-Learning with Implicit Gradients",
NeurIPS 2019) on a proximal meta-learning problem (``bilevel.meta_problem(loss, prox=λ)``;
docs/bilevel.md, "Meta-learning")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import tree
from .._checks import check_int, check_positive
from .._hypergrad import Implicit
from .._internals import Batches, check_lower_batches
from ..linalg import CG, LinearSolve, LinearSolver
from ..meta import MetaProblem
from ..problem import Problem
from ._meta import adapt, meta_result
from ._state import SolverState
from .base import StepResult

__all__ = ["IMAML"]


@dataclass(frozen=True)
class IMAML(SolverState):
    """iMAML: the implicit meta-gradient of the proximal inner problem
    g = Σ_b [L_b(θ_b; support) + (λ/2)‖θ_b − α‖²], at θ_T ≈ θ*(α):

        θ_T from ``inner_steps`` graph-free steps of size β on g from θ_0 = α (every task)
        outer_grad = ∇_α f − ∇²_{αθ} g · v,   ∇²_{θθ} g · v = ∇_θ f    (``linear_solver``)
                   = (1/B) Σ_b (I + ∇²L_b(θ_{b,T}) / λ)⁻¹ ∇L_b(θ_{b,T}; query)

    The last line is the paper's formula (their eq. 6 and Algorithm 2, solved there by CG):
    for ``meta_problem`` ∇_α f = 0 and ∇²_{αθ} g = −λ I, so the general implicit formula
    (the same code as ``bilevel.Implicit``) is λ v with (∇²L + λI) v = ∇_θ f. The problem
    must contain α in g: a ``MetaProblem`` with ``prox=0`` is refused (the meta-gradient
    would be 0). The values in ``inner`` are ignored, only its shapes count.
    ``inner_grad`` = ∇_θ g(α, θ_0), ``inner_solution`` = θ_T.

    ``lower_batches`` (a callable ``() -> batch``): each of the T inner steps draws its own
    support batch B_t (T draws per ``step``, in order) instead of the step's ``lower_batch`` (the implicit step at θ_T still uses ``lower_batch``);
    ``inner_grad`` and ``lower_loss`` are the first step's on B_1; f uses ``upper_batch``.

    Cost per step: T forward-backward passes of g (no graph), one forward of g with a
    double-backward graph, one backward per solver matvec (CG: ≤ maxiter) plus one for the
    mixed term, one forward-backward of f. Memory: O(|θ|) + one double-backward graph of
    g, independent of T (the point of iMAML against MAML).
    """

    inner_steps: int
    inner_lr: float
    linear_solver: LinearSolver | LinearSolve = field(default_factory=CG)
    lower_batches: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        check_lower_batches("IMAML", self.lower_batches)
        check_int("IMAML", "inner_steps", self.inner_steps, minimum=1)
        check_positive("IMAML", "inner_lr", self.inner_lr)
        Implicit(self.linear_solver)  # validates the solver type

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One meta-step on a batch of tasks; see the class docstring."""
        if isinstance(problem, MetaProblem) and problem.prox <= 0:
            raise ValueError(
                f"IMAML.step: the problem has prox={problem.prox}; iMAML needs the proximal "
                "term λ > 0 in the inner problem (with λ = 0 the exact inner solution does "
                "not depend on the initialization); build it with "
                "bilevel.meta_problem(task_loss, prox=λ), e.g. λ = 1"
            )
        objectives, variables, adapted = adapt(
            "IMAML.step", problem, outer, inner, lower_batch,
            steps=self.inner_steps, lr=self.inner_lr, lower_batches=self.lower_batches,
        )
        est = Implicit(self.linear_solver).estimate(
            objectives,
            variables.replace(inner=adapted.solution),
            Batches(upper=upper_batch, lower=lower_batch),
            where=f"at θ_T after {self.inner_steps} inner steps from the initialization",
        )
        scalars = dict(est.scalars)
        scalars["lower_loss_solution"] = scalars.pop("lower_loss")
        scalars["lower_grad_norm"] = tree.sq_norm_list(est.first_inner_grad).sqrt()  # free
        return meta_result(objectives, variables, est.outer_grad, adapted, scalars)
