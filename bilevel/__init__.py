"""bilevel: bilevel optimization over pytrees of tensors (torch only).

    min_α f(α, θ*(α))   s.t.   θ*(α) ∈ argmin_θ g(α, θ)

Public API::

    problem = bilevel.Problem(upper=f, lower=g)          # f, g: (outer, inner, batch) -> scalar
    bilevel.hypergrad(problem, outer, inner, upper_batch=..., lower_batch=...,
                      method=bilevel.Unrolled(inner_steps=T, inner_lr=β) | bilevel.Implicit(bilevel.linalg.CG())
                             | bilevel.FiniteDifference(inner_lr=β),
                      return_info=False)
    bilevel.Implicit(linear_solver=solve)   # any solve(matvec, b, init=None) -> (x, info)
    solver = bilevel.BOME(10, 0.1) | bilevel.ITD(10, 0.1) | bilevel.AID(10, 0.1)
           | bilevel.FD(1, 0.1) | bilevel.VPBGD(10, 0.1) | bilevel.F2SA(10, 0.1) | bilevel.SOBA(0.1)
           | bilevel.SABA(0.1, n_upper=m, n_lower=n)   # batches: bilevel.Indexed(i, batch)
    bilevel.ITD(10, 0.1, inner_optimizer=bilevel.Adam())   # unroll Adam (or bilevel.SGD(momentum=0.9))
    meta = bilevel.meta_problem(task_loss, prox=λ)        # meta-learning: α = initialization
    solver = bilevel.MAML(5, 0.01) | bilevel.FOMAML(5, 0.01) | bilevel.Reptile(5, 0.01)
             | bilevel.IMAML(20, 0.01)                    # inner = bilevel.task_copies(α, B)
    result = solver.step(problem, outer, inner, upper_batch=..., lower_batch=...)
    bilevel.fit(problem, solver, outer, inner, steps=..., outer_optimizer=..., inner_optimizer=...)
    bilevel.distributed.shard(batch)    # under torchrun: this rank's part; every step and fit
                                        # average their gradients over the ranks
    @bilevel.custom_root(optimality)   # optimality(outer, inner) = 0 at solve(outer)'s result
    def solve(outer): ...               # any solver; the result is differentiable in outer
    f = bilevel.functional(model)       # an nn.Module: f.params (the pytree), f.buffers,
    f(params, x)                        #   f(...) = functional_call; BatchNorm stats never written

See docs/bilevel.md for the formulas, costs and a runnable example.
"""

from . import distributed, errors, inner_optim, linalg, tree
from ._finite_difference import FiniteDifference
from ._hypergrad import Estimate, HypergradMethod, Implicit, Unrolled, hypergrad
from .errors import (
    ConvergenceWarning,
    DivergenceError,
    NegativeCurvatureError,
    UnusedLeafWarning,
)
from .implicit import custom_root
from .inner_optim import SGD, Adam
from .loop import History, apply, fit
from .meta import MetaProblem, meta_problem, task_copies
from .module import FunctionalModule, functional
from .problem import Problem
from .solvers import (
    AID,
    BOME,
    F2SA,
    FD,
    FOMAML,
    IMAML,
    ITD,
    MAML,
    SABA,
    SOBA,
    VPBGD,
    Indexed,
    Reptile,
    Solver,
    StepResult,
)

__version__ = "0.1.0"

__all__ = [
    "AID",
    "Adam",
    "BOME",
    "ConvergenceWarning",
    "DivergenceError",
    "Estimate",
    "F2SA",
    "FD",
    "FOMAML",
    "FiniteDifference",
    "FunctionalModule",
    "HypergradMethod",
    "IMAML",
    "ITD",
    "History",
    "Indexed",
    "Implicit",
    "MAML",
    "MetaProblem",
    "NegativeCurvatureError",
    "Problem",
    "Reptile",
    "SABA",
    "SGD",
    "SOBA",
    "Solver",
    "StepResult",
    "UnusedLeafWarning",
    "Unrolled",
    "VPBGD",
    "apply",
    "custom_root",
    "distributed",
    "errors",
    "fit",
    "functional",
    "hypergrad",
    "inner_optim",
    "linalg",
    "meta_problem",
    "__version__",
    "task_copies",
    "tree",
]
