"""SOBA, the plain single-loop method of Dagréou, Ablin, Vaiter & Moreau, "A framework for
bilevel optimization that enables stochastic and global variance reduction algorithms",
NeurIPS 2022 (SABA, its SAGA variance-reduced sibling, is in ``saba.py`` and shares the
oracles defined here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import tree
from .._autodiff import grad, leaf_aliases, vjp
from .._checks import check_positive
from .._internals import CheckedObjectives, FlatVariables, flatten_variables
from ..problem import Problem
from ._state import SolverState, WarmStart
from .base import StepResult

__all__ = ["SOBA", "lower_oracles", "soba_result", "upper_oracles"]


def lower_oracles(
    objectives: CheckedObjectives, alpha: list[torch.Tensor], theta: list[torch.Tensor],
    trees: tuple[Any, Any], batch: Any, v: list
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """SOBA's oracles of g at (α, θ, v) for one batch: (g, ∇_θ g, ∇²_αθ g · v, ∇²_θθ g · v).

    ``alpha``/``theta`` are leaf aliases, ``trees`` = (outer tree, inner tree) built on them.
    Cost: one forward of g with ``create_graph`` and one backward through ∇_θ g, which gives
    both Hessian-vector products at once (the Hessian is symmetric, so the VJP of ∇_θ g with
    v is ∇²_αθ g · v for the α leaves and ∇²_θθ g · v for the θ leaves); frees the graph.
    """
    g = objectives.lower(trees[0], trees[1], batch, "at the current (α, θ)")
    g_theta = grad(g, theta, create_graph=True)
    # the two products and ∇_θ g averaged over data-parallel ranks in one collective
    out = objectives.mean(vjp(g_theta, alpha + theta, v, retain_graph=False)
                          + [x.detach() for x in g_theta])
    na, nt = len(alpha), len(theta)
    return g, out[na + nt :], out[:na], out[na : na + nt]


def upper_oracles(
    objectives: CheckedObjectives, alpha: list[torch.Tensor], theta: list[torch.Tensor],
    trees: tuple[Any, Any], batch: Any
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """SOBA's oracles of f at (α, θ) for one batch: (f, ∇_α f, ∇_θ f); one forward-backward."""
    f = objectives.upper(trees[0], trees[1], batch, "at the current (α, θ)")
    df = objectives.mean(grad(f, alpha + theta))
    return f, df[: len(alpha)], df[len(alpha) :]


@dataclass(frozen=True)
class SOBA(SolverState):
    """Single loop: θ, the linear-system variable v and α move one step each per outer step,
    all directions evaluated at the same (α, θ, v) (Dagréou et al. 2022, SOBA):

        D_θ = ∇_θ g(α, θ)                              → inner_grad   (θ ← θ − ρ D_θ by fit)
        D_v = ∇²_θθ g(α, θ) v + ∇_θ f(α, θ)            → v ← v − ``v_lr`` · D_v  (kept here)
        D_α = ∇_α f(α, θ) + ∇²_αθ g(α, θ) v             → outer_grad   (α ← α − γ D_α by fit)

    v tracks the solution of ∇²_θθ g v = −∇_θ f, so D_α tracks the implicit hypergradient
    (with v = −H⁻¹∇_θ f, D_α = ∇_α f − ∇²_αθ g H⁻¹ ∇_θ f); at a fixed point D_θ = D_v = D_α =
    0, i.e. θ = θ*(α), v solves the system, and α is a stationary point of F. The paper uses
    one step size ρ for θ and v: pass the inner optimizer's learning rate as ``v_lr``.
    With fixed batches this is the deterministic method; with ``fit(batches=...)`` drawing
    fresh batches each step it is the stochastic one, except that the three directions of a
    step share that step's batches (the paper draws an independent sample per oracle).

    State: v lives in this instance between steps (warm-started across outer steps, starting
    at 0; only reused when its shapes, dtypes and devices match θ's), like AID's
    ``warm_start=True``; :meth:`reset` forgets it. ``inner_solution`` is None: SOBA solves
    nothing to convergence (``fit(..., inner_update="solution")`` is refused by ``apply``).

    Cost per step: one forward of g with ``create_graph`` and its backward, one
    forward-backward of f, and one backward through ∇_θ g that gives both Hessian-vector
    products (∇²_θθ g v and ∇²_αθ g v) at once. Memory: O(|θ|) for v + one double-backward
    graph of g.
    """

    v_lr: float
    _v: WarmStart = field(default_factory=WarmStart, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive("SOBA", "v_lr", self.v_lr)

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One SOBA step; see the class docstring."""
        objectives = CheckedObjectives(problem, "SOBA.step")
        variables = flatten_variables("SOBA.step", outer, inner)
        alpha, theta = leaf_aliases(variables.outer), leaf_aliases(variables.inner)
        trees = (variables.outer_tree(alpha), variables.inner_tree(theta))
        v = self._v.init_for(variables.inner)
        v = tree.zeros_like_list(variables.inner) if v is None else v
        g, d_theta, hv_alpha, hv_theta = lower_oracles(objectives, alpha, theta, trees, lower_batch, v)
        f, f_alpha, f_theta = upper_oracles(objectives, alpha, theta, trees, upper_batch)
        d_alpha = [fa + h for fa, h in zip(f_alpha, hv_alpha)]
        d_v = [h + ft for h, ft in zip(hv_theta, f_theta)]
        result, self._v.v = soba_result(
            objectives, variables, (f, g), (d_alpha, d_theta, d_v), v, self.v_lr
        )
        return result


def soba_result(
    objectives: CheckedObjectives,
    variables: FlatVariables,
    losses: tuple[torch.Tensor, torch.Tensor],
    directions: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    v: list[torch.Tensor],
    v_lr: float,
) -> tuple[StepResult, list[torch.Tensor]]:
    """The StepResult of a SOBA/SABA step from its losses (f, g) and directions (D_α, D_θ,
    D_v), after the step's single finiteness check, and the next v = v − ``v_lr`` · D_v
    (for the caller to keep only now that the check passed: a failed step leaves no NaN)."""
    (f, g), (d_alpha, d_theta, d_v) = losses, directions
    info = objectives.finish({
        "upper_loss": f.detach(),
        "lower_loss": g.detach(),
        # no inner solution: θ̂ is the current θ, so these restate lower_loss/inner_grad_norm
        "lower_loss_solution": g.detach(),
        "lower_grad_norm": tree.sq_norm_list(d_theta).sqrt(),
        "outer_grad_norm": tree.sq_norm_list(d_alpha).sqrt(),
        "inner_grad_norm": tree.sq_norm_list(d_theta).sqrt(),
        "v_residual_norm": tree.sq_norm_list(d_v).sqrt(),  # ‖∇²_θθ g v + ∇_θ f‖
        "v_norm": tree.sq_norm_list(v).sqrt(),
    })
    result = StepResult(
        outer_grad=variables.outer_tree(d_alpha),
        inner_grad=variables.inner_tree(d_theta),
        info=info,
        inner_solution=None,
    )
    return result, [vi - v_lr * dv for vi, dv in zip(v, d_v)]
