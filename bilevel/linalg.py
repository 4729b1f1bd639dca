"""Linear solvers for A x = b where A is only available as a matrix-vector product.

The protocol (what ``Implicit(linear_solver=...)`` and ``AID(linear_solver=...)`` accept)
is any callable

    solve(matvec, b, init=None) -> (x, info)

where ``b``, ``init`` and ``x`` are *lists of tensors* (the leaves of the inner variables θ,
in ``bilevel.tree.leaves`` order; a list is itself a pytree, so ``bilevel.tree`` works on
it), ``matvec`` maps such a list to a list of the same shapes, ``init`` is a starting guess
for x (None: start from 0; a solver is free to ignore it) and ``info`` is a dict of Python
floats or 0-dim tensors (diagnostics; ``hypergrad(..., return_info=True)`` and the AID
solver report them as ``solver_<key>``). In implicit differentiation A is the lower-level
Hessian ∇²_θθ g (symmetric, positive definite near a strict minimum) and b = ∇_θ f.

The call signature is jaxopt's (``jaxopt.linear_solve.solve_cg(matvec, b, ridge=None,
init=None)``), but jaxopt's and torchopt's linear solves return ``x`` alone, not
``(x, info)``; :func:`returns_x_only` adapts such a callable (``info`` is then empty), and a
solver that returns anything but a ``(x, info)`` pair is refused with a ``TypeError`` naming
this protocol and the adapter.

The shipped solvers are frozen dataclasses with checked options; ``solver.solve`` is the
protocol callable, and ``solve_cg(**options)`` etc. return it (an unknown option is a
``ValueError`` naming it). Called directly, ``solver(matvec, b)`` solves over any pytree and
returns x alone.

=============  ===========================================  ============================
solver         iteration                                   matvecs
=============  ===========================================  ============================
CG             conjugate gradients (A symmetric pos. def.)  ≤ maxiter (+1 with init)
Neumann        x = lr Σ_{k=0}^{steps} (I − lr A)^k b         steps (+1 with init)
FixedPoint     x ← x + lr (b − A x) until ‖b − Ax‖ ≤ tol‖b‖  ≤ maxiter − 1 (+1 with init)
Dense          materializes A column by column, LU solve    n (= total size of b)
=============  ===========================================  ============================

``info`` keys: CG ``iterations`` and ``residual`` (‖b − A x‖ of the recursive residual);
Neumann ``iterations``; FixedPoint ``iterations`` and ``residual``; Dense ``iterations``
(= n). ``iterations`` counts the matvecs of the iteration itself, not the one that forms
the starting residual b − A·init.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from . import tree
from ._checks import check_int, check_nonnegative, check_positive

__all__ = [
    "CG",
    "Dense",
    "FixedPoint",
    "LinearSolve",
    "LinearSolver",
    "Neumann",
    "as_linear_solve",
    "returns_x_only",
    "solve_cg",
    "solve_dense",
    "solve_fixed_point",
    "solve_neumann",
]

ListMatvec = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Info = dict[str, "float | torch.Tensor"]


class LinearSolve(Protocol):
    """``solve(matvec, b, init=None) -> (x, info)`` over lists of tensors (module docstring)."""

    def __call__(
        self,
        matvec: ListMatvec,
        b: list[torch.Tensor],
        init: list[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]: ...


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


def _with_ridge(matvec: ListMatvec, ridge: float) -> ListMatvec:
    """x ↦ (A + ridge·I) x; ``matvec`` itself when ridge = 0 (no extra operation)."""
    if ridge == 0.0:
        return matvec
    return lambda xs: torch._foreach_add(matvec(xs), xs, alpha=ridge)


def _check_init(
    init: Sequence[torch.Tensor], b: Sequence[torch.Tensor], owner: str
) -> list[torch.Tensor]:
    """A fresh copy of ``init`` in b's dtypes and devices; ValueError unless shaped like b."""
    init = list(init)
    if len(init) != len(b) or any(x.shape != y.shape for x, y in zip(init, b)):
        raise ValueError(
            f"{owner}: init must be shaped like b, got shapes "
            f"{[tuple(x.shape) for x in init]} for b of shapes {[tuple(y.shape) for y in b]}"
        )
    return [x.detach().to(dtype=y.dtype, device=y.device).clone() for x, y in zip(init, b)]


def _residual(
    matvec: ListMatvec, b: list[torch.Tensor], x: list[torch.Tensor]
) -> list[torch.Tensor]:
    """b − A x (a new list)."""
    return torch._foreach_sub(b, matvec(x))


def _finite(value: float, solver: str, what: str, iteration: int) -> float:
    if not math.isfinite(value):
        raise FloatingPointError(
            f"{solver}: {what} is {value} at iteration {iteration}; the matrix-vector "
            "product produced non-finite values, or the iteration diverged (a singular "
            "operator with a right-hand side outside its range, or lr too large)"
        )
    return value


class LinearSolver:
    """Base class: ``solve`` is the protocol over lists, ``__call__`` a pytree convenience."""

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, matvec: Callable[[Any], Any], b: Any, init: Any = None) -> Any:
        """Solve ``matvec(x) = b`` for ``x`` (a pytree shaped like ``b``); returns x alone."""
        bl, spec = tree.flatten(b, name="b")
        il = None if init is None else tree.flatten(init, name="init")[0]
        x, _ = self.solve(_as_list_matvec(matvec, spec), bl, il)
        return tree.unflatten(x, spec)


def as_linear_solve(solver: object, owner: str) -> LinearSolve:
    """The protocol callable for ``solver``: a shipped solver's ``solve``, or ``solver``.

    Raises ``TypeError`` naming ``owner`` unless ``solver`` is a `LinearSolver` or a
    callable that accepts ``(matvec, b, init=...)``.
    """
    if isinstance(solver, LinearSolver):
        return solver.solve
    expected = (
        f"{owner}: linear_solver must be a bilevel.linalg solver (CG, Neumann, FixedPoint, "
        "Dense) or a callable solve(matvec, b, init=None) -> (x, info)"
    )
    if not callable(solver):
        raise TypeError(f"{expected}, got {type(solver).__name__}")
    try:
        inspect.signature(solver).bind(None, None, init=None)
    except TypeError as e:
        raise TypeError(f"{expected}; {solver!r} does not accept these arguments ({e})") from None
    except ValueError:  # no signature available (some builtins): trust the caller
        pass
    return solver  # type: ignore[return-value]


def returns_x_only(fn: Callable[..., Any]) -> LinearSolve:
    """Adapt a linear solve that returns ``x`` alone (jaxopt's and torchopt's convention) to
    this module's ``(x, info)`` protocol, with an empty ``info``.

    ``fn(matvec, b, init=...)`` is called with ``init`` only when its signature accepts an
    ``init`` argument (torchopt's solves take ``(matvec, b)`` only; jaxopt's take ``init``).
    ``b`` and ``x`` are lists of tensors, as everywhere in this module::

        Implicit(linear_solver=bilevel.linalg.returns_x_only(my_cg))
    """
    if not callable(fn):
        raise TypeError(f"returns_x_only: fn must be callable, got {type(fn).__name__}")
    try:
        params = inspect.signature(fn).parameters
        takes_init = "init" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
    except (TypeError, ValueError):  # no signature available: do not pass init
        takes_init = False
    name = getattr(fn, "__qualname__", type(fn).__name__)

    def solve(
        matvec: ListMatvec, b: list[torch.Tensor], init: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], Info]:
        x = fn(matvec, b, init=init) if takes_init else fn(matvec, b)
        return x, {}

    solve.__qualname__ = f"returns_x_only({name})"
    return solve


def solver_name(solver: object) -> str:
    """A readable name for a linear solver in error messages (``CG``, ``my_solve``)."""
    owner = getattr(solver, "__self__", None)  # a bound method such as CG(...).solve
    if isinstance(owner, LinearSolver):
        return type(owner).__name__
    if isinstance(solver, LinearSolver):
        return type(solver).__name__
    return getattr(solver, "__qualname__", None) or type(solver).__name__


def unpack_solution(result: object, solver: object, owner: str) -> tuple[Any, dict[str, Any]]:
    """Split a linear solver's return value into ``(x, info)``, or raise ``TypeError``
    naming the protocol: a solver returning ``x`` alone (a list of two tensors unpacks as
    a pair too) would otherwise fail with "not enough values to unpack" or, worse, run on
    with x's second leaf taken as ``info``."""
    if (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[1], Mapping)
    ):
        return result[0], dict(result[1])
    raise TypeError(
        f"{owner}: the linear solver {solver_name(solver)} returned "
        f"{type(result).__name__}, not a tuple (x, info) with info a dict; the protocol is "
        "solve(matvec, b, init=None) -> (x, info). A solver that returns x alone (jaxopt, "
        "torchopt) works through bilevel.linalg.returns_x_only(solve)"
    )


@dataclass(frozen=True)
class CG(LinearSolver):
    """Conjugate gradients for symmetric positive-definite A (solves (A + ridge·I) x = b).

    Stops when ‖b − A x‖ ≤ max(tol·‖b‖, atol) or after ``maxiter`` matvecs. b = 0 returns
    x = 0 exactly with no matvec. ``maxiter`` must be ≥ 1: zero iterations would silently
    return x = 0, a wrong answer for every b ≠ 0 (torchopt #222). If A is not positive
    definite along a search direction (pᵀAp ≤ 0, e.g. a non-convex lower level) CG stops
    there with a warning and returns the current iterate. ``init`` (warm start) costs one
    matvec for the starting residual b − A·init; an ``init`` that already meets the
    tolerance is returned after 0 iterations. ``ridge`` > 0 (Tikhonov damping) makes a
    merely semi-definite Hessian definite, at the price of a biased solution.

    Each iteration updates the residual recursively, r ← r − α A p, and uses that updated
    residual for β and for the stopping test (the stale-residual bug of betty #15).
    """

    maxiter: int = 100
    tol: float = 1e-6
    atol: float = 0.0
    ridge: float = 0.0

    def __post_init__(self) -> None:
        check_int("CG", "maxiter", self.maxiter, minimum=1)
        check_nonnegative("CG", "tol", self.tol)
        check_nonnegative("CG", "atol", self.atol)
        check_nonnegative("CG", "ridge", self.ridge)

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "residual"})`` for (A + ridge·I) x = b; see the class docstring."""
        b = list(b)
        matvec = _with_ridge(matvec, self.ridge)
        rr = float(tree.sq_norm_list(b))
        _finite(rr, "CG", "‖b‖²", 0)
        threshold = max(self.tol * math.sqrt(rr), self.atol)
        if rr == 0.0:
            return tree.zeros_like_list(b), {"iterations": 0.0, "residual": 0.0}
        if init is None:
            x, r = tree.zeros_like_list(b), [t.clone() for t in b]
        else:
            x = _check_init(init, b, "CG")
            r = _residual(matvec, b, x)
            rr = _finite(float(tree.sq_norm_list(r)), "CG", "‖b − A·init‖²", 0)
        return self._iterate(matvec, x, r, rr, threshold)

    def _iterate(
        self,
        matvec: ListMatvec,
        x: list[torch.Tensor],
        r: list[torch.Tensor],
        rr: float,
        threshold: float,
    ) -> tuple[list[torch.Tensor], Info]:
        """The CG loop from iterate ``x`` with residual ``r`` (‖r‖² = rr), in place."""
        p = [t.clone() for t in r]
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
                    stacklevel=4,
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
    Uses exactly ``steps`` matvecs (Lorraine et al., 2020), fewer when ``tol`` > 0 stops the
    series once a term's norm is ≤ tol·‖b‖ (one device sync per term; tol = 0, the default,
    never checks). ``init`` = x₀ sums the series for the correction instead,
    x = x₀ + lr Σ_k (I − lr A)^k (b − A x₀), one matvec more (a warm start: it continues the
    Richardson iteration from x₀). ``ridge`` replaces A by A + ridge·I. A sum that is not
    finite at the end (a diverging series overflows to inf, then NaN) raises
    ``FloatingPointError``, as `FixedPoint` and `CG` do, instead of returning it.
    """

    steps: int
    lr: float
    tol: float = 0.0
    ridge: float = 0.0

    def __post_init__(self) -> None:
        check_int("Neumann", "steps", self.steps, minimum=0)
        check_positive("Neumann", "lr", self.lr)
        check_nonnegative("Neumann", "tol", self.tol)
        check_nonnegative("Neumann", "ridge", self.ridge)

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations"})``; see the class docstring."""
        b = list(b)
        matvec = _with_ridge(matvec, self.ridge)
        x0 = None if init is None else _check_init(init, b, "Neumann")
        r0 = b if x0 is None else _residual(matvec, b, x0)
        p = [t.clone() for t in r0]  # current term (I − lr A)^k r0
        acc = [t.clone() for t in r0]  # running sum of terms
        threshold = self.tol * math.sqrt(float(tree.sq_norm_list(b))) if self.tol > 0 else 0.0
        it = 0
        for _ in range(self.steps):
            if self.tol > 0 and math.sqrt(float(tree.sq_norm_list(p))) <= threshold:
                break
            ap = matvec(p)
            torch._foreach_add_(p, ap, alpha=-self.lr)
            torch._foreach_add_(acc, p)
            it += 1
        torch._foreach_mul_(acc, self.lr)
        if x0 is not None:
            torch._foreach_add_(acc, x0)
        # one check at the end (one device sync, not one per term): NaN and inf persist in the
        # sum, so a term that overflowed anywhere shows here
        total = float(tree.sq_norm_list(acc))
        if not math.isfinite(total):
            raise FloatingPointError(self._divergence_message(b, p, total, it))
        return acc, {"iterations": float(it)}

    def _divergence_message(
        self, b: list[torch.Tensor], last_term: list[torch.Tensor], total: float, it: int
    ) -> str:
        b_norm = math.sqrt(float(tree.sq_norm_list(b)))
        last = math.sqrt(float(tree.sq_norm_list(last_term)))
        fix = (
            "it diverges unless 0 < lr < 2 / λ_max(A) and A is positive definite: lower lr "
            f"(now {self.lr:g}) or use CG"
        )
        if not math.isfinite(b_norm):
            cause = "the right-hand side b is not finite"
        elif math.isnan(last):
            cause = f"the matrix-vector product produced NaN, or a term overflowed; {fix}"
        else:
            cause = f"the terms grew from ‖b‖ = {b_norm:.3g} to {last:.3g}; {fix}"
        return f"Neumann: the solution is non-finite ({total}) after {it} iterations; {cause}"


@dataclass(frozen=True)
class FixedPoint(LinearSolver):
    """Richardson fixed-point iteration x ← x + lr (b − A x), started at x = 0 (or ``init``).

    Stops when ‖b − A x‖ ≤ max(tol·‖b‖, atol) or after ``maxiter`` updates (maxiter − 1
    matvecs, the first update needs none; with ``init`` one more, for b − A·init). With
    ``tol = 0`` it equals ``Neumann(steps=maxiter − 1, lr)``; unlike Neumann it stops early
    once converged. Converges for symmetric positive-definite A when 0 < lr < 2 / λ_max(A).
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

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "residual"})``; see the class docstring."""
        b = list(b)
        bnorm = math.sqrt(_finite(float(tree.sq_norm_list(b)), "FixedPoint", "‖b‖²", 0))
        threshold = max(self.tol * bnorm, self.atol)
        if init is None:
            x = tree.zeros_like_list(b)
            r = [t.clone() for t in b]  # residual b − A x at x = 0
            rnorm = bnorm
        else:
            x = _check_init(init, b, "FixedPoint")
            r = _residual(matvec, b, x)
            rnorm = math.sqrt(_finite(float(tree.sq_norm_list(r)), "FixedPoint", "‖r‖²", 0))
        it = 0
        while it < self.maxiter:
            if rnorm <= threshold:
                break
            torch._foreach_add_(x, r, alpha=self.lr)
            it += 1
            if it == self.maxiter:
                break  # no need to pay for a residual that nobody reads
            r = _residual(matvec, b, x)
            rnorm = math.sqrt(_finite(float(tree.sq_norm_list(r)), "FixedPoint", "‖r‖²", it))
        return x, {"iterations": float(it), "residual": rnorm}


@dataclass(frozen=True)
class Dense(LinearSolver):
    """Exact solve: materializes A (n × n) from n matvecs with unit vectors, then LU.

    A singular A gets the minimum-norm least-squares solution (pseudo-inverse). For small
    problems and as a test oracle only; refuses n > ``max_size`` because the cost is n
    matvecs and n² memory. ``init`` is accepted and ignored (the solve is exact).
    """

    max_size: int = 4096

    def __post_init__(self) -> None:
        check_int("Dense", "max_size", self.max_size, minimum=1)

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations": n})``; see the class docstring."""
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


def _factory(cls: type[LinearSolver], name: str, options: dict[str, Any]) -> LinearSolve:
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"{name}: unknown option {unknown[0]!r}; the options of {cls.__name__} are "
            f"{', '.join(known)}"
        )
    return cls(**options).solve


def solve_cg(**options: Any) -> LinearSolve:
    """``CG(**options).solve``: the protocol callable (options checked, unknown ones named)."""
    return _factory(CG, "solve_cg", options)


def solve_neumann(**options: Any) -> LinearSolve:
    """``Neumann(**options).solve`` (needs ``steps`` and ``lr``)."""
    return _factory(Neumann, "solve_neumann", options)


def solve_fixed_point(**options: Any) -> LinearSolve:
    """``FixedPoint(**options).solve``."""
    return _factory(FixedPoint, "solve_fixed_point", options)


def solve_dense(**options: Any) -> LinearSolve:
    """``Dense(**options).solve``."""
    return _factory(Dense, "solve_dense", options)


def _flat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in xs])


def _split(vec: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in like:
        out.append(vec[start : start + t.numel()].reshape(t.shape).to(t.dtype))
        start += t.numel()
    return out
