"""V-PBGD: value-function penalty-based bilevel gradient descent (Shen & Chen, "On
Penalty-based Bilevel Gradient Descent Method", ICML 2023), fully first order."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import tree
from .._checks import check_int, check_positive
from .._internals import Batches, batch_drawer, check_lower_batches
from ..problem import Problem
from ._state import SolverState, StepCounter, check_schedule, linear_schedule
from ._value_function import penalty_point
from .base import StepResult

__all__ = ["VPBGD"]


@dataclass(frozen=True)
class VPBGD(SolverState):
    """Gradient descent on the value-function penalty  f(α, θ) + γ (g(α, θ) − g*(α)),
    g*(α) = min_θ' g(α, θ'), with g*(α) replaced by g(α, θ^(T)), θ^(T) from T gradient
    steps of size β on a copy of θ (Shen & Chen 2023, the V-PBGD algorithm):

        direction = (∇_α f(α, θ) + γ_k (∇_α g(α, θ) − ∇_α g(α, θ^(T))),
                     ∇_θ f(α, θ) + γ_k ∇_θ g(α, θ))
        γ_k = min(gamma + gamma_growth · k, gamma_max)      (k = outer steps taken so far)

    This is ∇f + γ∇q̂ with BOME's q̂ (docs/bilevel.md): the same terms, with a scheduled
    penalty γ instead of BOME's per-step λ. For a fixed γ the iterates converge to a
    stationary point of the penalized problem, O(1/γ) away from the bilevel solution (on
    the quadratic of tests/bilevel/test_bilevel_penalty.py exactly the penalized problem's
    minimizer); the paper's analysis takes γ larger as the target accuracy shrinks, and a
    growing γ removes the bias. Defaults: ``gamma=10``, constant (these are this
    library's, not the paper's, which sets γ per experiment). The directions scale with γ,
    so the optimizers' learning rates must scale like 1/γ (the paper's step size is
    ≤ 1/(L_f + γ L_g)).

    The schedule counts this instance's ``step`` calls: :meth:`reset` restarts it
    (a new ``fit`` on a new problem should use a new instance or reset it).

    Args:
        inner_steps: T ≥ 1 steps for θ^(T) (started at θ: θ tracks the lower level, so it
            is a warm start).
        inner_lr: β, their step size.
        gamma: γ₀ > 0, the penalty of the first step (schedule γ_k above).
        gamma_growth: ≥ 0, the penalty's increase per step.
        gamma_max: the penalty's cap (≥ γ₀; may be inf).
        lower_batches: fresh batches for the inner steps (below).

    ``lower_batches``: fresh batches for the T steps to θ^(T), with q̂ and its gradient on
    the step's ``lower_batch``, exactly as in :class:`bilevel.BOME`.

    Cost per step: T + 1 calls of g (T forward-backward passes, one w.r.t. α only at
    θ^(T)) and one forward-backward of f — BOME's floor — plus one forward of f at θ^(T)
    without graph for ``info['upper_loss']``. No second derivatives.
    Memory: O(|θ|) + one graph of f or g at a time.
    """

    inner_steps: int
    inner_lr: float
    gamma: float = 10.0
    gamma_growth: float = 0.0
    gamma_max: float = math.inf
    lower_batches: Callable[[], Any] | None = None
    _k: StepCounter = field(default_factory=StepCounter, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_lower_batches("VPBGD", self.lower_batches)
        check_int("VPBGD", "inner_steps", self.inner_steps, minimum=1)
        check_positive("VPBGD", "inner_lr", self.inner_lr)
        check_schedule("VPBGD", "gamma", self.gamma, self.gamma_growth, self.gamma_max)

    def reset_schedule(self) -> None:
        """Deprecated: :meth:`reset` (the one name every solver has)."""
        warnings.warn("VPBGD.reset_schedule() is deprecated; call reset(), the name every "
                      "solver has", DeprecationWarning, stacklevel=2)
        self.reset()

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One V-PBGD step at (outer, inner); see the class docstring."""
        at = penalty_point(
            "VPBGD.step", problem, outer, inner, Batches(upper=upper_batch, lower=lower_batch),
            self.inner_steps, self.inner_lr, batch_drawer("VPBGD.step", self.lower_batches),
        )
        gamma = linear_schedule(self.gamma, self.gamma_growth, self.gamma_max, self._k.k)
        dq, q = at.low.gap_grad(), at.low.gap()
        direction = [a + gamma * b for a, b in zip(at.df, dq)]
        info = at.objectives.finish(
            {
                "penalty": gamma,
                "q": q,
                "penalized_loss": at.f.detach() + gamma * q,  # at the current (α, θ)
                **at.losses(),
                "upper_grad_norm": tree.sq_norm_list(at.df).sqrt(),
                "q_grad_norm": tree.sq_norm_list(dq).sqrt(),
                "direction_norm": tree.sq_norm_list(direction).sqrt(),
            }
        )
        self._k.k += 1
        return at.result(direction, info)


