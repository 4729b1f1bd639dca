"""FD: DARTS' finite-difference hypergradient as a solver with the shared ``step`` interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import tree
from .._checks import check_int, check_positive
from .._finite_difference import FiniteDifference
from .._internals import Batches, batch_drawer, check_lower_batches, start_step, stationarity
from ..problem import Problem
from ._state import SolverState
from .base import StepResult

__all__ = ["FD"]


@dataclass(frozen=True)
class FD(SolverState):
    """DARTS' second-order approximation (Liu, Simonyan & Yang, ICLR 2019), first order in
    cost: T − 1 graph-free gradient steps θ → θ^(T−1), then at θ^(T−1) one more step
    θ^(T) = θ^(T−1) − β ∇_θ g and

        outer_grad ≈ ∇_α f(α, θ^(T)) − β (∇_α g(α, θ⁺) − ∇_α g(α, θ⁻)) / (2r),
        θ^± = θ^(T−1) ± r v,  v = ∇_θ f(α, θ^(T)),  r = eps / ‖v‖,

    the hypergradient through the *last* inner step only, i.e. what
    ``ITD(inner_steps, inner_lr, truncate=1)`` computes exactly with a Hessian-vector
    product, here with a central difference (exact when ∇_α g is at most quadratic in θ,
    O(r²) otherwise). DARTS itself is ``inner_steps=1``: the architecture step through one
    look-ahead step of the weights, alternating with one weight step.

    ``inner_grad`` = ∇_θ g(α, θ) at the current θ (the weights' step, as in DARTS),
    ``inner_solution`` = θ^(T).

    Args:
        inner_steps: T ≥ 1 (DARTS: 1).
        inner_lr: β > 0 (DARTS: ξ, the weights' learning rate).
        eps: the norm of the perturbation r·v (DARTS: 0.01).
        lower_batches: a callable ``() -> batch``: each of the T inner steps draws its own
            batch B_t (T draws per ``step``, in order), the last one B_T also serving the
            central difference of ∇_α g (it differentiates that step); with it the step's
            ``lower_batch`` is not used. f uses ``upper_batch``.

    Cost per step: T + 3 forward-backward passes of g (two of them only w.r.t. α, one at
    θ^(T) for ``info['lower_grad_norm']``), one of f; no Hessian-vector product, no double backward (works with kernels that have none).
    Memory: O(|θ|) + one graph of f or g at a time.
    """

    inner_steps: int
    inner_lr: float
    eps: float = 0.01
    lower_batches: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        check_lower_batches("FD", self.lower_batches)
        check_int("FD", "inner_steps", self.inner_steps, minimum=1)
        check_positive("FD", "inner_lr", self.inner_lr)
        check_positive("FD", "eps", self.eps)

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One outer step; see the class docstring."""
        draw = batch_drawer("FD.step", self.lower_batches)
        start = start_step(
            "FD.step", problem, outer, inner, lower_batch,
            steps=self.inner_steps - 1, lr=self.inner_lr, total=self.inner_steps, draw=draw,
        )
        objectives, variables = start.objectives, start.variables
        est = FiniteDifference(self.inner_lr, self.eps).estimate(
            objectives,
            variables.replace(inner=start.theta),
            Batches(upper=upper_batch, lower=lower_batch if draw is None else draw()),
        )
        scalars = dict(est.scalars)
        scalars.update(stationarity(objectives, variables, est.inner_solution,
                                    f"at θ^(T) after {self.inner_steps} inner steps (stationarity)"))
        first_grad = start.first_grad
        if first_grad is None:
            first_grad = est.first_inner_grad
        elif start.first_value is not None:  # set together with first_grad
            scalars["lower_loss"] = start.first_value
        scalars["outer_grad_norm"] = tree.sq_norm_list(est.outer_grad).sqrt()
        scalars["inner_grad_norm"] = tree.sq_norm_list(first_grad).sqrt()
        return StepResult(
            outer_grad=variables.outer_tree(est.outer_grad),
            inner_grad=variables.inner_tree(first_grad),
            info=objectives.finish(scalars),
            inner_solution=variables.inner_tree(est.inner_solution),
        )
