"""F2SA: fully first-order stochastic approximation (Kwon, Kwon, Wright & Nowak, "A Fully
First-Order Method for Stochastic Bilevel Optimization", ICML 2023)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import tree
from .._autodiff import grad, leaf_aliases
from .._checks import check_int, check_positive
from .._internals import (
    CheckedObjectives,
    FlatVariables,
    batch_drawer,
    check_lower_batches,
    start_step,
)
from ..problem import Problem
from ._state import SolverState, StepCounter, WarmStart, check_schedule, linear_schedule
from .base import StepResult

__all__ = ["F2SA"]


@dataclass(frozen=True)
class F2SA(SolverState):
    """F2SA's Lagrangian  L_λ(α, y, z) = f(α, y) + λ (g(α, y) − g(α, z))  with two inner
    sequences (the paper's names): z ≈ argmin g(α, ·) and y ≈ argmin f(α, ·) + λ g(α, ·).
    Per outer step k, T steps of each from their previous values,

        z ← z − β ∇_θ g(α, z)                    (z = the caller's θ: a warm start)
        y ← y − β (∇_θ f(α, y) / λ_k + ∇_θ g(α, y))
        outer_grad = ∇_α f(α, y_T) + λ_k (∇_α g(α, y_T) − ∇_α g(α, z_T))
        λ_k = min(lam + lam_growth · k, lam_max)

    (the paper's Algorithm 1 in the deterministic setting; its x is α). The y step is the
    paper's step α_k ∝ 1/λ_k on ∇f + λ∇g written as β (∇f/λ + ∇g), so that one ``inner_lr``
    is stable for both sequences at every λ. As λ → ∞, y_T → z_T and the estimate tends to
    the implicit hypergradient; for a fixed λ the iterates converge to a stationary point
    of the penalized problem min_{α,y} f(α, y) + λ(g(α, y) − min_z g(α, z)), O(1/λ) away
    from the bilevel solution. The paper lets λ_k grow polynomially in k; the defaults here
    (``lam=10``, constant) are this library's.

    ``inner_grad`` is ∇_θ g(α, θ) at the current θ (z's first step: with ``fit``'s inner
    optimizer, one warm-started z step per outer step), ``inner_solution`` = z_T (``fit(...,
    inner_update="solution")`` continues z from there, the paper's warm start). y is kept
    by the instance between steps (``warm_start=True``, the paper's; else it restarts at θ
    each step) and λ's schedule counts this instance's steps: :meth:`reset` forgets both.

    ``lower_batches`` (a callable ``() -> batch``): each of the T z steps and then each of
    the T y steps draws its own lower batch (2T draws per ``step``: z's T in order, then
    y's), instead of the step's ``lower_batch``; the y steps' f keeps ``upper_batch``. The
    outer direction's terms at y_T and z_T (and ``gap``, ``lower_loss_solution``) use the
    step's ``lower_batch``; ``inner_grad`` / ``lower_loss`` are z's first step on its batch.

    Cost per step: T forward-backward passes of g for z, T of f + g for y (one backward
    each), one forward-backward of f + λg at y_T and one of g at z_T (w.r.t. α for the
    direction and θ for ``info['lower_grad_norm']``), one forward of f at z_T without graph
    for ``info['upper_loss']``.
    No second derivatives. Memory: O(|θ|) for y (kept between steps) + one graph at a time.
    """

    inner_steps: int
    inner_lr: float
    lam: float = 10.0
    lam_growth: float = 0.0
    lam_max: float = math.inf
    warm_start: bool = True
    lower_batches: Callable[[], Any] | None = None
    _k: StepCounter = field(default_factory=StepCounter, init=False, repr=False, compare=False)
    _y: WarmStart = field(default_factory=WarmStart, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_lower_batches("F2SA", self.lower_batches)
        check_int("F2SA", "inner_steps", self.inner_steps, minimum=1)
        check_positive("F2SA", "inner_lr", self.inner_lr)
        check_schedule("F2SA", "lam", self.lam, self.lam_growth, self.lam_max)
        if not isinstance(self.warm_start, bool):
            raise TypeError(f"F2SA: warm_start must be a bool, got {self.warm_start!r}")

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One F2SA step; see the class docstring."""
        draw = batch_drawer("F2SA.step", self.lower_batches)
        start = start_step(
            "F2SA.step", problem, outer, inner, lower_batch, steps=self.inner_steps,
            lr=self.inner_lr, draw=draw,
        )
        objectives, variables = start.objectives, start.variables
        assert start.first_grad is not None and start.first_value is not None  # inner_steps >= 1
        lam = linear_schedule(self.lam, self.lam_growth, self.lam_max, self._k.k)
        y0 = self._y.init_for(variables.inner) if self.warm_start else None
        y0 = [x.detach() for x in variables.inner] if y0 is None else y0
        y = self._y_steps(objectives, variables, y0, lam, upper_batch, lower_batch, draw)
        alpha = leaf_aliases(variables.outer)
        at_y = variables.replace(outer=alpha, inner=y)
        f_y = objectives.upper(at_y.outer_tree(), at_y.inner_tree(), upper_batch, "at y_T")
        g_y = objectives.lower(at_y.outer_tree(), at_y.inner_tree(), lower_batch, "at y_T")
        z = leaf_aliases(start.theta)
        g_z = objectives.lower(at_y.outer_tree(), variables.inner_tree(z), lower_batch,
                               f"at z_T after {self.inner_steps} inner steps")
        # ∇_α g for the direction, ∇_θ g for the stationarity; one collective for both
        d_yz = objectives.mean(grad(f_y + lam * g_y, alpha) + grad(g_z, alpha + z))
        d_y, d_z = d_yz[: len(alpha)], d_yz[len(alpha) :]
        outer_grad = [a - lam * b for a, b in zip(d_y, d_z)]
        with torch.no_grad():  # one forward of f, for upper_loss at the returned z_T
            f_z = objectives.upper(at_y.outer_tree(), variables.inner_tree(start.theta),
                                   upper_batch, "at z_T (reported only)")
        info = objectives.finish({
            "penalty": lam,
            "upper_loss": f_z,
            "upper_loss_y": f_y.detach(),
            "lower_loss": start.first_value,
            "lower_loss_solution": g_z.detach(),
            "lower_grad_norm": tree.sq_norm_list(d_z[len(alpha) :]).sqrt(),
            "gap": g_y.detach() - g_z.detach(),  # g(α, y_T) − g(α, z_T): O(1/λ) at convergence
            "outer_grad_norm": tree.sq_norm_list(outer_grad).sqrt(),
            "inner_grad_norm": tree.sq_norm_list(start.first_grad).sqrt(),
        })
        # Kept only after the finiteness check passed: a failed step leaves no NaN behind.
        if self.warm_start:
            self._y.v = y
        self._k.k += 1
        return StepResult(
            outer_grad=variables.outer_tree(outer_grad),
            inner_grad=variables.inner_tree(start.first_grad),
            info=info,
            inner_solution=variables.inner_tree(start.theta),
        )

    def _y_steps(
        self, objectives: CheckedObjectives, variables: FlatVariables, y: list[torch.Tensor],
        lam: float, upper_batch: Any, lower_batch: Any, draw: Callable[[], Any] | None = None,
    ) -> list[torch.Tensor]:
        """T graph-free steps y ← y − β (∇_θ f(α, y)/λ + ∇_θ g(α, y)), one backward each."""
        outer = variables.outer_tree([a.detach() for a in variables.outer])
        T = self.inner_steps
        for t in range(T):
            leaves = leaf_aliases(y)
            where = f"y step {t + 1} of {T}"
            inner = variables.inner_tree(leaves)
            h = objectives.upper(outer, inner, upper_batch, where) / lam
            b = lower_batch if draw is None else draw()
            h = h + objectives.lower(outer, inner, b, where)
            with torch.no_grad():
                y = list(torch._foreach_add(y, objectives.mean(grad(h, leaves)), alpha=-self.inner_lr))
        return [x.detach() for x in y]
