"""Peers on the problems researchers bring: a non-convex MLP and a minibatch DARTS-style mix.

    OMP_NUM_THREADS=1 python -m bench.peers_nonconvex [--quick] [--out STEM]

Two problems, both float64, both with an indefinite lower-level Hessian at the θ_T every
method is given (same θ_T, same α for all):

1. ``mlp``: bench/linalg_nonconvex.py's hyper-cleaning 5-8-2 tanh MLP at θ_30 (full batch).
2. ``darts``: architecture weights α (3 logits) mix three candidate operations on a hidden
   layer h = x W1 + b1 — ``softmax(α)_0 · h Wl + softmax(α)_1 · tanh(h) + softmax(α)_2 · h`` —
   followed by a linear classifier; θ = (W1, b1, Wl, W2, b2) is trained by SGD on a FRESH
   minibatch per inner step, by ``bilevel.ITD`` with ``lower_batches`` (one draw per inner
   step; tested equal to hand-written SGD on the same draws). The reference is the implicit
   function theorem at θ_T
   on the FULL training set's lower objective: dF/dα = −∇²_αθ g_full · (∇²_θθ g_full)⁻¹ ∇_θ f
   (dense, ``torch.func.hessian`` + ``torch.linalg.solve``), and every method is handed the
   full training set as its lower batch. It is checked by central differences (1e-6 relative)
   of the problem tilted by a constant linear term in θ so that θ_T is stationary (same
   Hessians, so the same answer: tests/bench/test_bench_peers_nonconvex.py).

Rows: each of bilevel's linear solvers through ``bilevel.Implicit(solver)``; torchopt's
``custom_root`` with ``solve_normal_cg`` (its default) and with ``solve_cg``; betty's ``cg`` and
``neumann`` hypergradients (``betty.hypergradient.get_grads`` on stand-ins, as
bench/libs/betty_lib.py, via ``BETTY_PATH``). Each row: relative error ‖h − h_dense‖/‖h_dense‖,
median ms per hypergradient taken round-robin by ``bench.harness.time_alternating`` in one run
(and its ratio to bilevel MINRES), or the exception text / "not installed". Writes
bench/results/peers_nonconvex.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import bilevel
from bilevel import linalg

from . import harness
from . import linalg_nonconvex as lnc
from .libs import betty_lib, torchopt_lib

F64 = torch.float64
ITERS = 500  # iteration cap for every iterative solver, ours and the peers'
TOL = 1e-10
Lower = Callable[[torch.Tensor, dict[str, torch.Tensor], Any], torch.Tensor]


@dataclass
class Case:
    """A bilevel problem at (α, θ_T): f, g, batches, and the dense float64 hypergradient."""

    name: str
    upper: Lower
    lower: Lower
    alpha: torch.Tensor
    theta: dict[str, torch.Tensor]
    train: Any  # the lower batch every method gets (the full training set)
    val: Any
    hessian: torch.Tensor
    exact: torch.Tensor
    note: str


def mlp_case(n: int = 40, steps: int = 30) -> Case:
    """bench/linalg_nonconvex.py's problem, unchanged (full-batch gradient descent to θ_T)."""
    c = lnc.hyper_cleaning_mlp(n=n, steps=steps)
    return Case("mlp", lnc.upper, lnc.lower, c.alpha, c.theta, c.train, c.val, c.hessian,
                c.exact, f"hyper-cleaning 5-8-2 tanh MLP, n={n}, θ after {steps} full-batch GD steps")


DARTS_DECAY = 1e-3


def _darts_forward(alpha: torch.Tensor, th: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """softmax(α)-weighted sum of {linear h·Wl, tanh(h), identity h} on h = x W1 + b1."""
    h = x @ th["w1"] + th["b1"]
    w = torch.softmax(alpha, 0)
    mixed = w[0] * (h @ th["wl"]) + w[1] * torch.tanh(h) + w[2] * h
    return mixed @ th["w2"] + th["b2"]


def darts_lower(alpha: torch.Tensor, th: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """CE of the mixed network on a (mini)batch + ½·DECAY‖θ‖² (the decay makes H nonsingular:
    the softmax's logit shift would otherwise be a null direction)."""
    x, y = batch
    return F.cross_entropy(_darts_forward(alpha, th, x), y) + 0.5 * DARTS_DECAY * sum(
        (t**2).sum() for t in th.values())


def darts_upper(alpha: torch.Tensor, th: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """Validation CE of the mixed network (α enters directly and through θ)."""
    x, y = batch
    return F.cross_entropy(_darts_forward(alpha, th, x), y)


def darts_draws(seed: int = 0, n: int = 64, batch: int = 8, steps: int = 200, d: int = 5,
                h: int = 6, c: int = 3) -> dict[str, Any]:
    """The DARTS-style problem's data, starting point and the ``steps`` minibatches of
    ``batch`` training points (drawn with replacement by a seeded generator, in step order)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d, c, generator=gen, dtype=F64)
    x_tr, x_va = (torch.randn(n, d, generator=gen, dtype=F64) for _ in range(2))
    y_tr = (torch.tanh(x_tr) @ teacher).argmax(1)
    y_va = (torch.tanh(x_va) @ teacher).argmax(1)
    shapes = {"w1": (d, h), "b1": (h,), "wl": (h, h), "w2": (h, c), "b2": (c,)}
    theta0 = {k: torch.randn(s, generator=gen, dtype=F64) / math.sqrt(s[0] if len(s) > 1 else 4)
              for k, s in shapes.items()}
    alpha = 0.5 * torch.randn(3, generator=gen, dtype=F64)
    idx = [torch.randint(0, n, (batch,), generator=gen) for _ in range(steps)]
    return {"train": (x_tr, y_tr), "val": (x_va, y_va), "theta0": theta0, "alpha": alpha,
            "batches": [(x_tr[i], y_tr[i]) for i in idx]}


def darts_case(seed: int = 0, n: int = 64, batch: int = 8, steps: int = 200, lr: float = 0.5,
               d: int = 5, h: int = 6, c: int = 3) -> Case:
    """The DARTS-style mix at θ_T: ``steps`` SGD steps of ``lr`` from θ_0, each on a fresh
    minibatch, run by ``bilevel.ITD`` with ``lower_batches`` (one draw per inner step) — the
    way a user writes a minibatch inner loop; its θ^(T) is the point every method is given."""
    data = darts_draws(seed, n, batch, steps, d, h, c)
    draws = iter(data["batches"])
    itd = bilevel.ITD(steps, lr, lower_batches=lambda: next(draws))
    problem = bilevel.Problem(upper=darts_upper, lower=darts_lower)
    r = itd.step(problem, data["alpha"], data["theta0"], upper_batch=data["val"],
                 lower_batch=data["train"])
    theta = {k: v.detach() for k, v in r.inner_solution.items()}
    alpha, train, val = data["alpha"], data["train"], data["val"]
    hessian, exact = lnc.dense_implicit(alpha, theta, train, val, upper=darts_upper,
                                        lower=darts_lower)
    return Case("darts", darts_upper, darts_lower, alpha, theta, train, val,
                hessian, exact, f"DARTS-style 3-op mix, {sum(t.numel() for t in theta.values())} "
                f"weights, θ after {steps} SGD steps (bilevel.ITD, lower_batches) on fresh "
                f"minibatches of {batch} of {n}; reference: implicit function theorem on the full "
                "training set at θ_T")


def bilevel_solvers(lr: float) -> dict[str, Any]:
    """bilevel's linear solvers (Neumann with lr = 1/|λ|_max, below 2/λ_max)."""
    return {
        "CG": linalg.CG(maxiter=ITERS, tol=TOL),
        "MINRES": linalg.MINRES(maxiter=ITERS, tol=TOL),
        "NormalCG": linalg.NormalCG(maxiter=ITERS, tol=TOL),
        "Neumann": linalg.Neumann(steps=ITERS, lr=lr),
        "Dense": linalg.Dense(),
    }


def _bilevel_run(case: Case, solver: Any) -> Callable[[], torch.Tensor]:
    problem = bilevel.Problem(upper=case.upper, lower=case.lower)

    def run() -> torch.Tensor:
        return bilevel.hypergrad(problem, case.alpha, case.theta, upper_batch=case.val,
                                 lower_batch=case.train, method=bilevel.Implicit(solver))

    return run


def _torchopt_run(case: Case, solve_name: str) -> Callable[[], torch.Tensor]:
    import torchopt

    keys = list(case.theta)
    solve = getattr(torchopt.linear_solve, solve_name)(maxiter=ITERS, rtol=TOL, atol=0.0)

    def lower(theta: tuple[torch.Tensor, ...], alpha: torch.Tensor) -> torch.Tensor:
        return case.lower(alpha, dict(zip(keys, theta)), case.train)

    optimality = torch.func.grad(lower, argnums=0)

    @torchopt.diff.implicit.custom_root(optimality, argnums=1, solve=solve)
    def solution(theta: tuple[torch.Tensor, ...], alpha: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return theta  # already θ_T: only the implicit backward is timed

    def run() -> torch.Tensor:
        a = case.alpha.detach().requires_grad_(True)
        theta: Any = solution(tuple(case.theta[k].detach() for k in keys), a)  # a tuple, as given
        return torch.autograd.grad(case.upper(a, dict(zip(keys, theta)), case.val), a)[0]

    return run


def _betty_run(case: Case, kind: str, lr: float) -> Callable[[], torch.Tensor]:
    from types import SimpleNamespace

    from betty.hypergradient import get_grads  # type: ignore[import-not-found]  # BETTY_PATH

    keys = list(case.theta)
    config = SimpleNamespace(type=kind, cg_iterations=ITERS, cg_alpha=1.0,
                             neumann_iterations=ITERS, neumann_alpha=lr, darts_alpha=0.01)

    def run() -> torch.Tensor:
        a = case.alpha.detach().requires_grad_(True)
        params = [case.theta[k].detach().requires_grad_(True) for k in keys]
        lower = SimpleNamespace(
            config=config, cur_batch=case.train, paths=[],
            training_step_exec=lambda b: case.lower(a, dict(zip(keys, params)), b),
            trainable_parameters=lambda: params, parameters=lambda: params)
        upper = SimpleNamespace(trainable_parameters=lambda: [a])
        f = case.upper(a, dict(zip(keys, params)), case.val)
        direct = torch.autograd.grad(f, a, retain_graph=True, allow_unused=True)[0]
        implicit = get_grads(f, [upper, lower, upper], retain_graph=False)[0]
        return implicit if direct is None else implicit + direct  # betty adds ∇_α f itself

    return run


def runners(case: Case) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str]]:
    """(name → zero-argument hypergradient run, name → why a peer has no run)."""
    lam_max = float(torch.linalg.eigvalsh(case.hessian).abs().max())
    runs: dict[str, Callable[[], torch.Tensor]] = {
        f"bilevel {k}": _bilevel_run(case, s) for k, s in bilevel_solvers(1.0 / lam_max).items()}
    absent: dict[str, str] = {}
    peers = {
        "torchopt solve_normal_cg (default)": (torchopt_lib.unavailable,
                                               lambda: _torchopt_run(case, "solve_normal_cg")),
        "torchopt solve_cg": (torchopt_lib.unavailable, lambda: _torchopt_run(case, "solve_cg")),
        "betty cg": (betty_lib.unavailable, lambda: _betty_run(case, "cg", 1.0 / lam_max)),
        "betty neumann": (betty_lib.unavailable, lambda: _betty_run(case, "neumann", 1.0 / lam_max)),
    }
    for name, (unavailable, make) in peers.items():
        reason = unavailable()
        if reason is None:
            runs[name] = make()
        else:
            absent[name] = f"not installed: {reason}"
    return runs, absent


def rows(case: Case, *, timing: bool = True, repeats: int = 5) -> list[dict[str, Any]]:
    """One row per method: relative error vs the dense answer, warnings, median ms (round-robin
    among the methods that ran), ms ratio to bilevel MINRES; failures carry the exception text."""
    runs, absent = runners(case)
    out: dict[str, dict[str, Any]] = {}
    ok: dict[str, Callable[[], torch.Tensor]] = {}
    for name, run in runs.items():
        row: dict[str, Any] = {"problem": case.name, "method": name, "error": float("nan"),
                               "ms": float("nan"), "ratio_to_minres": float("nan"), "said": ""}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                grad = run()
            except Exception as err:  # a peer's failure is a result: record its text
                row["said"] = f"raised {type(err).__name__}: {str(err).splitlines()[0][:160]}"
                out[name] = row
                continue
        row["error"] = float((grad.detach().reshape(-1) - case.exact).norm() / case.exact.norm())
        row["said"] = ", ".join(sorted({type(w.message).__name__ for w in caught})) or "nothing"
        if not bool(torch.isfinite(grad).all()):
            row["said"] = f"returned non-finite values (NaN/inf), warned: {row['said']}"
        out[name] = row
        ok[name] = run
    for name, reason in absent.items():
        out[name] = {"problem": case.name, "method": name, "error": float("nan"),
                     "ms": float("nan"), "ratio_to_minres": float("nan"), "said": reason}
    if timing and ok:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            times = harness.time_alternating(ok, device=torch.device("cpu"), repeats=repeats)
        for name, ts in times.items():
            out[name]["ms"] = 1e3 * statistics.median(ts)
        base = out.get("bilevel MINRES", {}).get("ms", float("nan"))
        for r in out.values():
            r["ratio_to_minres"] = r["ms"] / base
    return list(out.values())


def render(cases: list[Case], records: list[dict[str, Any]],
           load: Sequence[float] = ()) -> str:
    """The Markdown tables, one per problem; ``load``: the machine's 1-minute load average at
    the start and the end of the run."""
    busy = (f"1-minute load average at the start / end: {load[0]:.2f} / {load[1]:.2f} (about 1 = "
            "this run alone on the machine). " if len(load) == 2 else "")
    lines = ["# Peers on non-convex problems (`python -m bench.peers_nonconvex`)", "",
             f"float64, one thread. {busy}The methods run round-robin "
             "(`bench.harness.time_alternating`), so the ratios within one run are what to read. "
             "Run alone: `OMP_NUM_THREADS=1 python -m "
             "bench.peers_nonconvex` (betty via `BETTY_PATH`, see bench/libs/betty_lib.py). "
             "torchopt's `FutureWarning` is its own use of the deprecated `functorch.vjp`; "
             "\"ConvergenceWarning\" is bilevel's (CG: negative curvature; NormalCG: not "
             f"converged in {ITERS} iterations).", ""]
    for case in cases:
        eig = torch.linalg.eigvalsh(case.hessian)
        lines += [f"## {case.name}: {case.note}", "",
                  f"Hessian at θ_T: {int((eig < 0).sum())} of {eig.numel()} eigenvalues negative, "
                  f"|λ| in [{float(eig.abs().min()):.2e}, {float(eig.abs().max()):.2e}]. "
                  f"Iterative solvers: at most {ITERS} iterations, tol {TOL:g}.", "",
                  "| method | rel. error | ms / hypergradient | × bilevel MINRES | raised, warned or why absent |",
                  "|---|---|---|---|---|"]
        for r in records:
            if r["problem"] == case.name:
                lines.append(f"| {r['method']} | {r['error']:.2e} | {r['ms']:.1f} | "
                             f"{r['ratio_to_minres']:.2f} | {r['said']} |")
        lines.append("")
    return "\n".join(lines).replace("| nan |", "| — |").replace(" nan |", " — |")


def main(argv: Sequence[str] | None = None) -> int:
    """Both problems × every method; writes the JSON and the Markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller problems, 3 repeats")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "peers_nonconvex")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    cases = ([mlp_case(n=12, steps=5), darts_case(n=16, steps=20)] if args.quick
             else [mlp_case(), darts_case()])
    records = [r for c in cases for r in rows(c, repeats=3 if args.quick else 7)]
    load.append(os.getloadavg()[0])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"meta": {"torch": torch.__version__, "load_average_1min": load,
                  "notes": {c.name: c.note for c in cases}}, "records": records}, indent=1))
    text = render(cases, records, load)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
