"""The tables of bilevel solvers (``--solver``) and of AID's linear solvers (``--linear-solver``).

Two `calibration.registry.Registry` tables of Info records. Imports no torch: a solver's
factory is named by ``"package.module:function"`` (or given as a callable) and imported only
when a CALM method builds it, so ``--help`` and validation stay instant.

A factory is ``factory(cfg) -> solver``: it reads what it needs from the whole configuration
(``cfg.calm``, and its own options as ``cfg.options_of(name)`` when its Info declares an
``options`` dataclass: those become ``--<name>-<field>`` flags). A user adds one from a module
of their own (loaded with ``--plugins``; docs/extending.md has a worked example)::

    from apps.calm_llm.solvers import LINEAR_SOLVERS, LinearSolverInfo

    def richardson(cfg):
        ...
        return solve                         # solve(matvec, b, init=None) -> (x, info)

    LINEAR_SOLVERS.register(LinearSolverInfo("richardson", richardson, options=Options))

and chooses it with ``--solver aid --linear-solver richardson``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from calibration.registry import Registry


@dataclass(frozen=True)
class SolverInfo:
    """A bilevel solver of the CALM problem.

    Attributes:
        name: the ``--solver`` value.
        factory: ``"module:function"`` or a callable ``factory(cfg) -> solver`` (a
            `bilevel.BOME`/`ITD`/`AID`-like object with ``step``); ``cfg`` is the whole
            configuration (``cfg.calm``: the CALM options).
        second_order: differentiates through the inner gradient steps (the model then loads
            eager attention, and it runs in one process only).
        summary: one line for the docs.
        options: a dataclass of the solver's own options (``config.opt`` fields), or None:
            flags ``--<name>-<field>``, read as ``cfg.options_of(name)``.
    """

    name: str
    factory: str | Callable[[Any], Any]
    second_order: bool
    summary: str = ""
    options: type | None = None


@dataclass(frozen=True)
class LinearSolverInfo:
    """A linear solver of AID's system ∇²_θθ g · v = ∇_θ f.

    ``factory(cfg)`` returns a callable ``solve(matvec, b, init=None) -> (x, info)`` (the
    `bilevel.linalg` protocol; b and x are lists of tensors). ``options``: as `SolverInfo`'s
    (a plugin's own maxiter/tolerance, instead of borrowing ``--cg-maxiter/--cg-tol``).
    """

    name: str
    factory: str | Callable[[Any], Callable]
    summary: str = ""
    options: type | None = None


SOLVERS: Registry[SolverInfo] = Registry("solver")
LINEAR_SOLVERS: Registry[LinearSolverInfo] = Registry("linear solver")


def _resolve(factory: str | Callable) -> Callable:
    if callable(factory):
        return factory
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_solver(cfg: Any) -> Any:
    """The bilevel solver ``--solver`` names, built from the configuration."""
    return _resolve(SOLVERS.get(cfg.calm.solver).factory)(cfg)


def build_linear_solver(cfg: Any) -> Callable:
    """The ``solve(matvec, b, init=None) -> (x, info)`` that ``--linear-solver`` names."""
    return _resolve(LINEAR_SOLVERS.get(cfg.calm.linear_solver).factory)(cfg)


def is_second_order(name: str) -> bool:
    """Whether the solver registered as ``name`` differentiates twice (False when unknown:
    validation names an unknown solver on its own)."""
    return name in SOLVERS and SOLVERS[name].second_order


_BUILTIN = "apps.calm_llm.methods.calm:"
SOLVERS.register(SolverInfo("bome", _BUILTIN + "bome_solver", False,
                            "BOME: first order, value-function based (the CALM paper's solver)"))
SOLVERS.register(SolverInfo("itd", _BUILTIN + "itd_solver", True,
                            "iterative differentiation through the T inner steps (--itd-truncate)"))
SOLVERS.register(SolverInfo("aid", _BUILTIN + "aid_solver", True,
                            "implicit differentiation at θ^(T) with --linear-solver"))
LINEAR_SOLVERS.register(LinearSolverInfo("cg", _BUILTIN + "cg_linear_solver",
                                         "conjugate gradient (--cg-maxiter, --cg-tol)"))
LINEAR_SOLVERS.register(LinearSolverInfo(
    "neumann", _BUILTIN + "neumann_linear_solver",
    "Neumann series with step --inner-lr (--cg-maxiter terms, --cg-tol)"))
LINEAR_SOLVERS.register(LinearSolverInfo("dense", _BUILTIN + "dense_linear_solver",
                                         "dense solve of the full Hessian (small models only)"))
