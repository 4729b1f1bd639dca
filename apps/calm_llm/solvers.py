"""The tables of bilevel solvers (``--solver``) and of AID's linear solvers (``--linear-solver``).

Imports no torch: a solver's factory is named by ``"package.module:function"`` (or given as a
callable) and imported only when a CALM method builds it, so ``--help`` and validation stay
instant. A user adds one from a module of their own (loaded with ``--plugins``)::

    from apps.calm_llm.solvers import register_linear_solver

    def richardson(matvec, b, init=None):          # the bilevel.linalg protocol
        ...
        return x, {"iterations": n}

    register_linear_solver("richardson", lambda calm: richardson)

and chooses it with ``--solver aid --linear-solver richardson``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SolverInfo:
    """A bilevel solver of the CALM problem.

    Attributes:
        name: the ``--solver`` value.
        factory: ``"module:function"`` or a callable ``factory(calm_options) -> solver`` (a
            `bilevel.BOME`/`ITD`/`AID`-like object with ``step``); ``calm_options`` is the
            config's ``calm`` section.
        second_order: differentiates through the inner gradient steps (the model then loads
            eager attention, and it runs in one process only).
        summary: one line for the docs.
    """

    name: str
    factory: str | Callable[[Any], Any]
    second_order: bool
    summary: str = ""


@dataclass(frozen=True)
class LinearSolverInfo:
    """A linear solver of AID's system ∇²_θθ g · v = ∇_θ f.

    ``factory(calm_options)`` returns a callable ``solve(matvec, b, init=None) -> (x, info)``
    (the `bilevel.linalg` protocol; b and x are lists of tensors).
    """

    name: str
    factory: str | Callable[[Any], Callable]
    summary: str = ""


SOLVERS: dict[str, SolverInfo] = {}
LINEAR_SOLVERS: dict[str, LinearSolverInfo] = {}


def register_solver(info: SolverInfo) -> SolverInfo:
    """Add a bilevel solver; a name that is taken is a ValueError."""
    if info.name in SOLVERS:
        raise ValueError(f"solver {info.name!r} is already registered")
    SOLVERS[info.name] = info
    return info


def register_linear_solver(name: str, factory: str | Callable[[Any], Callable],
                           summary: str = "") -> LinearSolverInfo:
    """Add a linear solver for AID; a name that is taken is a ValueError."""
    if name in LINEAR_SOLVERS:
        raise ValueError(f"linear solver {name!r} is already registered")
    LINEAR_SOLVERS[name] = info = LinearSolverInfo(name, factory, summary)
    return info


class Names(Sequence[str]):
    """The registered names of the table ``SOLVERS`` or ``LINEAR_SOLVERS`` of this module, read
    on every use (usable as argparse choices; a registration made later is in it)."""

    def __init__(self, table: str):
        self.table_name = table

    @property
    def table(self) -> dict[str, Any]:
        return globals()[self.table_name]

    def __getitem__(self, i: Any) -> Any:
        return tuple(self.table)[i]

    def __len__(self) -> int:
        return len(self.table)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self.table))

    def __contains__(self, name: object) -> bool:
        return name in self.table

    def __repr__(self) -> str:
        return repr(tuple(self.table))


def _resolve(factory: str | Callable) -> Callable:
    if callable(factory):
        return factory
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_solver(calm: Any) -> Any:
    """The bilevel solver ``--solver`` names, built from the ``calm`` options."""
    return _resolve(SOLVERS[calm.solver].factory)(calm)


def build_linear_solver(calm: Any) -> Callable:
    """The ``solve(matvec, b, init=None) -> (x, info)`` that ``--linear-solver`` names."""
    return _resolve(LINEAR_SOLVERS[calm.linear_solver].factory)(calm)


def is_second_order(name: str) -> bool:
    return name in SOLVERS and SOLVERS[name].second_order


_BUILTIN = "apps.calm_llm.methods.calm:"
register_solver(SolverInfo("bome", _BUILTIN + "bome_solver", False,
                           "BOME: first order, value-function based (the CALM paper's solver)"))
register_solver(SolverInfo("itd", _BUILTIN + "itd_solver", True,
                           "iterative differentiation through the T inner steps (--itd-truncate)"))
register_solver(SolverInfo("aid", _BUILTIN + "aid_solver", True,
                           "implicit differentiation at θ^(T) with --linear-solver"))
register_linear_solver("cg", _BUILTIN + "cg_linear_solver",
                       "conjugate gradient (--cg-maxiter, --cg-tol)")
register_linear_solver("neumann", _BUILTIN + "neumann_linear_solver",
                       "Neumann series with step --inner-lr (--cg-maxiter terms, --cg-tol)")
register_linear_solver("dense", _BUILTIN + "dense_linear_solver",
                       "dense solve of the full Hessian (small models only)")
