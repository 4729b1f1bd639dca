"""BOME (Bilevel Optimization Made Easy; Liu, Ye, Wright, Stone & Liu, 2022), first order.

With u = (α, θ), q̂(u) = g(α, θ) − g(α, stopgrad(θ^(T))) where θ^(T) comes from T gradient
steps on g(α, ·) started at θ (the BOME paper; docs/bilevel.md):

    ∇q̂ = (∇_α g(α, θ) − ∇_α g(α, θ^(T)),  ∇_θ g(α, θ))
    λ   = max((φ − ⟨∇f, ∇q̂⟩) / (‖∇q̂‖² + ε), 0),   φ = η‖∇q̂‖²  or  φ = c·q̂
    direction = ∇f + λ ∇q̂          (the caller steps u ← u − ξ · direction)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import tree
from .._checks import check_int, check_nonnegative, check_positive
from .._internals import Batches, batch_drawer, check_lower_batches
from ..problem import Problem
from ._state import SolverState
from ._value_function import penalty_point
from .base import StepResult

__all__ = ["BOME"]

_PHIS = ("grad_norm", "value_gap")


@dataclass(frozen=True)
class BOME(SolverState):
    """The BOME direction for (α, θ) at its cost floor.

    Args:
        inner_steps: T ≥ 1 gradient steps on g(α, ·) to get θ^(T).
        inner_lr: β, their step size.
        eta: η in φ = η‖∇q̂‖² (``phi="grad_norm"``, the toy/benchopt setting; η = 0.5).
        phi: ``"grad_norm"`` or ``"value_gap"`` (φ = c·q̂, the hyperparameter experiments).
        c: c in φ = c·q̂.
        eps: ε > 0 in the denominator of λ.
        lower_batches: fresh batches for the inner steps (below).

    ``lower_batches`` (a callable ``() -> batch``): the T steps to θ^(T) each draw their own
    batch B_t (T draws per ``step``, in order); q̂, ∇q̂, ``lower_loss`` and
    ``lower_loss_solution`` use the step's ``lower_batch`` at both points (a gap between two
    batches would not be a value-function gap), at one more forward-backward of g. f uses
    ``upper_batch``.

    Cost per step (T + 1 calls of g, 1 call of f, and one forward of f at θ^(T) without graph
    for ``info['upper_loss']``; docs/bilevel.md, "Diagnostics: what `info` holds"): the first inner step differentiates g
    jointly w.r.t. (α, θ) at the current point, and that gradient is reused as ∇g(α, θ);
    T − 1 more forward-backward passes of g w.r.t. θ; one forward of g at θ^(T) (detached)
    with a backward that only reaches the ops touching α (for α acting on logits: the
    head, not the network); one forward-backward of f. No second derivatives, no graph
    survives the call. Memory: O(|θ|) + one graph of g or f at a time.
    """

    inner_steps: int
    inner_lr: float
    eta: float = 0.5
    phi: str = "grad_norm"
    c: float = 0.5
    eps: float = 1e-8
    lower_batches: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        check_lower_batches("BOME", self.lower_batches)
        check_int("BOME", "inner_steps", self.inner_steps, minimum=1)
        check_positive("BOME", "inner_lr", self.inner_lr)
        check_nonnegative("BOME", "eta", self.eta)
        check_nonnegative("BOME", "c", self.c)
        # ε > 0: at a lower-level solution ∇q̂ = 0 and φ − ⟨∇f, ∇q̂⟩ = 0, so ε = 0 gives
        # λ = 0/0 = NaN and a NaN direction exactly when the iterates have converged.
        check_positive("BOME", "eps", self.eps)
        if self.phi not in _PHIS:
            raise ValueError(f"BOME: phi must be one of {_PHIS}, got {self.phi!r}")

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One BOME step at (outer, inner); see the class docstring."""
        at = penalty_point(
            "BOME.step", problem, outer, inner, Batches(upper=upper_batch, lower=lower_batch),
            self.inner_steps, self.inner_lr, batch_drawer("BOME.step", self.lower_batches),
        )
        low, df = at.low, at.df
        dq, q = low.gap_grad(), low.gap()
        dq_sq = tree.sq_norm_list(dq)
        df_dq = tree.dot_list(df, dq)
        phi = self.eta * dq_sq if self.phi == "grad_norm" else self.c * q
        # Kept as tensors: no device sync until the single one in objectives.finish.
        lam = torch.clamp((phi - df_dq) / (dq_sq + self.eps), min=0.0)
        # λ is float32 for half-precision leaves (see tree.dot_list); keep each leaf's dtype.
        direction = [a + lam.to(b.dtype) * b for a, b in zip(df, dq)]
        info = at.objectives.finish(
            {
                "lambda": lam,
                "q": q,
                "phi": phi,
                **at.losses(),
                "upper_grad_norm": tree.sq_norm_list(df).sqrt(),
                "q_grad_norm": dq_sq.sqrt(),
                "upper_q_dot": df_dq,
                **_block_products(df, dq, len(at.variables.outer)),
            }
        )
        _add_cosines(info)
        return at.result(direction, info)


def _block_products(
    df: list[torch.Tensor], dq: list[torch.Tensor], na: int
) -> dict[str, torch.Tensor]:
    """The norms and dot product of ∇f and ∇q̂ split into the outer (α) and inner (θ)
    blocks: which block carries the conflict between f and q̂ is what decides whether λ
    ever leaves η."""
    parts = {}
    for block, sl in (("outer", slice(None, na)), ("inner", slice(na, None))):
        parts[f"upper_grad_norm_{block}"] = tree.sq_norm_list(df[sl]).sqrt()
        parts[f"q_grad_norm_{block}"] = tree.sq_norm_list(dq[sl]).sqrt()
        parts[f"upper_q_dot_{block}"] = tree.dot_list(df[sl], dq[sl])
    return parts


def _add_cosines(info: dict[str, float]) -> None:
    for block in ("", "_outer", "_inner"):
        # cos(∇f, ∇q̂) per block; 0 where a block's gradient vanishes (e.g. no α in g)
        den = info[f"upper_grad_norm{block}"] * info[f"q_grad_norm{block}"]
        info[f"cos{block}"] = info[f"upper_q_dot{block}"] / den if den > 0 else 0.0
