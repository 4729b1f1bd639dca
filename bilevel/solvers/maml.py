"""MAML and first-order MAML (Finn, Abbeel & Levine, ICML 2017) on a meta-learning problem
(``bilevel.meta_problem``; docs/bilevel.md, "Meta-learning")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._autodiff import grad, leaf_aliases
from .._checks import check_int, check_positive
from .._internals import CheckedObjectives, batch_drawer, check_lower_batches, flatten_variables
from ..problem import Problem
from ._meta import Adapted, adapt, has_task_dim, meta_result, start_from_outer, task_sum
from ._state import SolverState
from .base import StepResult

__all__ = ["FOMAML", "MAML"]


def _check(owner: str, inner_steps: object, inner_lr: object) -> None:
    check_int(owner, "inner_steps", inner_steps, minimum=1)
    check_positive(owner, "inner_lr", inner_lr)


@dataclass(frozen=True)
class MAML(SolverState):
    """MAML: the outer variable α is the initialization, and the meta-gradient is the exact
    derivative of the query loss after ``inner_steps`` gradient steps from it:

        θ_0 = α (for every task b),   θ_{t+1} = θ_t − β ∇_θ g(α, θ_t)
        outer_grad = d f(α, θ_T(α)) / dα
                   = (1/B) Σ_b (I − β∇²L_b(θ_{b,0})) ··· (I − β∇²L_b(θ_{b,T−1})) ∇L_b(θ_{b,T}; query)

    (the last line for ``meta_problem(loss, prox=0)``; with λ > 0 the proximal term enters
    each factor too). The values in ``inner`` are ignored, only its shapes count (θ_0 is α).
    ``inner_grad`` = ∇_θ g(α, θ_0), ``inner_solution`` = θ_T (the adapted parameters).

    ``lower_batches`` (a callable ``() -> batch``): each of the T inner steps draws its own
    support batch B_t (T draws per ``step``, in order) instead of the step's ``lower_batch`` (then unused);
    ``inner_grad`` and ``lower_loss`` are the first step's on B_1; f uses ``upper_batch``.

    Cost per step: T forward-backward passes of g with ``create_graph``, one reverse sweep
    back through them (Hessian-vector products: ≈ T more passes), one forward-backward of f,
    one graph-free forward-backward of g at θ_T for ``info['lower_grad_norm']``.
    Memory: O(T · activations of g) for the B tasks of the batch.
    """

    inner_steps: int
    inner_lr: float
    lower_batches: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        _check("MAML", self.inner_steps, self.inner_lr)
        check_lower_batches("MAML", self.lower_batches)

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One meta-step on a batch of tasks; see the class docstring."""
        objectives = CheckedObjectives(problem, "MAML.step", through_inner=True)
        variables = flatten_variables("MAML.step", outer, inner)
        batched = has_task_dim("MAML.step", variables.outer, variables.inner)
        alpha = leaf_aliases(variables.outer)
        outer_tree = variables.outer_tree(alpha)
        theta = start_from_outer(alpha, variables.inner, batched)
        T, first = self.inner_steps, None
        draw = batch_drawer("MAML.step", self.lower_batches)
        for t in range(T):
            where = f"inner step {t + 1} of {T} from the initialization"
            b = lower_batch if draw is None else draw()
            g = objectives.lower(outer_tree, variables.inner_tree(theta), b, where)
            # create_graph: the meta-gradient differentiates through this step too.
            g_theta = grad(g, theta, create_graph=True)
            if first is None:
                first = ([x.detach() for x in g_theta], g.detach())
            theta = [th - self.inner_lr * d for th, d in zip(theta, g_theta)]
        where = f"after {T} inner steps"
        f = objectives.upper(outer_tree, variables.inner_tree(theta), upper_batch, where)
        meta = grad(f, alpha)  # through θ_T, ..., θ_0 = α; frees the unrolled graph
        assert first is not None  # inner_steps >= 1
        adapted = Adapted(batched, [x.detach() for x in theta], first[0], first[1])
        return meta_result(objectives, variables, meta, adapted, {"upper_loss": f.detach()})


@dataclass(frozen=True)
class FOMAML(SolverState):
    """First-order MAML: MAML's meta-gradient with every Jacobian dθ_T/dα replaced by the
    identity (Finn et al., 2017, section 5.2):

        θ_T from ``inner_steps`` graph-free steps of size β on g from θ_0 = α
        outer_grad = ∇_α f(α, θ_T) + Σ_b ∇_{θ_b} f(α, θ_T)
                   = (1/B) Σ_b ∇L_b(θ_{b,T}; query)       for meta_problem(loss)

    ``inner_grad`` = ∇_θ g(α, θ_0), ``inner_solution`` = θ_T.

    ``lower_batches`` (a callable ``() -> batch``): each of the T inner steps draws its own
    support batch B_t (T draws per ``step``, in order) instead of the step's ``lower_batch`` (then unused);
    ``inner_grad`` and ``lower_loss`` are the first step's on B_1; f uses ``upper_batch``.

    Cost per step: T + 1 forward-backward passes of g (the last at θ_T, for
    ``info['lower_grad_norm']``) and one of f; no second derivatives.
    Memory: O(|θ|) + one graph of g or f at a time.
    """

    inner_steps: int
    inner_lr: float
    lower_batches: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        _check("FOMAML", self.inner_steps, self.inner_lr)
        check_lower_batches("FOMAML", self.lower_batches)

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One meta-step on a batch of tasks; see the class docstring."""
        objectives, variables, adapted = adapt(
            "FOMAML.step", problem, outer, inner, lower_batch,
            steps=self.inner_steps, lr=self.inner_lr, lower_batches=self.lower_batches,
        )
        alpha, theta = leaf_aliases(variables.outer), leaf_aliases(adapted.solution)
        where = f"after {self.inner_steps} inner steps"
        f = objectives.upper(
            variables.outer_tree(alpha), variables.inner_tree(theta), upper_batch, where
        )
        df = grad(f, alpha + theta)
        direct, through_theta = df[: len(alpha)], task_sum(df[len(alpha) :], adapted.batched)
        meta = [a + b for a, b in zip(direct, through_theta)]
        return meta_result(objectives, variables, meta, adapted, {"upper_loss": f.detach()})
