"""Hypergradients: the toolkit against torchopt, higher, betty and a plain-PyTorch floor.

    python -m bench.hypergrad [--quick] [--smallest] [--problems quadratic logistic mlp]

For each problem and size (bench/problems.py) and each method family

    unrolled          T inner gradient steps, reverse-mode through all of them
    implicit_cg       implicit differentiation at θ*, exactly K conjugate-gradient iterations
    implicit_neumann  implicit differentiation at θ*, K-term Neumann series (lr = 1/λ_max)
    first_order       H⁻¹ ≈ I with a finite-difference mixed term (betty's darts)

every library computes the same hypergradient at the same point with the same T / K
(matched accuracy); the script records the median seconds per hypergradient (alternating
round-robin after a warm-up), the peak memory of one call, the relative error against the
exact float64 reference (method bias + float32 rounding) and against the float64 plain-torch
version of the same computation (implementation error only). Unrolled runs start at θ*, so
they estimate the same implicit hypergradient (a truncated Neumann series of H⁻¹).

Writes bench/results/hypergrad[_quick].json (one record per measurement) and .md.

    python -m bench.hypergrad --warm-start [--quick] [--problems ...]

instead counts the CG iterations of ``bilevel.AID`` over a run of outer steps with and
without ``warm_start`` (the previous step's v as the solve's init), side by side, in float64
(tolerance-based CG: an iteration count, not a time), and writes
bench/results/warm_start[_quick].md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from . import harness, libs
from .libs import plain_torch
from .problems import BenchProblem, build

METHODS = ("unrolled", "implicit_cg", "implicit_neumann", "first_order")
# Sizes: inner dimension (quadratic, logistic) or hidden width (mlp: 256 → ~1e5 parameters,
# 896 → ~9e5 parameters; the records carry the parameter count).
FULL = {"quadratic": [100, 1000, 3000], "logistic": [100, 1000, 10_000, 100_000], "mlp": [256, 896]}
QUICK = {"quadratic": [100, 1000], "logistic": [100, 1000], "mlp": [32, 128]}
# The 1.5× target only binds where it is reachable within 1.1× of the floor.
PEER_ABOVE_FLOOR = 1.5 * 1.1
# Peak memory counts as "no higher" within 2 % or 64 KiB (a few bookkeeping tensors).
MEM_TOL, MEM_SLACK_MB = 0.02, 1 / 16
# Peers off the float64 same-computation result by more than this are excluded as wrong.
SAME_TOL = 1e-3


def measure(
    p32: BenchProblem,
    p64: BenchProblem,
    method: str,
    steps: int,
    *,
    device: torch.device,
    repeats: int,
    budget_s: float,
    memory: bool = True,
    log: Any = print,
) -> list[dict[str, Any]]:
    """One record per library for ``method`` on one problem instance (see the module doc)."""
    lr = p32.inner_lr
    base = {"problem": p32.name, "size": p32.size, "method": method, "steps": steps}
    records: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    outputs: dict[str, torch.Tensor] = {}
    for lib in libs.LIBRARIES:
        reason = libs.unavailable(lib)
        mod = libs.module(lib)
        if reason is None:
            try:
                run = mod.build(p32, method, steps, lr)
            except Exception as err:  # a peer's API mismatch is a note, never a crash
                run, reason = None, f"build failed: {type(err).__name__}: {err}"
            if run is None and reason is None:
                reason = getattr(mod, "NOTES", {}).get(method, "method not offered")
        if run is not None:
            try:
                outputs[lib] = run()
                runs[lib] = run
            except Exception as err:
                traceback.print_exc(file=sys.stderr)
                reason = f"failed: {type(err).__name__}: {err}"
        if lib not in runs:
            records.append({**base, "library": lib, "seconds_median": None, "peak_mem_mb": None,
                            "rel_error": None, "note": f"skipped: {reason}"})
    if "plain_torch" not in runs:
        return records
    same = plain_torch.build(p64, method, steps, p64.inner_lr)()  # float64, same computation
    mem = {lib: harness.peak_memory_mb(run, device, memory) for lib, run in runs.items()}
    times = harness.time_alternating(runs, device=device, repeats=repeats, budget_s=budget_s)
    floor = harness.median(times["plain_torch"])
    for lib in runs:
        t = harness.median(times[lib])
        records.append({**base, "library": lib, "seconds_median": t,
                        "seconds_min": min(times[lib]), "seconds_all": times[lib],
                        "ratio_vs_floor": t / floor, "peak_mem_mb": mem[lib],
                        "rel_error": harness.rel_error(outputs[lib], p64.exact),
                        "rel_error_vs_f64_same_method": harness.rel_error(outputs[lib], same),
                        "note": ""})
        log(
            f"  {p32.name} {p32.size} {method:16s} {lib:12s} {1000 * t:9.2f} ms "
            f"×floor {t / floor:5.2f}  peak {harness.fmt(mem[lib]):>8s} MiB  err {records[-1]['rel_error']:.1e}"
        )
    return records


def targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (problem, size, method): the toolkit's ratios against the floor and the peers."""
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        if r.get("seconds_median") is not None:
            groups.setdefault((r["problem"], r["size"], r["method"]), {})[r["library"]] = r
    out = []
    for (problem, size, method), by in groups.items():
        if "bilevel" not in by or "plain_torch" not in by:
            continue
        ours, floor = by["bilevel"], by["plain_torch"]
        # "Matched accuracy": a peer whose answer differs from float64 plain torch doing the
        # same computation (betty's CG) is not a speed reference.
        peers = {
            k: v
            for k, v in by.items()
            if k not in ("bilevel", "plain_torch")
            and (v.get("rel_error_vs_f64_same_method") or 0.0) <= SAME_TOL
        }
        row: dict[str, Any] = {
            "problem": problem,
            "size": size,
            "method": method,
            "vs_floor": ours["seconds_median"] / floor["seconds_median"],
        }
        row["floor_ok"] = row["vs_floor"] <= 1.1
        # Best-of ratios: on a shared machine a millisecond call is either run through or
        # preempted for a whole time slice, so medians of short calls carry that lottery.
        row["vs_floor_best"] = ours["seconds_min"] / floor["seconds_min"]
        row["floor_ok_best"] = row["vs_floor_best"] <= 1.1
        if peers:
            fastest = min(peers, key=lambda k: peers[k]["seconds_median"])
            peer_t = peers[fastest]["seconds_median"]
            row["fastest_peer"] = fastest
            row["speedup_vs_fastest_peer"] = peer_t / ours["seconds_median"]
            best_peer = min(v["seconds_min"] for v in peers.values())
            row["speedup_vs_fastest_peer_best"] = best_peer / ours["seconds_min"]
            need = 1.5 if peer_t / floor["seconds_median"] >= PEER_ABOVE_FLOOR else 1.0
            row["speedup_needed"] = need
            row["peer_ok"] = row["speedup_vs_fastest_peer"] >= need
            if ours["peak_mem_mb"] is not None:
                least = min(v["peak_mem_mb"] for v in peers.values())
                row["mem_vs_least_peer"] = ours["peak_mem_mb"] / least if least > 0 else math.nan
                row["mem_ok"] = ours["peak_mem_mb"] <= least * (1 + MEM_TOL) + MEM_SLACK_MB
        out.append(row)
    _reasons(out, groups)
    return out


WITHIN = 1.2  # issue 36: every row within 1.2× plain torch, or the reason beside it


def _reasons(rows: list[dict[str, Any]], groups: dict[tuple, dict[str, dict[str, Any]]]) -> None:
    """``within``: the toolkit within WITHIN× of plain torch (medians); where not, ``reason``
    states what the gap is: the extra milliseconds per call over the floor's, and the largest
    size of the same problem and method, with its ratio, so a fixed per-call overhead (the
    same milliseconds, shrinking as a share of larger calls) reads as one."""
    for row in rows:
        row["within"] = row["vs_floor"] <= WITHIN
        if row["within"]:
            continue
        by = groups[(row["problem"], row["size"], row["method"])]
        extra = (by["bilevel"]["seconds_median"] - by["plain_torch"]["seconds_median"]) * 1e3
        reason = f"+{extra:.2f} ms per call over a {by['plain_torch']['seconds_median'] * 1e3:.2f} ms floor"
        larger = [r for r in rows if (r["problem"], r["method"]) == (row["problem"], row["method"])
                  and r["size"] > row["size"]]
        if larger:
            big = max(larger, key=lambda r: r["size"])
            reason += f"; at size {big['size']}: {big['vs_floor']:.2f}×"
        row["reason"] = reason


def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown report: one table of measurements and one of targets."""
    rows = [[r["problem"], str(r["size"]), r["method"], r["library"],
             harness.fmt(r.get("seconds_median"), "ms"), harness.fmt(r.get("ratio_vs_floor"), "x"),
             harness.fmt(r.get("peak_mem_mb")), harness.fmt(r.get("rel_error"), "err"),
             harness.fmt(r.get("rel_error_vs_f64_same_method"), "err"), r.get("note", "")]
            for r in records]
    text = [
        f"# Hypergradient benchmark ({meta['mode']})",
        "",
        f"Environment: {meta['env']}. T = K = {meta['steps']} (inner steps / solver iterations).",
        "Times: median ms per hypergradient, libraries alternating round-robin in one process.",
        "Peak: MiB allocated by one call above what was live before it. Errors: relative, against",
        "the exact float64 hypergradient, and against float64 plain torch doing the same computation.",
        "",
        harness.markdown_table(["problem", "size", "method", "library", "ms", "× floor", "peak MiB",
                                "err vs exact", "err vs f64 same", "note"], rows),
        "",
        "## Targets (toolkit = `bilevel`)",
        "",
        "Verdicts use medians (the issue's statistic); the best-of columns show the same ratios",
        "from each candidate's fastest call, which preemption on a shared machine cannot inflate.",
        f"`peer ok`: toolkit at least `need`× faster than the fastest peer (1.5 where that peer is ≥ "
        f"{PEER_ABOVE_FLOOR:.2f}× the floor, else 1.0). `mem ok`: peak no higher than any peer's "
        f"(within {MEM_TOL:.0%} or {MEM_SLACK_MB * 1024:.0f} KiB). Peers whose result is off "
        f"float64 plain torch (same computation) by more than {SAME_TOL:g} are wrong and excluded.",
        "",
    ]
    def verdict(t: dict[str, Any], key: str) -> str:
        return "–" if key not in t else ("yes" if t[key] else "**MISSED**")

    trows = [[t["problem"], str(t["size"]), t["method"], harness.fmt(t["vs_floor"], "x"),
              verdict(t, "floor_ok"), harness.fmt(t["vs_floor_best"], "x"),
              t.get("fastest_peer", "–"), harness.fmt(t.get("speedup_vs_fastest_peer"), "x"),
              harness.fmt(t.get("speedup_vs_fastest_peer_best"), "x"),
              harness.fmt(t.get("speedup_needed")), verdict(t, "peer_ok"),
              harness.fmt(t.get("mem_vs_least_peer"), "x"), verdict(t, "mem_ok"),
              "yes" if t["within"] else t["reason"]]
             for t in targets(records)]
    text.append(harness.markdown_table(
        ["problem", "size", "method", "toolkit / floor", "≤ 1.1×", "/ floor (best-of)",
         "fastest peer", "speedup", "speedup (best-of)", "need", "peer ok", "mem / least peer",
         "mem ok", f"≤ {WITHIN}× floor, or why not"], trows))
    return "\n".join(text) + "\n"


def warm_start_iterations(
    p: BenchProblem,
    *,
    outer_steps: int = 10,
    inner_steps: int = 5,
    outer_lr: float = 0.01,
    tol: float = 1e-6,
    maxiter: int = 1000,
) -> dict[str, Any]:
    """CG iterations per outer step of AID on ``p`` with and without warm start.

    Each run starts at the benchmark point (α, θ ≈ θ*), takes ``outer_steps`` Adam steps of
    size ``outer_lr`` on α along AID's hypergradient and copies θ^(T) (``inner_steps``
    gradient steps of size 1/λ_max) into θ after each step; CG stops at relative residual
    ``tol``. Returns both iteration lists and the largest relative difference between the
    two runs' hypergradients and how many steps of each run CG stopped at negative curvature.
    """
    import bilevel

    problem = bilevel.Problem(upper=p.upper, lower=p.lower)
    iters, grads, breakdowns = {}, {}, {}
    for warm in (False, True):
        outer = p.alpha.clone().requires_grad_()
        inner = [t.clone().requires_grad_() for t in p.theta]
        solver = bilevel.AID(
            inner_steps,
            p.inner_lr,
            linear_solver=bilevel.linalg.CG(maxiter=maxiter, tol=tol),
            warm_start=warm,
        )
        seen: list[torch.Tensor] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            history = bilevel.fit(
                problem, solver, outer, inner, steps=outer_steps, progress=False,
                outer_optimizer=torch.optim.Adam([outer], lr=outer_lr), inner_update="solution",
                upper_batch=p.upper_batch, lower_batch=p.lower_batch,
                callback=lambda k, r, seen=seen: seen.append(r.outer_grad.clone()),
            )
        iters[warm], grads[warm] = history.column("solver_iterations"), seen
        # CG stops where pᵀAp ≤ 0 (a non-convex lower level): count those steps
        breakdowns[warm] = sum("not positive definite" in str(w.message) for w in caught)
    diff = max(harness.rel_error(w, c) for w, c in zip(grads[True], grads[False]))
    return {
        "cold": iters[False],
        "warm": iters[True],
        "max_rel_diff": diff,
        "breakdowns": (breakdowns[False], breakdowns[True]),
    }


def warm_start_table(names: list[str], quick: bool, out: Path) -> str:
    """Run :func:`warm_start_iterations` on each problem and size; print and save a table."""
    lines = [
        "# AID warm start: CG iterations per outer step (float64, CG tol 1e-6)",
        "",
        "10 outer Adam steps (lr 0.01) from the benchmark point, θ ← θ^(T) after 5 inner steps.",
        "",
        "| problem | size | cold: iterations per step | warm: iterations per step | "
        "cold total | warm total | saved | max rel. diff of dF/dα | pᵀAp ≤ 0 stops (cold/warm) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for size in (QUICK if quick else FULL)[name][:2]:
            torch.manual_seed(0)
            p = build(name, size).cast(torch.float64)
            r = warm_start_iterations(p)
            cold, warm = sum(r["cold"]), sum(r["warm"])
            row = (
                f"| {name} | {p.size} | {' '.join(f'{x:.0f}' for x in r['cold'])} | "
                f"{' '.join(f'{x:.0f}' for x in r['warm'])} | {cold:.0f} | {warm:.0f} | "
                f"{100 * (cold - warm) / cold:.0f} % | {r['max_rel_diff']:.1e} | "
                f"{r['breakdowns'][0]}/{r['breakdowns'][1]} |"
            )
            print(row, flush=True)
            lines.append(row)
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small sizes, few repeats (< 5 min on 2 CPU cores)")
    ap.add_argument("--smallest", action="store_true",
                    help="only the smallest size of each problem (CI)")
    ap.add_argument("--problems", nargs="+", default=["quadratic", "logistic", "mlp"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--sizes", nargs="+", type=int, help="override the sizes (one problem only)")
    ap.add_argument("--steps", type=int, default=20, help="T inner steps = K solver iterations")
    ap.add_argument("--repeats", type=int, default=None, help="most timing rounds (default 200)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per method group")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: least noisy on a shared machine)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output stem (default bench/results/hypergrad[_quick])")
    ap.add_argument("--render", type=Path, default=None,
                    help="only re-render this JSON file's table")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (CI)")
    ap.add_argument("--warm-start", action="store_true",
                    help="only count AID's CG iterations with and without warm start (side by side)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.warm_start:
        torch.set_num_threads(args.threads)
        stem = harness.RESULTS / f"warm_start{'_quick' if args.quick else ''}"
        warm_start_table(args.problems, args.quick, stem.with_suffix(".md"))
        return 0

    if args.render is not None:
        data = json.loads(args.render.read_text())
        text = render(data["records"], data["meta"])
        args.render.with_suffix(".md").write_text(text)
        print(text)
        return 0
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    mode = "quick" if args.quick else "full"
    # Rounds continue until the time budget is spent (at least 3, at most ``repeats``): fast
    # calls get many rounds, which their noise needs, slow ones get few.
    repeats = args.repeats or 200
    budget_s = args.budget if args.budget is not None else (3.0 if args.quick else 20.0)
    out = (
        args.out
        or harness.RESULTS
        / f"hypergrad{'_quick' if args.quick else ''}{'_' + device.type if device.type != 'cpu' else ''}"
    )
    meta = {"mode": mode, "steps": args.steps, "env": harness.environment(device),
            "repeats": repeats}
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    _measure_all(args, device, repeats, budget_s, rec)
    text = render(rec.records, meta)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _measure_all(args: argparse.Namespace, device: torch.device, repeats: int, budget_s: float,
                 rec: harness.Recorder) -> None:
    """`measure` every method on every size of every problem, each record added to ``rec``."""
    for name in args.problems:
        sizes = args.sizes or (QUICK if args.quick else FULL)[name]
        if args.smallest:
            sizes = sizes[:1]
        for size in sizes:
            torch.manual_seed(0)
            p64 = build(name, size)
            p32 = p64.cast(torch.float32, device)
            p64 = p64.cast(torch.float64, device)
            print(f"{name} size {p32.size} ({p64.exact_note}; {p64.detail})", flush=True)
            for method in args.methods:
                for r in measure(p32, p64, method, args.steps, device=device, repeats=repeats,
                                 budget_s=budget_s, memory=not args.no_memory):
                    r["detail"] = p64.detail
                    r["env_device"] = device.type
                    rec.add(r)
            del p32, p64


if __name__ == "__main__":
    raise SystemExit(main())
