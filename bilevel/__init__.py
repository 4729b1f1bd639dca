"""bilevel: bilevel optimization over pytrees of tensors (torch only).

    min_α f(α, θ*(α))   s.t.   θ*(α) ∈ argmin_θ g(α, θ)

Public API::

    problem = bilevel.Problem(upper=f, lower=g)          # f, g: (outer, inner, batch) -> scalar
    bilevel.hypergrad(problem, outer, inner, upper_batch=..., lower_batch=...,
                      method=bilevel.Unrolled(steps=T, lr=β) | bilevel.Implicit(bilevel.linalg.CG()))
    solver = bilevel.BOME(10, 0.1) | bilevel.ITD(10, 0.1) | bilevel.AID(10, 0.1)
    result = solver.step(problem, outer, inner, upper_batch=..., lower_batch=...)
    bilevel.fit(problem, solver, outer, inner, steps=..., outer_optimizer=..., inner_optimizer=...)

See docs/bilevel.md for the formulas, costs and a runnable example.
"""

from . import linalg, tree
from .hypergrad import Implicit, Unrolled, hypergrad
from .loop import History, apply, fit
from .problem import Problem
from .solvers import AID, BOME, ITD, StepResult

__all__ = [
    "AID",
    "BOME",
    "ITD",
    "History",
    "Implicit",
    "Problem",
    "StepResult",
    "Unrolled",
    "apply",
    "fit",
    "hypergrad",
    "linalg",
    "tree",
]
