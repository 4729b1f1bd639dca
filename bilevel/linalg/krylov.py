"""Krylov solvers: CG (symmetric positive definite), MINRES (symmetric, possibly indefinite)
and NormalCG (CG on the normal equations: least squares, singular systems)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import tree
from ..errors import NegativeCurvatureError
from ._base import (
    Info,
    IterativeSolver,
    ListMatvec,
    check_choice,
    check_finite,
    check_init,
    residual_of,
    with_ridge,
)

__all__ = ["CG", "MINRES", "NormalCG"]

NEGATIVE_CURVATURE_POLICIES = ("stop", "raise")


def _start(
    solver: IterativeSolver, matvec: ListMatvec, b: list[torch.Tensor],
    init: Sequence[torch.Tensor] | None,
) -> tuple[ListMatvec, list[torch.Tensor], list[torch.Tensor], float, float]:
    """``(A + ridge·I, x₀, r₀ = b − A x₀, ‖b‖, ‖r₀‖²)``; x₀ = 0 (no matvec) without ``init``."""
    owner = type(solver).__name__
    # ignored attr-defined: ridge is a field of each Krylov dataclass, not of IterativeSolver
    matvec = with_ridge(matvec, solver.ridge)  # type: ignore[attr-defined]
    bb = check_finite(float(tree.sq_norm_list(b)), owner, "‖b‖²", 0)
    if init is None:
        return matvec, tree.zeros_like_list(b), [t.clone() for t in b], math.sqrt(bb), bb
    x = check_init(init, b, owner)
    r = residual_of(matvec, b, x)
    rr = check_finite(float(tree.sq_norm_list(r)), owner, "‖b − A·init‖²", 0)
    return matvec, x, r, math.sqrt(bb), rr


@dataclass(frozen=True)
class CG(IterativeSolver):
    """Conjugate gradients for symmetric positive-definite A (solves (A + ridge·I) x = b).

    Stops when ‖b − A x‖ ≤ max(tol·‖b‖, atol) (``converged=True``) or after ``maxiter``
    matvecs. b = 0 returns x = 0 exactly with no matvec. ``maxiter`` must be ≥ 1: zero
    iterations would silently return x = 0, a wrong answer for every b ≠ 0 (torchopt #222).
    ``init`` (warm start) costs one matvec for the starting residual b − A·init; an ``init``
    that already meets the tolerance is returned after 0 iterations. ``ridge`` > 0
    (Tikhonov damping) makes a merely semi-definite Hessian definite, at the price of a
    biased solution.

    ``negative_curvature`` says what happens where A is not positive definite along a search
    direction p: pᵀAp ≤ 0, or pᵀAp/‖p‖² ≤ 10·ε·(the largest pᵀAp/‖p‖² seen), a direction
    along which A is numerically singular (there CG's step length α = ‖r‖²/pᵀAp would send
    x off by 1e16 on a singular system with b outside A's range). ``"stop"`` (the default)
    returns the current iterate with ``converged=False`` and a ``ConvergenceWarning``
    (silenced by ``on_unconverged="ignore"``); ``"raise"`` raises
    :class:`bilevel.errors.NegativeCurvatureError`. Neither gives the solution of an
    indefinite system: on a non-convex lower level (a neural network's Hessian) use
    :class:`MINRES` (symmetric indefinite) or :class:`NormalCG` (singular); see the
    measurements in docs/bilevel.md, "Which linear solver?".

    Each iteration updates the residual recursively, r ← r − α A p, and uses that updated
    residual for β, for the stopping test and for ``info["residual"]`` (the stale-residual
    bug of betty #15). Convergence and divergence: :class:`IterativeSolver`, except that
    ``divergence_factor`` defaults to 1e6 (CG's residual may grow transiently, by ~√κ/20).
    """

    maxiter: int = 100
    tol: float = 1e-6
    atol: float = 0.0
    ridge: float = 0.0
    negative_curvature: str = "stop"
    # CG's residual is not monotone: on SPD systems it grows transiently by about √κ / 20
    # (measured: 1.5×, 4.4×, 38×, 480× at κ = 1e2, 1e4, 1e6, 1e8), so 1e3 would call a
    # legitimate solve with κ ≳ 1e9 divergent; 1e6 needs κ ≈ 4e14, past float64's reach
    divergence_factor: float = field(default=1e6, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("CG", "negative_curvature", self.negative_curvature,
                      NEGATIVE_CURVATURE_POLICIES)

    def _hint(self) -> str:
        return (f"raise maxiter (now {self.maxiter}) or tol (now {self.tol:g}); an indefinite or "
                "singular Hessian needs MINRES or NormalCG")

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "residual", "converged"})`` for (A + ridge·I) x = b."""
        matvec, x, r, bnorm, rr = _start(self, matvec, list(b), init)
        if bnorm == 0.0:
            return self._report(tree.zeros_like_list(b), 0, 0.0, 0.0)
        return self._iterate(matvec, x, r, rr, max(self.tol * bnorm, self.atol))

    def _iterate(
        self, matvec: ListMatvec, x: list[torch.Tensor], r: list[torch.Tensor], rr: float,
        threshold: float,
    ) -> tuple[list[torch.Tensor], Info]:
        """The CG loop from iterate ``x`` with residual ``r`` (‖r‖² = rr), in place."""
        p = [t.clone() for t in r]
        r0norm, it, top, reason = math.sqrt(rr), 0, 0.0, None
        pp = rr  # ‖p‖², by the recurrence below (no extra inner product per iteration)
        eps = 10 * torch.finfo(r[0].dtype).eps  # not n·ε: n = 1e6 in float32 would be 0.1
        while it < self.maxiter and math.sqrt(rr) > threshold:
            ap = matvec(p)
            it += 1
            pap = check_finite(float(tree.dot_list(p, ap)), "CG", "pᵀAp", it)
            top = max(top, pap / pp) if pp > 0 else top
            if pap <= 0.0 or pap <= eps * top * pp:
                reason = self._curvature(pap, it)
                break
            alpha = rr / pap
            torch._foreach_add_(x, p, alpha=alpha)
            torch._foreach_add_(r, ap, alpha=-alpha)
            rr_new = check_finite(float(tree.sq_norm_list(r)), "CG", "‖r‖²", it)
            beta, rr = rr_new / rr, rr_new
            # p ← r + β p with rᵀp = 0 (CG's residuals are orthogonal to the previous search
            # directions): ‖p‖² ← ‖r‖² + β²‖p‖², exact up to round-off, enough for the
            # 10·ε curvature test it serves
            pp = rr + beta * beta * pp
            if self._diverging(math.sqrt(rr), r0norm, it):
                reason = ""
                break
            torch._foreach_mul_(p, beta)  # p ← r + β p, in place
            torch._foreach_add_(p, r)
        return self._report(x, it, math.sqrt(rr), threshold, reason, stacklevel=5)

    def _curvature(self, pap: float, it: int) -> str:
        """The message for a direction of non-positive curvature; raises under "raise"."""
        msg = (
            f"the operator is not positive definite along the search direction (pᵀAp = "
            f"{pap:.3e} at iteration {it}); CG solves symmetric positive-definite systems only: "
            "use MINRES for an indefinite Hessian (a non-convex lower level), NormalCG or "
            "Dense for a singular one, or ridge > 0"
        )
        if self.negative_curvature == "raise":
            raise NegativeCurvatureError(f"CG: {msg}")
        return f"{msg}; returning the current iterate (negative_curvature='stop')"


@dataclass(frozen=True)
class MINRES(IterativeSolver):
    """MINRES (Paige & Saunders, "Solution of sparse indefinite systems of linear equations",
    SIAM J. Numer. Anal. 12(4), 1975) for symmetric A, definite or not: x_k minimizes
    ‖b − (A + ridge·I) x‖ over the Krylov space x₀ + span{r₀, A r₀, …, A^{k−1} r₀}.

    The right solver for a non-convex lower level (a saddle or a non-strict minimum of a
    neural network's loss: a symmetric, indefinite, nonsingular Hessian), where CG breaks down
    at the first direction of negative curvature. One matvec and two inner products per
    iteration, five θ-sized vectors of memory (CG: three). Stops when the residual norm,
    which MINRES tracks as φ_k = ‖b − A x_k‖ (the recursive residual, exact in exact
    arithmetic, never increasing), is ≤ max(tol·‖b‖, atol), after ``maxiter`` iterations,
    or when the Lanczos process ends (β_{k+1} = 0: x_k is then the minimizer over the whole
    reachable space). No preconditioner. On a singular A with b outside its range MINRES
    converges to a least-squares solution, not necessarily the minimum-norm one: use
    NormalCG or Dense there. Convergence and divergence: :class:`IterativeSolver`.
    """

    maxiter: int = 100
    tol: float = 1e-6
    atol: float = 0.0
    ridge: float = 0.0

    def _hint(self) -> str:
        return f"raise maxiter (now {self.maxiter}) or tol (now {self.tol:g})"

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "residual", "converged"})`` for (A + ridge·I) x = b."""
        matvec, x, r, bnorm, rr = _start(self, matvec, list(b), init)
        r0norm = math.sqrt(rr)
        threshold = max(self.tol * bnorm, self.atol)
        if r0norm <= threshold or r0norm == 0.0:
            return self._report(x if bnorm > 0 else tree.zeros_like_list(b), 0, r0norm, threshold)
        return self._iterate(matvec, x, r, r0norm, threshold)

    def _iterate(
        self, matvec: ListMatvec, x: list[torch.Tensor], r2: list[torch.Tensor], beta: float,
        threshold: float,
    ) -> tuple[list[torch.Tensor], Info]:
        """Paige–Saunders recurrences (as in scipy.sparse.linalg.minres without M)."""
        r1, y, r0norm = r2, r2, beta
        w, w2 = tree.zeros_like_list(x), tree.zeros_like_list(x)
        oldb, dbar, epsln, phibar, cs, sn = 0.0, 0.0, 0.0, beta, -1.0, 0.0
        eps, it, reason = torch.finfo(x[0].dtype).eps, 0, None
        while it < self.maxiter and phibar > threshold and beta > 0.0:
            it += 1
            v = list(torch._foreach_div(y, beta))  # the Lanczos vector v_k
            y = matvec(v)
            if it >= 2:
                y = list(torch._foreach_sub(y, r1, alpha=beta / oldb))
            alfa = check_finite(float(tree.dot_list(v, y)), "MINRES", "vᵀAv", it)
            y = list(torch._foreach_sub(y, r2, alpha=alfa / beta))
            r1, r2 = r2, y
            oldb, beta = beta, math.sqrt(check_finite(float(tree.sq_norm_list(y)), "MINRES", "β²", it))
            # apply the previous Givens rotation, then the new one that zeroes β
            oldeps, delta = epsln, cs * dbar + sn * alfa
            gbar, epsln, dbar = sn * dbar - cs * alfa, sn * beta, -cs * beta
            gamma = max(math.hypot(gbar, beta), eps)
            cs, sn = gbar / gamma, beta / gamma
            phi, phibar = cs * phibar, sn * phibar
            w1, w2 = w2, w
            # w ← (v − ε w₁ − δ w₂) / γ
            w = list(torch._foreach_sub(torch._foreach_sub(v, w1, alpha=oldeps), w2, alpha=delta))
            torch._foreach_div_(w, gamma)
            torch._foreach_add_(x, w, alpha=phi)
            # φ_k never increases in exact arithmetic; checked so that a broken matvec (not
            # symmetric: MINRES assumes A = Aᵀ) cannot pass as a result
            if self._diverging(phibar, r0norm, it):
                reason = ""
                break
        return self._report(x, it, phibar, threshold, reason, stacklevel=5)


@dataclass(frozen=True)
class NormalCG(IterativeSolver):
    """CG on the normal equations Aᵀ A x = Aᵀ b (CGLS; Hestenes & Stiefel 1952, §10), A ↦
    A + ridge·I: the least-squares solution of a singular or inconsistent system and, from
    x₀ = 0, its minimum-norm one (the pseudo-inverse A⁺ b: every iterate lies in range(Aᵀ)).
    torchopt's default linear solve (``torchopt.linear_solve.solve_normal_cg``).

    Only A's matvec is given, so Aᵀ v is computed as A v: this holds for the symmetric
    Hessians of implicit differentiation, and is wrong for a non-symmetric A. Two matvecs per
    iteration; ``info["iterations"]`` counts iterations and ``info["matvecs"]`` the matvecs
    (2 per iteration + 1 for Aᵀ r₀, + 1 more with ``init``, and +1 with ``init`` for ‖Aᵀ b‖).
    Converges like CG with the condition number squared: slower than MINRES on a nonsingular
    system, but also right on a singular one.

    ``converged`` when the residual s = b − A x (tracked recursively, s ← s − α A p:
    ``info["residual"]``) is ≤ max(tol·‖b‖, atol) (a consistent system solved), or when the
    normal residual ‖Aᵀ s‖ (``info["normal_residual"]``) is ≤ tol·‖Aᵀ b‖ (the least-squares
    solution of an inconsistent one). Convergence and divergence: :class:`IterativeSolver`.
    """

    maxiter: int = 100
    tol: float = 1e-6
    atol: float = 0.0
    ridge: float = 0.0

    def _hint(self) -> str:
        return (f"raise maxiter (now {self.maxiter}; the normal equations square the condition "
                f"number) or tol (now {self.tol:g}); on a nonsingular Hessian MINRES is faster")

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "residual", "converged", "normal_residual", "matvecs"})``."""
        b = list(b)
        matvec, x, s, bnorm, ss = _start(self, matvec, b, init)
        s0norm = math.sqrt(ss)
        threshold = max(self.tol * bnorm, self.atol)
        if bnorm == 0.0:
            return self._report(tree.zeros_like_list(b), 0, 0.0, 0.0, normal_residual=0.0,
                                matvecs=0.0)
        r = matvec(s)  # Aᵀ s₀
        atb = r if init is None else matvec(b)
        atb_norm = math.sqrt(check_finite(float(tree.sq_norm_list(atb)), "NormalCG", "‖Aᵀb‖²", 0))
        extra = 1.0 if init is None else 3.0
        return self._iterate(matvec, x, s, r, (s0norm, threshold, self.tol * atb_norm), extra)

    def _iterate(
        self, matvec: ListMatvec, x: list[torch.Tensor], s: list[torch.Tensor],
        r: list[torch.Tensor], norms: tuple[float, float, float], extra: float,
    ) -> tuple[list[torch.Tensor], Info]:
        """CGLS from x with s = b − A x and r = Aᵀ s, in place."""
        s0norm, threshold, normal_threshold = norms
        p = [t.clone() for t in r]
        gamma = check_finite(float(tree.sq_norm_list(r)), "NormalCG", "‖Aᵀs‖²", 0)
        snorm, it, reason = s0norm, 0, None

        def done() -> bool:
            return snorm <= threshold or math.sqrt(gamma) <= normal_threshold or gamma == 0.0

        while it < self.maxiter and not done():
            q = matvec(p)
            it += 1
            delta = check_finite(float(tree.sq_norm_list(q)), "NormalCG", "‖A p‖²", it)
            if delta == 0.0:  # p ≠ 0 in range(Aᵀ) with A p = 0: only by round-off
                break
            alpha = gamma / delta
            torch._foreach_add_(x, p, alpha=alpha)
            torch._foreach_add_(s, q, alpha=-alpha)
            r = matvec(s)
            gamma, old = check_finite(float(tree.sq_norm_list(r)), "NormalCG", "‖Aᵀs‖²", it), gamma
            snorm = math.sqrt(float(tree.sq_norm_list(s)))
            if self._diverging(snorm, s0norm, it):
                reason = ""
                break
            torch._foreach_mul_(p, gamma / old)  # p ← r + β p
            torch._foreach_add_(p, r)
        # converged on either test; the warning, if any, quotes the ‖b − A x‖ one
        return self._report(
            x, it, snorm, snorm if done() else threshold, reason, normal_residual=math.sqrt(gamma),
            matvecs=2.0 * it + extra, stacklevel=5,
        )
