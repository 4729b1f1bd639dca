"""bilevel: bilevel optimization over pytrees of tensors (torch only).

    min_α f(α, θ*(α))   s.t.   θ*(α) ∈ argmin_θ g(α, θ)

Public API::

    problem = bilevel.Problem(upper=f, lower=g)          # f, g: (outer, inner, batch) -> scalar
    bilevel.hypergrad(problem, outer, inner, upper_batch=..., lower_batch=...,
                      method=bilevel.Unrolled(steps=T, lr=β) | bilevel.Implicit(bilevel.linalg.CG()),
                      return_info=False)
    bilevel.Implicit(linear_solver=solve)   # any solve(matvec, b, init=None) -> (x, info)
    solver = bilevel.BOME(10, 0.1) | bilevel.ITD(10, 0.1) | bilevel.AID(10, 0.1)
    meta = bilevel.meta_problem(task_loss, prox=λ)        # meta-learning: α = initialization
    solver = bilevel.MAML(5, 0.01) | bilevel.FOMAML(5, 0.01) | bilevel.Reptile(5, 0.01)
             | bilevel.IMAML(20, 0.01)                    # inner = bilevel.task_copies(α, B)
    result = solver.step(problem, outer, inner, upper_batch=..., lower_batch=...)
    bilevel.fit(problem, solver, outer, inner, steps=..., outer_optimizer=..., inner_optimizer=...)

See docs/bilevel.md for the formulas, costs and a runnable example.
"""

from . import linalg, tree
from ._hypergrad import Estimate, HypergradMethod, Implicit, Unrolled, hypergrad
from .loop import History, apply, fit
from .meta import MetaProblem, meta_problem, task_copies
from .problem import Problem
from .solvers import AID, BOME, FOMAML, IMAML, ITD, MAML, Reptile, StepResult

__version__ = "0.1.0"

__all__ = [
    "AID",
    "BOME",
    "Estimate",
    "FOMAML",
    "HypergradMethod",
    "IMAML",
    "ITD",
    "History",
    "Implicit",
    "MAML",
    "MetaProblem",
    "Problem",
    "Reptile",
    "StepResult",
    "Unrolled",
    "apply",
    "fit",
    "hypergrad",
    "linalg",
    "meta_problem",
    "__version__",
    "task_copies",
    "tree",
]
