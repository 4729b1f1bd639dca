"""The warnings and errors ``bilevel`` raises about its own results, each a named class so
that a caller can filter, escalate or catch exactly one kind.

* :class:`ConvergenceWarning` — an iterative solve (a linear solver, an inner loop) stopped
  before its tolerance: the result is an approximation of unstated quality.
* :class:`DivergenceError` — an iterative solve whose residual grew past its stated factor:
  the result is wrong, not merely inexact, so nothing computed from it is applied.
* :class:`NegativeCurvatureError` — CG met a direction along which the operator is not
  positive definite and was told to raise (``CG(negative_curvature="raise")``).
* :class:`UnusedLeafWarning` — a leaf of ``outer`` or ``inner`` that no objective uses: its
  gradient is a structural zero, not a computed one.

``warnings.simplefilter("error", bilevel.ConvergenceWarning)`` turns the first into an error.
"""

from __future__ import annotations

__all__ = [
    "ConvergenceWarning",
    "DivergenceError",
    "NegativeCurvatureError",
    "UnusedLeafWarning",
]


class ConvergenceWarning(RuntimeWarning):
    """An iterative solve stopped (at its iteration cap, or at a negative-curvature direction
    it was told to stop at) before reaching its tolerance."""


class DivergenceError(FloatingPointError):
    """An iterative solve's residual grew past its divergence factor times the starting one.

    A ``FloatingPointError`` (as the non-finite values a divergence ends in are), so code
    that catches that keeps working."""


class NegativeCurvatureError(ArithmeticError):
    """CG found pᵀAp ≤ 0 (the operator is not positive definite) under
    ``negative_curvature="raise"``; MINRES solves such (indefinite) systems."""


class UnusedLeafWarning(UserWarning):
    """A leaf of the outer or inner variables that neither objective depends on."""
