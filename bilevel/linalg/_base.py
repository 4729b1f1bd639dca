"""The protocol, the base class and the convergence contract shared by every linear solver
(see :mod:`bilevel.linalg` for the table and the ``info`` keys)."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Protocol

import torch

from .. import tree
from .._checks import check_int, check_nonnegative, check_positive
from ..errors import ConvergenceWarning, DivergenceError

ListMatvec = Callable[[list[torch.Tensor]], list[torch.Tensor]]
"""x ↦ A x over flat lists of tensors (the leaves of x, in order): what a solver calls."""
Info = dict[str, "float | torch.Tensor"]
"""A solver's diagnostics (``iterations``, ``residual``, ...; the keys are in the table of
:mod:`bilevel.linalg`)."""


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


def with_ridge(matvec: ListMatvec, ridge: float) -> ListMatvec:
    """x ↦ (A + ridge·I) x; ``matvec`` itself when ridge = 0 (no extra operation)."""
    if ridge == 0.0:
        return matvec
    return lambda xs: list(torch._foreach_add(matvec(xs), xs, alpha=ridge))


def check_init(
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


def residual_of(
    matvec: ListMatvec, b: list[torch.Tensor], x: list[torch.Tensor]
) -> list[torch.Tensor]:
    """b − A x (a new list)."""
    return list(torch._foreach_sub(b, matvec(x)))


def check_finite(value: float, solver: str, what: str, iteration: int) -> float:
    """``value`` itself when finite; else FloatingPointError naming ``solver``, the quantity
    ``what`` and the ``iteration`` (the iterations' guard against a diverged run)."""
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


UNCONVERGED_POLICIES = ("warn", "ignore")
DIVERGENCE_POLICIES = ("raise", "warn", "ignore")


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    """ValueError naming ``owner``'s option ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(
            f"{owner}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )


@dataclass(frozen=True)
class IterativeSolver(LinearSolver):
    """The convergence contract of every iterative solver (keyword-only options).

    * ``converged`` is ``residual ≤ threshold`` (each solver's docstring states its
      threshold, ``max(tol·‖b‖, atol)`` unless said otherwise). Stopping unconverged warns
      :class:`bilevel.errors.ConvergenceWarning` (``on_unconverged="warn"``, the default)
      or says nothing (``"ignore"``: a deliberate fixed budget);
      ``warnings.simplefilter("error", ConvergenceWarning)`` makes it an error.
    * A residual above ``divergence_factor`` × the starting residual ‖b − A x₀‖ (‖b‖ without
      ``init``) is divergence: ``on_divergence="raise"`` (default) raises
      :class:`bilevel.errors.DivergenceError` (a ``FloatingPointError``), ``"warn"`` stops
      there (Neumann without ``tol``: at the end, where it checks) with a
      ``ConvergenceWarning`` and returns that iterate (``converged=False``),
      ``"ignore"`` iterates on (a non-finite value still raises ``FloatingPointError``).
      The default 1e3 is far below the 1e29 a diverging Neumann series reached silently
      before it overflowed; MINRES's and NormalCG's residuals never increase, and CG's
      default is 1e6 (its residual can grow transiently, see :class:`CG`).
    """

    on_unconverged: str = field(default="warn", kw_only=True)
    on_divergence: str = field(default="raise", kw_only=True)
    divergence_factor: float = field(default=1e3, kw_only=True)

    def __post_init__(self) -> None:
        """Check the options by name, the same way on every solver: ``maxiter`` ≥ 1 (zero
        iterations would silently return x = 0, torchopt #222), ``steps`` ≥ 0, ``lr`` > 0,
        ``tol``, ``atol``, ``ridge`` ≥ 0, then the contract's own options."""
        name = type(self).__name__
        for option, minimum in (("maxiter", 1), ("steps", 0)):
            if hasattr(self, option):
                check_int(name, option, getattr(self, option), minimum=minimum)
        if hasattr(self, "lr"):
            check_positive(name, "lr", self.lr)
        for option in ("tol", "atol", "ridge"):
            if hasattr(self, option):
                check_nonnegative(name, option, getattr(self, option))
        check_choice(name, "on_unconverged", self.on_unconverged, UNCONVERGED_POLICIES)
        check_choice(name, "on_divergence", self.on_divergence, DIVERGENCE_POLICIES)
        check_positive(name, "divergence_factor", self.divergence_factor)
        if self.divergence_factor <= 1.0:
            raise ValueError(
                f"{name}: divergence_factor must be > 1 (a residual that merely fails to "
                f"shrink is not divergence), got {self.divergence_factor}"
            )

    def _hint(self) -> str:  # pragma: no cover - every solver overrides it
        return "raise maxiter"

    def _diverging(self, rnorm: float, r0norm: float, it: int, stacklevel: int = 5) -> bool:
        """Apply ``on_divergence`` to a residual ``rnorm`` at iteration ``it``: raises
        DivergenceError ("raise"), or True when the iteration must stop ("warn")."""
        if self.on_divergence == "ignore" or rnorm <= self.divergence_factor * r0norm:
            return False
        msg = (
            f"{type(self).__name__}: diverged: the residual ‖b − A x‖ grew to {rnorm:.3g}, more "
            f"than divergence_factor={self.divergence_factor:g} × its starting value "
            f"{r0norm:.3g}, at iteration {it}; {self._hint()}"
        )
        if self.on_divergence == "raise":
            raise DivergenceError(msg)
        warnings.warn(f"{msg} (on_divergence='warn': returning this iterate)", ConvergenceWarning,
                      stacklevel=stacklevel)
        return True

    def _report(
        self, x: list[torch.Tensor], it: int, rnorm: float, threshold: float,
        reason: str | None = None, stacklevel: int = 4, **extra: float,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, info)`` with ``converged = rnorm ≤ threshold``, warning (``reason`` or the
        standard message) when unconverged and ``on_unconverged="warn"``."""
        converged = reason is None and rnorm <= threshold
        if not converged and self.on_unconverged == "warn" and reason != "":
            what = reason or (
                f"stopped unconverged after {it} iterations: residual ‖b − A x‖ = "
                f"{rnorm:.3g} > tolerance {threshold:.3g}; {self._hint()}"
            )
            warnings.warn(
                f"{type(self).__name__}: {what} (on_unconverged='ignore' silences this)",
                ConvergenceWarning, stacklevel=stacklevel,
            )
        info: Info = {"iterations": float(it), "residual": rnorm, "converged": converged}
        return x, {**info, **extra}


def as_linear_solve(solver: object, owner: str) -> LinearSolve:
    """The protocol callable for ``solver``: a shipped solver's ``solve``, or ``solver``.

    Raises ``TypeError`` naming ``owner`` unless ``solver`` is a `LinearSolver` or a
    callable that accepts ``(matvec, b, init=...)``.
    """
    if isinstance(solver, LinearSolver):
        return solver.solve
    expected = (
        f"{owner}: linear_solver must be a bilevel.linalg solver (CG, MINRES, NormalCG, "
        "Neumann, FixedPoint, Dense) or a callable solve(matvec, b, init=None) -> (x, info)"
    )
    if not callable(solver):
        raise TypeError(f"{expected}, got {type(solver).__name__}")
    try:
        inspect.signature(solver).bind(None, None, init=None)
    except TypeError as e:
        raise TypeError(f"{expected}; {solver!r} does not accept these arguments ({e})") from None
    except ValueError:  # no signature available (some builtins): trust the caller
        pass
    return solver


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


def solver_factory(cls: type[LinearSolver], name: str, options: dict[str, Any]) -> LinearSolve:
    """``cls(**options).solve``, for the ``solve_*`` factories (``name``): an option ``cls``
    does not have is refused with the list of those it has."""
    if not is_dataclass(cls):  # every concrete LinearSolver is one; narrows cls for fields()
        raise TypeError(f"{name}: {cls.__name__} is not a dataclass")
    # the class's own options first, then the keyword-only convergence contract
    # (a processed field's kw_only is a bool; typeshed also allows the MISSING sentinel)
    known = [f.name for f in sorted(fields(cls), key=lambda f: f.kw_only is True)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"{name}: unknown option {unknown[0]!r}; the options of {cls.__name__} are "
            f"{', '.join(known)}"
        )
    return cls(**options).solve


def flat_cat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors raveled and concatenated: one (Σ numel,) vector."""
    return torch.cat([t.reshape(-1) for t in xs])


def split_like(vec: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inverse of `flat_cat`: ``vec`` (Σ numel,) cut into tensors shaped and typed like
    ``like``."""
    out, start = [], 0
    for t in like:
        out.append(vec[start : start + t.numel()].reshape(t.shape).to(t.dtype))
        start += t.numel()
    return out
