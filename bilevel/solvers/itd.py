"""ITD: iterative (unrolled) differentiation as a solver with the shared ``step`` interface."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import tree
from .._checks import check_int, check_positive
from .._hypergrad import Unrolled, check_truncate
from .._internals import (
    Batches,
    CheckedObjectives,
    batch_drawer,
    check_lower_batches,
    flatten_variables,
    stationarity,
)
from ..inner_optim import SGD, InnerOptimizer, check_inner_optimizer
from ..problem import Problem
from ._state import SolverState
from .base import StepResult

__all__ = ["ITD"]


@dataclass(frozen=True)
class ITD(SolverState):
    """Unrolled hypergradient through ``inner_steps`` gradient steps of size ``inner_lr``.

    ``step`` returns ``outer_grad`` = dF/dα of ``Unrolled(inner_steps, inner_lr, truncate)``
    started at the current θ, ``inner_grad`` = ∇_θ g(α, θ) (the first unrolled step's
    gradient: one warm-started inner step per outer step, at no extra cost) and
    ``inner_solution`` = θ^(T).

    ``inner_optimizer`` (``bilevel.SGD(momentum=...)``, ``bilevel.Adam(...)``; default plain
    gradient descent) is the update unrolled with learning rate ``inner_lr`` (see
    :class:`bilevel.Unrolled`); it is not the torch optimizer that ``bilevel.fit`` applies
    ``inner_grad`` with.

    ``lower_batches`` (a callable ``() -> batch``, e.g. ``lambda: next(loader_iter)``): each
    of the T unrolled steps evaluates g on its own batch B_t = ``lower_batches()`` (drawn in
    step order, T draws per ``step``) instead of the step's ``lower_batch``, and the
    hypergradient differentiates through those minibatch steps; ``inner_grad`` and
    ``lower_loss`` are then the first step's gradient and value on B_1. f uses
    ``upper_batch``; with ``lower_batches`` the step's ``lower_batch`` is not used.

    Cost per step: T forward-backward passes of g with ``create_graph`` (K with
    ``truncate=K``), one backward through them, one forward-backward of f, and one
    graph-free forward-backward of g at θ_T for ``info['lower_grad_norm']``.
    Memory: O(K · activations of g).
    """

    inner_steps: int
    inner_lr: float
    truncate: int | None = None
    inner_optimizer: InnerOptimizer = field(default_factory=SGD)
    lower_batches: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        check_lower_batches("ITD", self.lower_batches)
        check_int("ITD", "inner_steps", self.inner_steps, minimum=1)
        check_positive("ITD", "inner_lr", self.inner_lr)
        check_truncate("ITD", self.truncate, self.inner_steps)
        check_inner_optimizer("ITD", self.inner_optimizer)

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One outer step; see the class docstring."""
        objectives = CheckedObjectives(problem, "ITD.step")
        variables = flatten_variables("ITD.step", outer, inner)
        method = Unrolled(self.inner_steps, self.inner_lr, self.truncate, self.inner_optimizer)
        est = method.estimate(objectives, variables, Batches(upper=upper_batch, lower=lower_batch),
                              draw=batch_drawer("ITD.step", self.lower_batches))
        scalars = dict(est.scalars)
        scalars.update(stationarity(objectives, variables, est.inner_solution,
                                    f"at θ_T after {self.inner_steps} inner steps (stationarity)"))
        scalars["outer_grad_norm"] = tree.sq_norm_list(est.outer_grad).sqrt()
        scalars["inner_grad_norm"] = tree.sq_norm_list(est.first_inner_grad).sqrt()
        info = objectives.finish(scalars)
        return StepResult(
            outer_grad=variables.outer_tree(est.outer_grad),
            inner_grad=variables.inner_tree(est.first_inner_grad),
            info=info,
            inner_solution=variables.inner_tree(est.inner_solution),
        )
