"""AID: approximate implicit differentiation as a solver with the shared ``step`` interface."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import tree
from .._autodiff import grad, leaf_aliases, vjp
from .._checks import check_int, check_positive
from .._hypergrad import Implicit
from .._internals import Batches, CheckedObjectives, FlatVariables, start_step
from ..linalg import CG, LinearSolve, LinearSolver, Neumann
from ..problem import Problem
from ._state import SolverState, WarmStart
from .base import StepResult

__all__ = ["AID"]


@dataclass(frozen=True)
class AID(SolverState):
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
    :meth:`reset` forgets v (and :meth:`state_dict` carries it across a restart).

    ``lower_batches`` (a callable ``() -> batch``, e.g. ``lambda: next(loader_iter)``) makes
    this stocBiO (Ji, Yang & Liang, "Bilevel optimization: convergence analysis and enhanced
    design", ICML 2021, the stocBiO algorithm): with ``linear_solver=Neumann(Q, η)``, each
    Neumann term's Hessian-vector product evaluates g on its own fresh batch B_k = draw(),

        v = η Σ_{q=0}^{Q} Π_{k=1}^{q} (I − η ∇²_θθ g(α, θ; B_k)) ∇_θ f(α, θ; upper_batch),

    so E[v] over independent batches is the full-batch Neumann sum (each term is a product
    of independent factors), while ∇_θ f, ∇_α f and the mixed term ∇²_αθ g · v use the step's
    ``upper_batch`` and ``lower_batch``. ``fresh_inner_steps=True`` also draws a batch for
    each of the T inner steps (stocBiO's SGD inner loop). Only the Neumann series accepts
    per-term batches (CG's iterates assume one fixed matrix). Cost: each Neumann term is a
    forward of g with a double-backward graph and its backward, instead of one backward
    through a shared graph; memory one such graph at a time.

    Cost per step: T forward-backward passes of g (no graph), one forward of g with a
    double-backward graph, one backward per solver matvec, one forward-backward of f.
    Memory: O(|θ|) + one double-backward graph of g, independent of T and of iterations.
    """

    inner_steps: int
    inner_lr: float
    linear_solver: LinearSolver | LinearSolve = field(default_factory=CG)
    warm_start: bool = False
    lower_batches: Callable[[], Any] | None = None
    fresh_inner_steps: bool = False
    _last: WarmStart = field(
        default_factory=WarmStart, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_int("AID", "inner_steps", self.inner_steps, minimum=0)
        check_positive("AID", "inner_lr", self.inner_lr)
        if not isinstance(self.warm_start, bool):
            raise TypeError(f"AID: warm_start must be a bool, got {self.warm_start!r}")
        Implicit(self.linear_solver)  # validates the solver type
        self._check_fresh_batches()

    def _check_fresh_batches(self) -> None:
        if not isinstance(self.fresh_inner_steps, bool):
            raise TypeError(f"AID: fresh_inner_steps must be a bool, got {self.fresh_inner_steps!r}")
        if self.lower_batches is None:
            if self.fresh_inner_steps:
                raise ValueError(
                    "AID: fresh_inner_steps=True needs lower_batches, the callable that draws "
                    "each step's batch (e.g. lower_batches=lambda: next(batch_iterator))"
                )
            return
        if not callable(self.lower_batches):
            raise TypeError(
                "AID: lower_batches must be a callable () -> batch (e.g. lambda: "
                f"next(batch_iterator)), got {type(self.lower_batches).__name__}"
            )
        if not isinstance(self.linear_solver, Neumann):
            raise ValueError(
                "AID: lower_batches draws a fresh batch per Neumann term (stocBiO), which only "
                f"the Neumann series supports, got linear_solver={self.linear_solver!r}; use "
                "linear_solver=bilevel.linalg.Neumann(steps, lr)"
            )

    def _draw(self) -> Any:
        """The next batch from ``lower_batches``; an exhausted iterator is an error that says
        so, not a bare StopIteration escaping from ``step`` (or ending ``fit`` silently)."""
        assert self.lower_batches is not None
        try:
            return self.lower_batches()
        except StopIteration:
            raise RuntimeError(
                "AID.step: lower_batches ran out of batches (it raised StopIteration); give it "
                "an endless source, e.g. itertools.cycle over the batches or a sampler"
            ) from None

    def reset_warm_start(self) -> None:
        """Deprecated: :meth:`reset` (the one name every solver has)."""
        warnings.warn("AID.reset_warm_start() is deprecated; call reset(), the name every "
                      "solver has", DeprecationWarning, stacklevel=2)
        self.reset()

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One outer step; see the class docstring."""
        start = start_step(
            "AID.step", problem, outer, inner, lower_batch, steps=self.inner_steps,
            lr=self.inner_lr, draw=self._draw if self.fresh_inner_steps else None,
        )
        objectives, variables = start.objectives, start.variables
        theta, first_grad, first_value = start.theta, start.first_grad, start.first_value
        matvec = None
        if self.lower_batches is not None:
            matvec = fresh_batch_hvp(objectives, variables.replace(inner=theta), self._draw)
        est = Implicit(self.linear_solver).estimate(
            objectives,
            variables.replace(inner=theta),
            Batches(upper=upper_batch, lower=lower_batch),
            where=f"at θ^(T) after {self.inner_steps} inner steps",
            copy_solution=self.inner_steps == 0,  # θ^(T) is already fresh storage when T > 0
            init=self._last.init_for(theta) if self.warm_start else None,
            matvec=matvec,
        )
        scalars = dict(est.scalars)
        scalars["lower_loss_solution"] = scalars["lower_loss"]
        # ∇_θ g at θ^(T) is the linearization Implicit built anyway: the residual is free
        scalars["lower_grad_norm"] = tree.sq_norm_list(est.first_inner_grad).sqrt()
        if first_grad is not None and first_value is not None:  # set together
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


def fresh_batch_hvp(
    objectives: CheckedObjectives, variables: FlatVariables, draw: Callable[[], Any]
) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The matvec p ↦ ∇²_θθ g(α, θ; draw()) p at θ = ``variables.inner``, a new batch per call:
    one forward of g, ∇_θ g with ``create_graph`` and one backward through it (freed)."""
    outer = variables.outer_tree([a.detach() for a in variables.outer])
    calls = [0]

    def hvp(p: list[torch.Tensor]) -> list[torch.Tensor]:
        calls[0] += 1
        theta = leaf_aliases(variables.inner)
        where = f"Neumann term {calls[0]} on a fresh lower batch"
        g = objectives.lower(outer, variables.inner_tree(theta), draw(), where)
        return objectives.mean(vjp(grad(g, theta, create_graph=True), theta, p, retain_graph=False))

    return hvp
