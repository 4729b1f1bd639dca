"""Linear solvers for A x = b where A is only available as a matrix-vector product.

Each solver is a frozen dataclass, callable as ``solver(matvec, b) -> x`` over pytrees:
``matvec`` maps a pytree shaped like ``b`` to a pytree shaped like ``b``. In implicit
differentiation A is the lower-level Hessian ∇²_θθ g (symmetric, positive definite near a
strict minimum) and b = ∇_θ f.

Internally every solver runs on flat lists of leaves (``solve_list``), so that the hot loop
never walks the tree; :mod:`bilevel.hypergrad` calls ``solve_list`` directly.

=============  ===========================================  ============================
solver         iteration                                   matvecs
=============  ===========================================  ============================
CG             conjugate gradients (A symmetric pos. def.)  ≤ maxiter
Neumann        x = lr Σ_{k=0}^{steps} (I − lr A)^k b         steps
FixedPoint     x ← x + lr (b − A x) until ‖b − Ax‖ ≤ tol‖b‖  ≤ maxiter − 1
Dense          materializes A column by column, LU solve    n (= total size of b)
=============  ===========================================  ============================
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import tree
from ._checks import check_int, check_nonnegative, check_positive

__all__ = ["CG", "Dense", "FixedPoint", "LinearSolver", "Neumann"]

ListMatvec = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _as_list_matvec(matvec: Callable[[Any], Any], spec: tree.TreeSpec) -> ListMatvec:
    def mv(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        out, out_spec = tree.flatten(matvec(tree.unflatten(xs, spec)), name="matvec(x)")
        if out_spec != spec:
            raise ValueError(
                "matvec must return a pytree with the structure of its input, got "
                f"{out_spec} for input {spec}"
            )
        return out

    return mv


def _finite(value: float, solver: str, what: str, iteration: int) -> float:
    if not math.isfinite(value):
        raise FloatingPointError(
            f"{solver}: {what} is {value} at iteration {iteration}; the matrix-vector "
            "product produced non-finite values, or the iteration diverged (a singular "
            "operator with a right-hand side outside its range, or lr too large)"
        )
    return value


class LinearSolver:
    """Base class: ``__call__`` over pytrees, ``solve_list`` over flat lists of leaves."""

    def solve_list(
        self, matvec: ListMatvec, b: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], dict[str, float]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, matvec: Callable[[Any], Any], b: Any) -> Any:
        """Solve ``matvec(x) = b`` for ``x`` (a pytree shaped like ``b``)."""
        bl, spec = tree.flatten(b, name="b")
        x, _ = self.solve_list(_as_list_matvec(matvec, spec), bl)
        return tree.unflatten(x, spec)


@dataclass(frozen=True)
class CG(LinearSolver):
    """Conjugate gradients for symmetric positive-definite A.

    Stops when ‖b − A x‖ ≤ max(tol·‖b‖, atol) or after ``maxiter`` matvecs. b = 0 returns
    x = 0 exactly with no matvec. ``maxiter`` must be ≥ 1: zero iterations would silently
    return x = 0, a wrong answer for every b ≠ 0 (torchopt #222). If A is not positive
    definite along a search direction (pᵀAp ≤ 0, e.g. a non-convex lower level) CG stops
    there with a warning and returns the current iterate.

    Each iteration updates the residual recursively, r ← r − α A p, and uses that updated
    residual for β and for the stopping test (the stale-residual bug of betty #15).
    """

    maxiter: int = 100
    tol: float = 1e-6
    atol: float = 0.0

    def __post_init__(self) -> None:
        check_int("CG", "maxiter", self.maxiter, minimum=1)
        check_nonnegative("CG", "tol", self.tol)
        check_nonnegative("CG", "atol", self.atol)

    def solve_list(
        self, matvec: ListMatvec, b: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        b = list(b)
        x = tree.zeros_like_list(b)
        rr = float(tree.sq_norm_list(b))
        _finite(rr, "CG", "‖b‖²", 0)
        threshold = max(self.tol * math.sqrt(rr), self.atol)
        if rr == 0.0:
            return x, {"iterations": 0.0, "residual": 0.0}
        r = [t.clone() for t in b]
        p = [t.clone() for t in b]
        it = 0
        while it < self.maxiter and math.sqrt(rr) > threshold:
            ap = matvec(p)
            it += 1
            pap = _finite(float(tree.dot_list(p, ap)), "CG", "pᵀAp", it)
            if pap <= 0.0:
                warnings.warn(
                    f"CG: the operator is not positive definite along the search direction "
                    f"(pᵀAp = {pap:.3e} at iteration {it}); returning the current iterate",
                    RuntimeWarning,
                    stacklevel=3,
                )
                break
            alpha = rr / pap
            torch._foreach_add_(x, p, alpha=alpha)
            torch._foreach_add_(r, ap, alpha=-alpha)
            rr_new = _finite(float(tree.sq_norm_list(r)), "CG", "‖r‖²", it)
            beta = rr_new / rr
            rr = rr_new
            # p ← r + β p, in place
            torch._foreach_mul_(p, beta)
            torch._foreach_add_(p, r)
        return x, {"iterations": float(it), "residual": math.sqrt(rr)}


@dataclass(frozen=True)
class Neumann(LinearSolver):
    """Truncated Neumann series  A⁻¹ b ≈ lr Σ_{k=0}^{steps} (I − lr A)^k b.

    Converges as steps → ∞ when 0 < lr < 2 / λ_max(A) and A is positive definite; the error
    shrinks like (1 − lr·λ_min)^{steps}. ``steps = 0`` gives lr·b (one term), never zero.
    Uses exactly ``steps`` matvecs (Lorraine et al., 2020). A sum that is not finite at the end
    (a diverging series overflows to inf, then NaN) raises ``FloatingPointError``, as
    `FixedPoint` and `CG` do, instead of returning it.
    """

    steps: int
    lr: float

    def __post_init__(self) -> None:
        check_int("Neumann", "steps", self.steps, minimum=0)
        check_positive("Neumann", "lr", self.lr)

    def solve_list(
        self, matvec: ListMatvec, b: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        p = [t.clone() for t in b]  # current term (I − lr A)^k b
        acc = [t.clone() for t in b]  # running sum of terms
        for _ in range(self.steps):
            ap = matvec(p)
            torch._foreach_add_(p, ap, alpha=-self.lr)
            torch._foreach_add_(acc, p)
        torch._foreach_mul_(acc, self.lr)
        # one check at the end (one device sync, not one per term): NaN and inf persist in the
        # sum, so a term that overflowed anywhere shows here
        total = float(tree.sq_norm_list(acc))
        if not math.isfinite(total):
            b_norm = math.sqrt(float(tree.sq_norm_list(list(b))))
            last = math.sqrt(float(tree.sq_norm_list(p)))
            fix = f"it diverges unless 0 < lr < 2 / λ_max(A) and A is positive definite: lower lr (now {self.lr:g}) or use CG"
            if not math.isfinite(b_norm):
                cause = "the right-hand side b is not finite"
            elif math.isnan(last):
                cause = f"the matrix-vector product produced NaN, or a term overflowed; {fix}"
            else:
                cause = f"the terms grew from ‖b‖ = {b_norm:.3g} to {last:.3g}; {fix}"
            raise FloatingPointError(
                f"Neumann: the solution is non-finite ({total}) after {self.steps} iterations; "
                f"{cause}"
            )
        return acc, {"iterations": float(self.steps)}


@dataclass(frozen=True)
class FixedPoint(LinearSolver):
    """Richardson fixed-point iteration x ← x + lr (b − A x), started at x = 0.

    Stops when ‖b − A x‖ ≤ max(tol·‖b‖, atol) or after ``maxiter`` updates (maxiter − 1
    matvecs, the first update needs none). With ``tol = 0`` it equals
    ``Neumann(steps=maxiter − 1, lr)``; unlike Neumann it stops early once converged.
    Converges for symmetric positive-definite A when 0 < lr < 2 / λ_max(A).
    """

    maxiter: int = 100
    lr: float = 1.0
    tol: float = 1e-6
    atol: float = 0.0

    def __post_init__(self) -> None:
        check_int("FixedPoint", "maxiter", self.maxiter, minimum=1)
        check_positive("FixedPoint", "lr", self.lr)
        check_nonnegative("FixedPoint", "tol", self.tol)
        check_nonnegative("FixedPoint", "atol", self.atol)

    def solve_list(
        self, matvec: ListMatvec, b: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        b = list(b)
        bnorm = math.sqrt(_finite(float(tree.sq_norm_list(b)), "FixedPoint", "‖b‖²", 0))
        threshold = max(self.tol * bnorm, self.atol)
        x = tree.zeros_like_list(b)
        r = [t.clone() for t in b]  # residual b − A x at x = 0
        rnorm = bnorm
        it = 0
        while it < self.maxiter:
            if rnorm <= threshold:
                break
            torch._foreach_add_(x, r, alpha=self.lr)
            it += 1
            if it == self.maxiter:
                break  # no need to pay for a residual that nobody reads
            ax = matvec(x)
            r = torch._foreach_sub(b, ax)
            rnorm = math.sqrt(_finite(float(tree.sq_norm_list(r)), "FixedPoint", "‖r‖²", it))
        return x, {"iterations": float(it), "residual": rnorm}


@dataclass(frozen=True)
class Dense(LinearSolver):
    """Exact solve: materializes A (n × n) from n matvecs with unit vectors, then LU.

    A singular A gets the minimum-norm least-squares solution (pseudo-inverse). For small
    problems and as a test oracle only; refuses n > ``max_size`` because the cost is n
    matvecs and n² memory.
    """

    max_size: int = 4096

    def __post_init__(self) -> None:
        check_int("Dense", "max_size", self.max_size, minimum=1)

    def solve_list(
        self, matvec: ListMatvec, b: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        b = list(b)
        n = tree.numel_list(b)
        if n > self.max_size:
            raise ValueError(
                f"Dense: the system has {n} unknowns, more than max_size={self.max_size}; "
                "use CG, Neumann or FixedPoint for large inner variables"
            )
        if n == 0:
            return [t.clone() for t in b], {"iterations": 0.0}
        dtype = b[0].dtype
        for t in b[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        flat_b = torch.cat([t.reshape(-1).to(dtype) for t in b])
        eye = torch.eye(n, dtype=dtype, device=flat_b.device)
        columns = [_flat(matvec(_split(eye[i], b))) for i in range(n)]
        a = torch.stack(columns, dim=1)  # column i = A e_i
        if not bool(torch.isfinite(a).all()):
            raise FloatingPointError("Dense: the materialized matrix has non-finite entries")
        x, info = torch.linalg.solve_ex(a, flat_b)
        if int(info) != 0:
            # Singular A, e.g. inner variables that g ignores (zero rows and columns of the
            # Hessian): the minimum-norm least-squares solution, which is also what CG
            # started at x = 0 converges to on a consistent singular system.
            x = torch.linalg.pinv(a) @ flat_b
        return _split(x, b), {"iterations": float(n)}


def _flat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in xs])


def _split(vec: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in like:
        out.append(vec[start : start + t.numel()].reshape(t.shape).to(t.dtype))
        start += t.numel()
    return out
