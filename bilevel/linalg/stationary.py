"""Richardson-type solvers: the truncated Neumann series and the fixed-point iteration
x ← x + lr (b − A x). Both converge only for positive-definite A and 0 < lr < 2/λ_max."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import tree
from ..errors import DivergenceError
from ._base import (
    Info,
    IterativeSolver,
    ListMatvec,
    check_finite,
    check_init,
    residual_of,
    with_ridge,
)

__all__ = ["FixedPoint", "Neumann"]


def _richardson_hint(lr: float) -> str:
    return (
        "the iteration converges only when 0 < lr < 2 / λ_max(A) and A is positive definite: "
        f"lower lr (now {lr:g}), or use CG (positive definite) or MINRES (indefinite)"
    )


@dataclass(frozen=True)
class Neumann(IterativeSolver):
    """Truncated Neumann series  A⁻¹ b ≈ lr Σ_{k=0}^{steps} (I − lr A)^k b.

    Converges as steps → ∞ when 0 < lr < 2 / λ_max(A) and A is positive definite; the error
    shrinks like (1 − lr·λ_min)^{steps}. ``steps = 0`` gives lr·b (one term), never zero.
    Uses exactly ``steps`` matvecs (Lorraine et al., 2020), fewer when ``tol`` > 0 stops the
    series once a term's norm is ≤ tol·‖b‖ (one device sync per term; tol = 0, the default,
    checks once, at the end). ``init`` = x₀ sums the series for the correction instead,
    x = x₀ + lr Σ_k (I − lr A)^k (b − A x₀), one matvec more (a warm start: it continues the
    Richardson iteration from x₀). ``ridge`` replaces A by A + ridge·I.

    ``info["residual"]`` is ‖(I − lr A)^k r₀‖ for the last term k: exactly ‖b − A x'‖ for x'
    the sum without its last term (b − A·lr Σ_{j<k} (I − lr A)^j r₀ = (I − lr A)^k r₀). The
    returned x's own residual is ‖(I − lr A)^{k+1} r₀‖, at most this one whenever the series
    converges (‖I − lr A‖ ≤ 1), and would cost one matvec more (under stocBiO one more
    batch), so Neumann alone reports this bound. ``converged`` is residual ≤ max(tol·‖b‖,
    atol): with the default tol = 0 a truncated series is never called converged, and warns
    ``ConvergenceWarning``; a deliberate truncation says ``on_unconverged="ignore"``. A last
    term above ``divergence_factor``·‖r₀‖ is divergence (:class:`IterativeSolver`), and a
    non-finite sum raises ``FloatingPointError`` whatever ``on_divergence`` says.
    """

    steps: int
    lr: float
    tol: float = 0.0
    ridge: float = 0.0
    atol: float = 0.0

    def _hint(self) -> str:
        return f"raise steps (now {self.steps}) or set tol; " + _richardson_hint(self.lr)

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "residual", "converged"})``; see the class docstring."""
        b = list(b)
        matvec = with_ridge(matvec, self.ridge)
        x0 = None if init is None else check_init(init, b, "Neumann")
        r0 = b if x0 is None else residual_of(matvec, b, x0)
        p = [t.clone() for t in r0]  # current term (I − lr A)^k r0
        acc = [t.clone() for t in r0]  # running sum of terms
        extra = [] if x0 is None else [r0]
        it, reason, threshold = 0, None, 0.0
        if self.tol > 0:  # the per-term test needs ‖b‖ and ‖r₀‖ now (one sync)
            bnorm, *rest = _norms(b, *extra)
            r0norm, threshold = (rest or [bnorm])[0], max(self.tol * bnorm, self.atol)
        for _ in range(self.steps):
            if self.tol > 0:
                pnorm = math.sqrt(float(tree.sq_norm_list(p)))
                if pnorm <= threshold or self._diverging(pnorm, r0norm, it):
                    reason = None if pnorm <= threshold else ""
                    break
            ap = matvec(p)
            torch._foreach_add_(p, ap, alpha=-self.lr)
            torch._foreach_add_(acc, p)
            it += 1
        torch._foreach_mul_(acc, self.lr)
        if x0 is not None:
            torch._foreach_add_(acc, x0)
        # one check at the end (one device sync, not one per term): NaN and inf persist in the
        # sum, so a term that overflowed anywhere shows here; ‖b‖ and ‖r₀‖ come with it
        total, pnorm, bnorm, *rest = _norms(acc, p, b, *extra)
        r0norm, threshold = (rest or [bnorm])[0], max(self.tol * bnorm, self.atol)
        if not math.isfinite(total):
            raise self._non_finite(bnorm, pnorm, total, it)
        if reason is None and self._diverging(pnorm, r0norm, it):
            reason = ""
        return self._report(acc, it, pnorm, threshold, reason)

    def _non_finite(self, b_norm: float, last: float, total: float, it: int) -> FloatingPointError:
        fix = _richardson_hint(self.lr)
        head = f"Neumann: the solution is non-finite ({total}) after {it} iterations"
        if not math.isfinite(b_norm):
            return FloatingPointError(f"{head}; the right-hand side b is not finite")
        if math.isnan(last):
            return FloatingPointError(
                f"{head}; the matrix-vector product produced NaN, or a term overflowed; {fix}")
        return DivergenceError(f"{head}; the terms grew from ‖b‖ = {b_norm:.3g} to {last:.3g}; {fix}")


def _norms(*lists: list[torch.Tensor]) -> list[float]:
    """The norms of ``lists`` (possibly inf/NaN) in one device sync."""
    return [math.sqrt(v) for v in torch.stack([tree.sq_norm_list(x) for x in lists]).tolist()]


@dataclass(frozen=True)
class FixedPoint(IterativeSolver):
    """Richardson fixed-point iteration x ← x + lr (b − A x), started at x = 0 (or ``init``).

    Stops when ‖b − A x‖ ≤ max(tol·‖b‖, atol) (``converged=True``) or after ``maxiter``
    updates. Each update's residual b − A x is computed (the first update needs none, so
    ``maxiter`` matvecs at most, + 1 with ``init``): ``info["residual"]`` is the true
    residual of the returned x. With ``tol = 0`` its x equals ``Neumann(steps=maxiter − 1,
    lr)``'s; unlike Neumann it stops early once converged. Converges for symmetric
    positive-definite A when 0 < lr < 2 / λ_max(A); a residual above
    ``divergence_factor``·‖r₀‖ is divergence (:class:`IterativeSolver`).
    """

    maxiter: int = 100
    lr: float = 1.0
    tol: float = 1e-6
    atol: float = 0.0

    def _hint(self) -> str:
        return f"raise maxiter (now {self.maxiter}); " + _richardson_hint(self.lr)

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "residual", "converged"})``; see the class docstring."""
        b = list(b)
        bnorm = math.sqrt(check_finite(float(tree.sq_norm_list(b)), "FixedPoint", "‖b‖²", 0))
        threshold = max(self.tol * bnorm, self.atol)
        if init is None:
            x, r, rnorm = tree.zeros_like_list(b), [t.clone() for t in b], bnorm
        else:
            x = check_init(init, b, "FixedPoint")
            r = residual_of(matvec, b, x)
            rnorm = math.sqrt(check_finite(float(tree.sq_norm_list(r)), "FixedPoint", "‖r‖²", 0))
        r0norm, it, reason = rnorm, 0, None
        while it < self.maxiter and rnorm > threshold:
            torch._foreach_add_(x, r, alpha=self.lr)
            it += 1
            r = residual_of(matvec, b, x)
            rnorm = math.sqrt(check_finite(float(tree.sq_norm_list(r)), "FixedPoint", "‖r‖²", it))
            if self._diverging(rnorm, r0norm, it):
                reason = ""
                break
        return self._report(x, it, rnorm, threshold, reason)
