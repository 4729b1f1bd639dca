"""Memory and time per outer step as the work grows (issue 5, part 3).

    python -m bench.scaling [--quick] [--smallest]

1. Against T (inner steps, 1 to 64) on the MLP problem: ``ITD`` (unrolled through all T
   steps), ``ITD(truncate=4)`` (back-propagation through the last min(T, 4) steps only),
   ``AID`` (T graph-free steps, then CG with 20 iterations) and ``BOME`` (T graph-free steps,
   first order). One outer step = one ``solver.step`` from θ*.
2. Against the inner dimension d on the logistic problem, each solver at T = 10.

Records: ``problem``, ``size``, ``library`` (``bilevel``), ``method`` (family: ``unrolled``,
``implicit_cg``, ``first_order``), ``solver``, ``T``, ``seconds_median``, ``peak_mem_mb`` and
``rel_error`` of the outer gradient against the exact hypergradient (ITD and AID; BOME's
direction is not a hypergradient, so None). Writes bench/results/scaling[_quick].json/.md
and the PNG plots scaling_T[_quick].png and scaling_dim[_quick].png.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import bilevel

from . import harness
from .problems import BenchProblem, build

TRUNCATE = 4
CG_ITERS = 20
DIM_T = 10
FULL = {"T": [1, 2, 4, 8, 16, 32, 64], "mlp": 256, "dims": [100, 1000, 10_000, 100_000]}
QUICK = {"T": [1, 4, 16], "mlp": 32, "dims": [100, 1000]}
SOLVERS = {  # name -> (method family, factory(T, lr))
    "ITD": ("unrolled", lambda T, lr: bilevel.ITD(T, lr)),
    f"ITD-truncated-{TRUNCATE}": (
        "unrolled",
        lambda T, lr: bilevel.ITD(T, lr, truncate=min(T, TRUNCATE)),
    ),
    "AID": ("implicit_cg", lambda T, lr: bilevel.AID(T, lr, bilevel.linalg.CG(CG_ITERS, tol=0.0))),
    "BOME": ("first_order", lambda T, lr: bilevel.BOME(T, lr)),
}


def step_runs(p: BenchProblem, T: int) -> dict[str, Any]:
    """One ``solver.step`` per solver at (α, θ*) with T inner steps of size 1/λ_max."""
    problem = bilevel.Problem(upper=p.upper, lower=p.lower)
    runs = {}
    for name, (_, factory) in SOLVERS.items():
        solver = factory(T, p.inner_lr)

        def run(solver: Any = solver) -> Any:
            return solver.step(
                problem, p.alpha, p.theta, upper_batch=p.upper_batch, lower_batch=p.lower_batch
            )

        runs[name] = run
    return runs


def measure(
    p32: BenchProblem,
    p64: BenchProblem,
    T: int,
    *,
    device: torch.device,
    budget_s: float,
    memory: bool = True,
) -> list[dict[str, Any]]:
    """One record per solver at this (problem, size, T)."""
    runs = step_runs(p32, T)
    outputs = {name: run().outer_grad for name, run in runs.items()}
    mem = {name: harness.peak_memory_mb(run, device, memory) for name, run in runs.items()}
    times = harness.time_alternating(runs, device=device, repeats=100, budget_s=budget_s)
    out = []
    for name in runs:
        first_order = SOLVERS[name][0] == "first_order"
        out.append(
            {
                "problem": p32.name,
                "size": p32.size,
                "library": "bilevel",
                "method": SOLVERS[name][0],
                "solver": name,
                "T": T,
                "seconds_median": harness.median(times[name]),
                "seconds_min": min(times[name]),
                "seconds_all": times[name],
                "peak_mem_mb": mem[name],
                "rel_error": None if first_order else harness.rel_error(outputs[name], p64.exact),
            }
        )
        print(
            f"  {p32.name} {p32.size} T={T:3d} {name:18s} "
            f"{1000 * out[-1]['seconds_median']:9.2f} ms  peak {harness.fmt(mem[name]):>9s} MiB",
            flush=True,
        )
    return out


def plot(records: list[dict[str, Any]], x: str, path: Path, title: str) -> None:
    """Time and peak memory against ``x`` (``T`` or ``size``), one line per solver."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in SOLVERS:
        rs = sorted((r for r in records if r["solver"] == name), key=lambda r: r[x])
        xs = [r[x] for r in rs]
        axes[0].plot(xs, [1000 * r["seconds_median"] for r in rs], marker="o", label=name)
        if all(r["peak_mem_mb"] is not None for r in rs):
            axes[1].plot(xs, [r["peak_mem_mb"] for r in rs], marker="o", label=name)
    for ax, ylabel in zip(axes, ["ms per outer step (median)", "peak MiB per outer step"]):
        ax.set_xscale("log", base=2 if x == "T" else 10)
        ax.set_yscale("log")
        ax.set_xlabel("inner steps T" if x == "T" else "inner dimension d")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = [
        [
            r["study"],
            r["problem"],
            str(r["size"]),
            str(r["T"]),
            r["solver"],
            harness.fmt(r["seconds_median"], "ms"),
            harness.fmt(r["peak_mem_mb"]),
            harness.fmt(r["rel_error"], "err"),
        ]
        for r in records
    ]
    header = ["study", "problem", "size", "T", "solver", "ms", "peak MiB", "err vs exact"]
    return (
        f"# Scaling ({meta['mode']})\n\nEnvironment: {meta['env']}. AID uses CG with "
        f"{CG_ITERS} iterations; truncated ITD back-propagates through min(T, {TRUNCATE}) steps.\n\n"
        + harness.markdown_table(header, rows)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T in {1, 4, 16}, small sizes")
    ap.add_argument("--smallest", action="store_true", help="one T and one dimension (CI)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per group")
    ap.add_argument("--out", type=Path, default=None, help="output stem")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (CI)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = QUICK if args.quick else FULL
    ts, dims = cfg["T"], cfg["dims"]
    if args.smallest:
        ts, dims = ts[:1], dims[:1]
    budget = args.budget if args.budget is not None else (2.0 if args.quick else 15.0)
    suffix = "_quick" if args.quick else ""
    stem = args.out or harness.RESULTS / f"scaling{suffix}"
    meta = {"mode": "quick" if args.quick else "full", "env": harness.environment(device)}
    rec = harness.Recorder(stem.with_suffix(".json"), meta)

    p64 = build("mlp", cfg["mlp"])
    p32 = p64.cast(torch.float32, device)
    mlp_size = p32.size
    print(f"T study on mlp, {mlp_size} parameters", flush=True)
    for T in ts:
        for r in measure(p32, p64, T, device=device, budget_s=budget, memory=not args.no_memory):
            rec.add({**r, "study": "T"})
    for d in dims:
        p64 = build("logistic", d)
        p32 = p64.cast(torch.float32, device)
        print(f"dimension study on logistic, d = {d}", flush=True)
        for r in measure(
            p32, p64, DIM_T, device=device, budget_s=budget, memory=not args.no_memory
        ):
            rec.add({**r, "study": "dim"})
    records = rec.records
    plot(
        [r for r in records if r["study"] == "T"],
        "T",
        stem.parent / f"{stem.name.replace('scaling', 'scaling_T')}.png",
        f"Outer step vs T (MLP, {mlp_size} inner parameters)",
    )
    plot(
        [r for r in records if r["study"] == "dim"],
        "size",
        stem.parent / f"{stem.name.replace('scaling', 'scaling_dim')}.png",
        f"Outer step vs inner dimension (logistic, T = {DIM_T})",
    )
    text = render(records, meta)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
