"""Linear solvers for A x = b where A is only available as a matrix-vector product.

The protocol (what ``Implicit(linear_solver=...)`` and ``AID(linear_solver=...)`` accept)
is any callable

    solve(matvec, b, init=None) -> (x, info)

where ``b``, ``init`` and ``x`` are *lists of tensors* (the leaves of the inner variables θ,
in ``bilevel.tree.leaves`` order; a list is itself a pytree, so ``bilevel.tree`` works on
it), ``matvec`` maps such a list to a list of the same shapes, ``init`` is a starting guess
for x (None: start from 0; a solver is free to ignore it) and ``info`` is a dict of Python
floats, bools or 0-dim tensors (diagnostics; ``hypergrad(..., return_info=True)`` and the
AID solver report them as ``solver_<key>``). In implicit differentiation A is the
lower-level Hessian ∇²_θθ g: symmetric, positive definite near a strict minimum, and
indefinite or singular on a non-convex lower level (a neural network), where only MINRES,
NormalCG and Dense solve it (measurements: docs/bilevel.md, "Which linear solver?").

The call signature is jaxopt's (``jaxopt.linear_solve.solve_cg(matvec, b, ridge=None,
init=None)``), but jaxopt's and torchopt's linear solves return ``x`` alone, not
``(x, info)``; :func:`returns_x_only` adapts such a callable (``info`` is then empty), and a
solver that returns anything but a ``(x, info)`` pair is refused with a ``TypeError`` naming
this protocol and the adapter.

The shipped solvers are frozen dataclasses with checked options; ``solver.solve`` is the
protocol callable, and ``solve_cg(**options)`` etc. return it (an unknown option is a
``ValueError`` naming it). Called directly, ``solver(matvec, b)`` solves over any pytree and
returns x alone.

==========  =================================================  ==============================
solver      iteration (A)                                      matvecs
==========  =================================================  ==============================
CG          conjugate gradients (symmetric positive definite)  ≤ maxiter (+1 with init)
MINRES      min ‖b − A x‖ over the Krylov space (symmetric,    ≤ maxiter (+1 with init)
            indefinite allowed)
NormalCG    CG on Aᵀ A x = Aᵀ b, Aᵀ v = A v (symmetric,        2·iterations + 1 (+2 with init)
            singular allowed: minimum-norm least squares)
Neumann     x = lr Σ_{k=0}^{steps} (I − lr A)^k b (pos. def.)   steps (+1 with init)
FixedPoint  x ← x + lr (b − A x) (positive definite)           ≤ maxiter (+1 with init)
Dense       materializes A column by column, SVD pseudo-inverse  n (= total size of b)
==========  =================================================  ==============================

``info`` keys, the same for every shipped solver: ``iterations`` (the matvecs of the
iteration itself, not the one that forms the starting residual b − A·init; NormalCG: its
iterations, two matvecs each, with ``matvecs`` the total), ``residual`` (‖b − A x‖ of the
returned x, tracked by the iteration's own recursion, equal to the true one up to
round-off; Neumann: of the sum without its last term, an upper bound when the series
converges; Dense: the true one) and ``converged`` (a bool: ``residual`` ≤ the solver's
threshold, max(tol·‖b‖, atol); NormalCG also when ``normal_residual`` = ‖Aᵀ(b − A x)‖ ≤
tol·‖Aᵀ b‖). Dense also reports ``rank``. Every iterative solver (``IterativeSolver``) warns
:class:`bilevel.errors.ConvergenceWarning` when it stops unconverged
(``on_unconverged="warn" | "ignore"``) and raises :class:`bilevel.errors.DivergenceError`
when its residual exceeds ``divergence_factor`` (1e3; CG 1e6) × the starting one
(``on_divergence="raise" | "warn" | "ignore"``).
"""

from __future__ import annotations

from typing import Any

from ._base import (
    Info,
    IterativeSolver,
    LinearSolve,
    LinearSolver,
    ListMatvec,
    as_linear_solve,
    returns_x_only,
    solver_factory,
    solver_name,
    unpack_solution,
)
from .dense import Dense
from .krylov import CG, MINRES, NormalCG
from .stationary import FixedPoint, Neumann

__all__ = [
    "CG",
    "Dense",
    "FixedPoint",
    "Info",
    "IterativeSolver",
    "LinearSolve",
    "LinearSolver",
    "ListMatvec",
    "MINRES",
    "Neumann",
    "NormalCG",
    "as_linear_solve",
    "returns_x_only",
    "solve_cg",
    "solve_dense",
    "solve_fixed_point",
    "solve_minres",
    "solve_neumann",
    "solve_normal_cg",
    "solver_name",
    "unpack_solution",
]


def solve_cg(**options: Any) -> LinearSolve:
    """``CG(**options).solve``: the protocol callable (options checked, unknown ones named)."""
    return solver_factory(CG, "solve_cg", options)


def solve_minres(**options: Any) -> LinearSolve:
    """``MINRES(**options).solve``."""
    return solver_factory(MINRES, "solve_minres", options)


def solve_normal_cg(**options: Any) -> LinearSolve:
    """``NormalCG(**options).solve`` (torchopt's default linear solve, by the same name)."""
    return solver_factory(NormalCG, "solve_normal_cg", options)


def solve_neumann(**options: Any) -> LinearSolve:
    """``Neumann(**options).solve`` (needs ``steps`` and ``lr``)."""
    return solver_factory(Neumann, "solve_neumann", options)


def solve_fixed_point(**options: Any) -> LinearSolve:
    """``FixedPoint(**options).solve``."""
    return solver_factory(FixedPoint, "solve_fixed_point", options)


def solve_dense(**options: Any) -> LinearSolve:
    """``Dense(**options).solve``."""
    return solver_factory(Dense, "solve_dense", options)
