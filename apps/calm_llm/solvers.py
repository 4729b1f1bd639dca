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

The contract a solver meets (`bilevel.Solver`): ``solver.step(problem, outer, inner, *,
upper_batch, lower_batch)`` returns a `bilevel.StepResult` whose ``outer_grad`` and
``inner_grad`` hold a direction for every tensor of ``outer`` and ``inner``, and whose
``info`` holds, besides what it likes, the keys of `REQUIRED_INFO` (each a number or a
one-element tensor; bilevel's built-in solvers all report them, docs/bilevel.md "Diagnostics:
what ``info`` holds"). `check_solver` and `check_step` refuse anything else as a
`SolverContractError` naming the solver and what is missing, instead of letting it surface
as a misleading non-finite loss or a ``KeyError`` several calls later.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from calibration.registry import Registry

from ..errors import CalmError, ConfigError
from .option import opt

# the `StepResult.info` keys the app reads of every solver step: ``lower_loss`` is the loss the
# runner checks for finiteness and records as each step's ``loss``
REQUIRED_INFO: tuple[str, ...] = ("lower_loss",)


class SolverContractError(CalmError, TypeError):
    """A ``--solver`` whose object or step result breaks the contract the app reads
    (`bilevel.Solver`, `REQUIRED_INFO`); the message names the solver, what is missing or of
    the wrong type, and what the app needs."""


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
            flags ``--<name>-<field>`` (or the field's ``flag``), read as
            ``cfg.options_of(name)``.
        validate: ``validate(cfg)`` raising `apps.errors.ConfigError` for values of its own
            options that cannot work (run on every configuration, as a method's is), or None.
    """

    name: str
    factory: str | Callable[[Any], Any]
    second_order: bool
    summary: str = ""
    options: type | None = None
    validate: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class LinearSolverInfo:
    """A linear solver of AID's system ∇²_θθ g · v = ∇_θ f.

    ``factory(cfg)`` returns a callable ``solve(matvec, b, init=None) -> (x, info)`` (the
    `bilevel.linalg` protocol; b and x are lists of tensors). ``options``: as `SolverInfo`'s
    (a plugin's own maxiter/tolerance, as the built-ins' ``--cg-maxiter``, ``--neumann-terms``)
    and ``validate``: as `SolverInfo`'s.
    """

    name: str
    factory: str | Callable[[Any], Callable]
    summary: str = ""
    options: type | None = None
    validate: Callable[[Any], None] | None = None


SOLVERS: Registry[SolverInfo] = Registry("solver")
LINEAR_SOLVERS: Registry[LinearSolverInfo] = Registry("linear solver")


def _resolve(factory: str | Callable) -> Callable:
    if callable(factory):
        return factory
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_solver(cfg: Any) -> Any:
    """The bilevel solver ``--solver`` names, built from the configuration and checked to have
    the `bilevel.Solver` method ``step`` (`check_solver`)."""
    name = cfg.calm.solver
    return check_solver(name, _resolve(SOLVERS.get(name).factory)(cfg))


def check_solver(name: str, solver: Any) -> Any:
    """``solver`` itself when it has a callable ``step`` (the `bilevel.Solver` protocol, checked
    by duck typing: this module imports no torch); else `SolverContractError`."""
    if not callable(getattr(solver, "step", None)):
        raise SolverContractError(
            f"--solver {name}: its factory returned {type(solver).__name__}, which has no "
            "step(problem, outer, inner, *, upper_batch, lower_batch) method (the bilevel.Solver "
            "protocol); return a bilevel solver (bilevel.BOME, ITD, AID, ...) or an object with "
            "that method")
    return solver


def _is_scalar(value: Any) -> bool:
    """A Python number, or a tensor of one element (read with ``float``; no device sync here)."""
    if isinstance(value, int | float):
        return True
    numel = getattr(value, "numel", None)
    return callable(numel) and numel() == 1 and hasattr(value, "dtype") \
        and not getattr(value.dtype, "is_complex", False)


def check_step(name: str, result: Any, outer: Mapping[str, Any], inner: Mapping[str, Any]) -> Any:
    """``result`` itself when it meets the contract the app reads of one ``solver.step``: an
    object with ``outer_grad``/``inner_grad`` mappings holding a direction for every name of
    ``outer``/``inner``, and an ``info`` mapping with every key of `REQUIRED_INFO` and every value a number or a
    one-element tensor (the app averages and records each as a float). Else `SolverContractError` naming the solver, the missing or mistyped
    keys, and the keys the app needs. Dict look-ups only (cost: nothing next to a step)."""
    where = f"--solver {name}: its step returned"
    needs = (f"the app needs a bilevel.StepResult with outer_grad/inner_grad for every tensor "
             f"and info keys {list(REQUIRED_INFO)} (numbers)")
    missing_attrs = [a for a in ("outer_grad", "inner_grad", "info") if not hasattr(result, a)]
    if missing_attrs:
        raise SolverContractError(f"{where} {type(result).__name__}, without "
                                  f"{', '.join(missing_attrs)}; {needs}")
    info = result.info
    if not isinstance(info, Mapping):
        raise SolverContractError(f"{where} info of type {type(info).__name__}, not a mapping; "
                                  f"{needs}")
    missing = [k for k in REQUIRED_INFO if k not in info]
    if missing:
        raise SolverContractError(f"{where} info without {missing} (it has {sorted(info)}); "
                                  f"{needs}")
    # every value, not only the required ones: each is averaged and recorded as a float
    wrong = {k: type(v).__name__ for k, v in info.items() if not _is_scalar(v)}
    if wrong:
        raise SolverContractError(
            f"{where} info values that are not numbers: "
            f"{', '.join(f'{k!r} ({t})' for k, t in wrong.items())}; {needs}")
    for field, want in (("outer_grad", outer), ("inner_grad", inner)):
        got = getattr(result, field)
        if not isinstance(got, Mapping):
            raise SolverContractError(f"{where} {field} of type {type(got).__name__}, not a "
                                      f"mapping shaped like its input; {needs}")
        absent = [n for n in want if n not in got]
        if absent:
            raise SolverContractError(f"{where} {field} without {absent[:3]}"
                                      f"{' ...' if len(absent) > 3 else ''} ({len(absent)} of "
                                      f"{len(want)} tensors); {needs}")
    return result


def build_linear_solver(cfg: Any) -> Callable:
    """The ``solve(matvec, b, init=None) -> (x, info)`` that ``--linear-solver`` names."""
    return _resolve(LINEAR_SOLVERS.get(cfg.calm.linear_solver).factory)(cfg)


def is_second_order(name: str) -> bool:
    """Whether the solver registered as ``name`` differentiates twice (False when unknown:
    validation names an unknown solver on its own)."""
    return name in SOLVERS and SOLVERS[name].second_order


# -- the built-in entries' own options: declared as a plugin declares its own -----------------
# (their flags are the ones these options had as CalmConfig fields, and they are hashed under
# those names: `config.entry_options.ALWAYS_COMPARED` / `HASHED_AS`, so that no run's hash moved)


@dataclass
class BOMEOptions:
    """``bome``'s own options (flags ``--eta``, ``--phi``, ``--c``)."""

    eta: float = opt(0.5, "BOME: φ = η‖∇q‖² (phi=grad_norm)", flag="--eta")
    phi: str = opt("grad_norm", "BOME control φ", choices=("grad_norm", "value_gap"),
                   flag="--phi")
    c: float = opt(0.5, "BOME: φ = c·q (phi=value_gap)", flag="--c")


@dataclass
class ITDOptions:
    """``itd``'s own options (flag ``--itd-truncate``)."""

    truncate: int = opt(0, "ITD: back-propagate through the last k inner steps (0 = all)")


@dataclass
class CGOptions:
    """The ``cg`` linear solver's own options (flags ``--cg-maxiter``, ``--cg-tol``)."""

    maxiter: int = opt(5, "AID --linear-solver cg: conjugate-gradient iterations")
    tol: float = opt(1e-6, "AID --linear-solver cg: tolerance (relative residual)")


@dataclass
class NeumannOptions:
    """The ``neumann`` linear solver's own options (flags ``--neumann-terms``, ``--neumann-tol``;
    it read ``--cg-maxiter``/``--cg-tol`` before it had its own, which still work with
    ``--linear-solver neumann``)."""

    terms: int = opt(5, "AID --linear-solver neumann: terms of the series (one matvec each)")
    tol: float = opt(1e-6, "AID --linear-solver neumann: stop once a term's norm is ≤ tol·‖b‖")


def _not_negative(cfg: Any, name: str, fields: tuple[str, ...]) -> None:
    """An entry's own options are sign-free in `config.validate`; these may not be negative
    (as when they were `CalmConfig` fields: the same messages)."""
    o = cfg.options_of(name)
    for f in fields:
        value = getattr(o, f)
        flag = o.__dataclass_fields__[f].metadata.get("flag") or f"--{name}-{f}".replace("_", "-")
        if value < 0:
            raise ConfigError(f"{flag}: must be >= 0, got {value}")


def validate_bome(cfg: Any) -> None:
    """``--eta`` and ``--c`` >= 0."""
    _not_negative(cfg, "bome", ("eta", "c"))


def validate_itd(cfg: Any) -> None:
    """``--itd-truncate`` in [0, --inner-steps] when ITD runs."""
    _not_negative(cfg, "itd", ("truncate",))
    k, steps = cfg.options_of("itd").truncate, cfg.calm.inner_steps
    if cfg.calm.solver == "itd" and k > steps:
        raise ConfigError(f"--itd-truncate {k}: more than the {steps} inner steps (--inner-steps); "
                          "use at most that many, or 0 for all")


def validate_cg(cfg: Any) -> None:
    """``--cg-maxiter`` >= 1 (zero CG iterations would return x = 0), ``--cg-tol`` >= 0."""
    _not_negative(cfg, "cg", ("maxiter", "tol"))
    if cfg.options_of("cg").maxiter < 1:
        raise ConfigError("--cg-maxiter: must be at least 1")


def validate_neumann(cfg: Any) -> None:
    """``--neumann-terms`` >= 1, ``--neumann-tol`` >= 0."""
    _not_negative(cfg, "neumann", ("terms", "tol"))
    if cfg.options_of("neumann").terms < 1:
        raise ConfigError("--neumann-terms: must be at least 1")


_BUILTIN = "apps.calm_llm.methods.calm:"
SOLVERS.register(SolverInfo("bome", _BUILTIN + "bome_solver", False,
                            "BOME: first order, value-function based (the CALM paper's solver)",
                            options=BOMEOptions, validate=validate_bome))
SOLVERS.register(SolverInfo("itd", _BUILTIN + "itd_solver", True,
                            "iterative differentiation through the T inner steps (--itd-truncate)",
                            options=ITDOptions, validate=validate_itd))
SOLVERS.register(SolverInfo("aid", _BUILTIN + "aid_solver", True,
                            "implicit differentiation at θ^(T) with --linear-solver"))
LINEAR_SOLVERS.register(LinearSolverInfo("cg", _BUILTIN + "cg_linear_solver",
                                         "conjugate gradient (--cg-maxiter, --cg-tol)",
                                         options=CGOptions, validate=validate_cg))
LINEAR_SOLVERS.register(LinearSolverInfo(
    "neumann", _BUILTIN + "neumann_linear_solver",
    "Neumann series with step --inner-lr (--neumann-terms, --neumann-tol)",
    options=NeumannOptions, validate=validate_neumann))
LINEAR_SOLVERS.register(LinearSolverInfo("dense", _BUILTIN + "dense_linear_solver",
                                         "dense solve of the full Hessian (small models only)"))
