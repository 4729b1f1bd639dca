"""bilevel's solvers beside benchopt's bilevel benchmark (github.com/benchopt/benchmark_bilevel)
on its ``simulated`` quadratic problem, in one process.

    python -m bench.benchopt_bilevel --benchmark-dir PATH [--n-inner 4096] [--timeout 20]

The benchmark's own Dataset (its generator and random state) makes the matrices; its
Objective gives the starting point; its JAX Solvers SOBA, SABA, StocBiO, F2SA and BOME run
the way benchopt's runner runs them (``Solver.get_instance``, ``_set_objective`` with its JIT
warm-up, ``run`` with benchopt's ``_Callback`` and the solver's own
``SufficientProgressCriterion``, which pause the clock while the callback evaluates). The
same matrices, converted to torch (bench/benchopt_problem.py), run bilevel's SOBA, SABA,
stocBiO (AID with Neumann and fresh batches), F2SA, BOME and AID-CG through the same
callback and criterion. benchopt's ``benchopt run`` is not used: it could not run the torch
solvers in the same process, and its curves carry no iterates; every curve here is evaluated
by the port's float64 closed form from the iterate (‖∇h(x_k)‖² and ‖z*(x_k) − z_k‖²).

``--check`` (run first, in a subprocess with JAX in float64) compares the port with the
benchmark's own JAX functions on the benchmark's matrices: values and gradients on batches
and the metrics; the run stops if any relative error exceeds 1e-10.

Writes bench/results/benchopt_bilevel.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import bilevel

from . import harness
from .benchopt_problem import ARRAYS, SimulatedProblem, from_arrays

# The benchmark's best parameters (config/quadratics_021424_best_params.yml) where it has
# them (SABA, StocBiO, F2SA); its defaults for SOBA and BOME (no best-params entry).
PARAMS: dict[str, dict[str, Any]] = {
    "SOBA": {"step_size": 0.1, "outer_ratio": 1.0, "batch_size": 64, "eval_freq": 16},
    "SABA": {"step_size": 0.1, "outer_ratio": 1.0, "batch_size": 64, "eval_freq": 64,
             "mode_init_memory": "zero"},
    "StocBiO": {"step_size": 0.1, "outer_ratio": 1.0, "batch_size": 64, "eval_freq": 16,
                "n_inner_steps": 10, "n_shia_steps": 10},
    "F2SA": {"step_size": 0.1, "outer_ratio": 1.0, "batch_size": 64, "eval_freq": 16,
             "n_inner_steps": 10, "lmbda0": 1.0, "delta_lmbda": 0.01},
    "BOME": {"step_size": 0.1, "outer_ratio": 1.0, "eta": 0.5, "n_inner_steps": 10,
             "choice_phi": "grad_norm"},
}
FILES = {"SOBA": "soba", "SABA": "saba", "StocBiO": "stocbio", "F2SA": "f2sa", "BOME": "bome"}
CHECK_TOL = 1e-10


def require_peers() -> None:
    """benchopt and jax (the ``bench`` extra), or a SystemExit naming the missing one."""
    for pkg in ("benchopt", "jax", "jaxlib"):
        if importlib.util.find_spec(pkg) is None:
            raise SystemExit(f"bench.benchopt_bilevel needs the package {pkg!r}, which is not "
                             "installed: pip install -e '.[bench]' (benchopt 1.10, jax CPU)")


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def closure_arrays(jitted: Any) -> dict[str, Any]:
    """The five arrays a benchmark ``get_function`` objective closes over, by name."""
    fn = jitted.__wrapped__
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    return {k: cells[k] for k in ARRAYS}


def load_benchmark(bdir: Path, args: argparse.Namespace) -> tuple[Any, SimulatedProblem, Any]:
    """(the benchmark's Objective with its data set, the torch port, the Dataset's data).
    Runs in a temporary directory: the benchmark's generator caches to ./__cache__."""
    if not (bdir / "datasets" / "simulated.py").is_file():
        raise SystemExit(f"--benchmark-dir {bdir}: no datasets/simulated.py there; clone "
                         "github.com/benchopt/benchmark_bilevel")
    sys.path.insert(0, str(bdir))
    dataset_cls = _load(bdir / "datasets" / "simulated.py", "bb_simulated").Dataset
    objective_cls = _load(bdir / "objective.py", "bb_objective").Objective
    dataset = dataset_cls.get_instance(
        n_samples_inner=args.n_inner, n_samples_outer=args.n_outer, dim_inner=args.dim_inner,
        dim_outer=args.dim_outer)
    objective = objective_cls.get_instance()
    objective._set_dataset(dataset)
    port = SimulatedProblem(from_arrays(closure_arrays(objective.f_inner)),
                            from_arrays(closure_arrays(objective.f_outer)))
    return objective, port, dataset._get_data()


@contextlib.contextmanager
def _in_tempdir():
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(old)


def check(args: argparse.Namespace) -> dict[str, float]:
    """Relative errors of the port against the benchmark's JAX objectives (float64)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    with _in_tempdir():
        objective, port, data = load_benchmark(args.benchmark_dir, args)
    rng = np.random.default_rng(0)
    err: dict[str, float] = {"value": 0.0, "grad_inner": 0.0, "grad_outer": 0.0,
                             "metric_value": 0.0, "metric_inner_distance": 0.0}

    def rel(a: Any, b: Any) -> float:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))

    for _ in range(3):
        z, x = rng.standard_normal(args.dim_inner), rng.standard_normal(args.dim_outer)
        zt, xt = (torch.tensor(v, requires_grad=True) for v in (z, x))
        for jf, q in ((objective.f_inner, port.inner), (objective.f_outer, port.outer)):
            for start, size in ((0, 64), (128, 64), (0, q.n_samples)):
                val, (gz, gx) = jax.value_and_grad(jf, argnums=(0, 1))(z, x, start, size)
                tv = q(zt, xt, start, size)
                tz, tx = torch.autograd.grad(tv, (zt, xt))
                err["value"] = max(err["value"], rel(float(tv), float(val)))
                err["grad_inner"] = max(err["grad_inner"], rel(tz.numpy(), gz))
                err["grad_outer"] = max(err["grad_outer"], rel(tx.numpy(), gx))
        ref = data["metrics"](z, x)
        mine = port.metrics(torch.tensor(z), torch.tensor(x))
        err["metric_value"] = max(err["metric_value"], rel(mine["value"], ref["value"]))
        err["metric_inner_distance"] = max(err["metric_inner_distance"],
                                           rel(mine["inner_distance"], ref["inner_distance"]))
    return err


class Sampler:
    """The benchmark's minibatch sampler in torch: batches in a random order, reshuffled
    after each pass; ``draw()`` -> (index, (start, size))."""

    def __init__(self, n: int, size: int, seed: int) -> None:
        if n % size:
            raise SystemExit(f"{n} samples are not a multiple of the batch size {size}")
        self.n_batches, self.size = n // size, size
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.i = torch.randperm(self.n_batches, generator=self.gen), 0

    def draw(self) -> tuple[int, tuple[int, int]]:
        if self.i == self.n_batches:
            self.order, self.i = torch.randperm(self.n_batches, generator=self.gen), 0
        idx = int(self.order[self.i])
        self.i += 1
        return idx, (idx * self.size, self.size)


class TorchRun:
    """One of bilevel's solvers as a benchopt callback-strategy solver (``run(callback)``,
    ``get_result``), so benchopt's own ``_Callback`` and stopping criterion time it."""

    sampling_strategy = None

    def __init__(self, name: str, port: SimulatedProblem, z0: Any, x0: Any, seed: int) -> None:
        self.name, self.p = name, PARAMS.get(name, {})
        q32g, q32f = port.inner.to(torch.float32), port.outer.to(torch.float32)
        self.problem = bilevel.Problem(upper=lambda x, z, b: q32f(z, x, *b),
                                       lower=lambda x, z, b: q32g(z, x, *b))
        self.n_in, self.n_out = q32g.n_samples, q32f.n_samples
        self.z0 = torch.as_tensor(np.asarray(z0), dtype=torch.float32)
        self.x0 = torch.as_tensor(np.asarray(x0), dtype=torch.float32)
        self.seed = seed
        self.eval_freq = self.p.get("eval_freq", 1)
        self.inner_var, self.outer_var = self.z0.clone(), self.x0.clone()

    @staticmethod
    def get_next(stop_val: int) -> int:
        return stop_val + 1

    def get_result(self) -> dict[str, Any]:
        return {"inner_var": self.inner_var, "outer_var": self.outer_var}

    def run(self, callback: Callable[[], bool]) -> None:
        z, x, k = self.z0.clone(), self.x0.clone(), 0
        step = self._stepper()
        while callback():
            for _ in range(self.eval_freq):
                z, x = step(z, x, k)
                k += 1
            self.inner_var, self.outer_var = z, x

    def _stepper(self) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[Any, Any]]:
        p, prob, name = self.p, self.problem, self.name
        if name == "BOME" or name == "AID-CG":
            full_f, full_g = (0, self.n_out), (0, self.n_in)
            solver: Any = (bilevel.BOME(p["n_inner_steps"], p["step_size"], eta=p["eta"])
                           if name == "BOME" else
                           bilevel.AID(10, 0.1, bilevel.linalg.CG(maxiter=10, tol=1e-6,
                                       on_unconverged="ignore"), warm_start=True))

            def full(z, x, k):
                r = solver.step(prob, x, z, upper_batch=full_f, lower_batch=full_g)
                x = x - 0.1 * r.outer_grad
                z = z - 0.1 * r.inner_grad if name == "BOME" else r.inner_solution
                return z, x
            return full
        b = p["batch_size"]
        sg, sf = Sampler(self.n_in, b, self.seed), Sampler(self.n_out, b, self.seed + 1)
        lr, ratio = p["step_size"], p["outer_ratio"]
        if name == "SOBA":
            state = {"s": bilevel.SOBA(lr)}

            def soba(z, x, k):
                rho = lr / math.sqrt(k + 1)  # the benchmark's 1/√k decay of both steps
                s = dataclasses.replace(state["s"], v_lr=rho)
                s.load_state_dict(state["s"].state_dict())
                state["s"] = s
                r = s.step(prob, x, z, upper_batch=sf.draw()[1], lower_batch=sg.draw()[1])
                return z - rho * r.inner_grad, x - rho / ratio * r.outer_grad
            return soba
        if name == "SABA":
            saba = bilevel.SABA(lr, n_upper=sf.n_batches, n_lower=sg.n_batches)

            def saba_step(z, x, k):
                r = saba.step(prob, x, z, upper_batch=bilevel.Indexed(*sf.draw()),
                              lower_batch=bilevel.Indexed(*sg.draw()))
                return z - lr * r.inner_grad, x - lr / ratio * r.outer_grad
            return saba_step
        if name == "StocBiO":
            aid = bilevel.AID(p["n_inner_steps"], lr, bilevel.linalg.Neumann(
                steps=p["n_shia_steps"], lr=lr, on_unconverged="ignore"),
                lower_batches=lambda: sg.draw()[1], fresh_inner_steps=True)

            def stocbio(z, x, k):
                r = aid.step(prob, x, z, upper_batch=sf.draw()[1], lower_batch=sg.draw()[1])
                return r.inner_solution, x - lr / ratio * r.outer_grad
            return stocbio
        state = {"s": None}

        def f2sa(z, x, k):
            # the benchmark's schedules: z step lr/(k+1)^{4/7} (one inner_lr here serves
            # z and y), outer lr/(k+1)^{4/7}/ratio, λ_k = λ0 + Σ_{j<k} δ/(j+1)^{1/7}
            beta = lr / (k + 1) ** (4 / 7)
            lam = p["lmbda0"] + sum(p["delta_lmbda"] / (j + 1) ** (1 / 7) for j in range(k))
            s = bilevel.F2SA(p["n_inner_steps"], beta, lam=lam, lower_batches=lambda: sg.draw()[1])
            if state["s"] is not None:
                s.load_state_dict(state["s"].state_dict())
            state["s"] = s
            r = s.step(prob, x, z, upper_batch=sf.draw()[1], lower_batch=sg.draw()[1])
            return r.inner_solution, x - beta / ratio * r.outer_grad
        return f2sa


def oracles_per_step(name: str, n_in: int, n_out: int) -> int:
    """Sample oracles per outer step (one gradient, or one Hessian/Jacobian-vector product,
    of one sample's f_j or g_i), from the algorithms as the benchmark writes them."""
    b = 64
    return {"SOBA": 3 * b, "SABA": 3 * b, "StocBiO": 22 * b, "F2SA": 33 * b,
            "BOME": 12 * n_in + n_out, "AID-CG": 22 * n_in + n_out}[name]


def run_one(solver: Any, port: SimulatedProblem, timeout: float,
            sync: Callable[[Any], None] | None = None) -> list[dict[str, float]]:
    """benchopt's callback loop on ``solver``; the curve (iteration, seconds, metrics).

    ``sync(solver)`` runs before each callback reads the clock: JAX dispatches asynchronously,
    so without it a step's computation finishes inside the next evaluation (whose time
    benchopt excludes) and the solver's own time counts only the dispatch. The evaluation is
    the two metrics the table uses, ‖∇h(x)‖² and ‖z*(x) − z‖², in float64 closed form.
    """
    from benchopt.callback import _Callback
    from benchopt.stopping_criterion import SufficientProgressCriterion

    def evaluate(result: dict[str, Any]) -> list[dict[str, float]]:
        z = torch.as_tensor(np.asarray(result["inner_var"]), dtype=torch.float64)
        x = torch.as_tensor(np.asarray(result["outer_var"]), dtype=torch.float64)
        return [{"objective_value": float(port.hypergradient(x).square().sum()),
                 "objective_inner_distance": float((port.inner_solution(x) - z).square().sum())}]

    crit = getattr(solver, "_stopping_criterion", None) or SufficientProgressCriterion(
        patience=12_800, strategy="callback")
    crit = crit.get_runner_instance(solver=solver, max_runs=10**9, timeout=timeout)
    cb = _Callback(evaluate, solver, {}, crit)
    cb.start()
    solver.run(synced(cb, solver, sync))
    return [{"it": c["stop_val"], "time": c["time"], "value": c["objective_value"],
             "inner_distance": c["objective_inner_distance"]} for c in cb.curve]


def synced(callback: Callable[[], bool], solver: Any,
           sync: Callable[[Any], None] | None) -> Callable[[], bool]:
    """``callback`` that first waits for ``solver``'s pending work (``sync(solver)``), so the
    time benchopt's callback measures since its last call includes the step's computation."""
    if sync is None:
        return callback

    def wait_then_call() -> bool:
        sync(solver)
        return callback()
    return wait_then_call


def block_until_ready(solver: Any) -> None:
    """Wait for a JAX solver's last dispatched step (its current iterates)."""
    import jax
    jax.block_until_ready([getattr(solver, "inner_var", None), getattr(solver, "outer_var", None)])


def time_to(curve: list[dict[str, float]], tol: float, key: str = "time") -> float | None:
    return next((c[key] for c in curve if c["value"] <= tol), None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--benchmark-dir", type=Path, required=True,
                        help="a checkout of github.com/benchopt/benchmark_bilevel")
    parser.add_argument("--n-inner", type=int, default=4096)
    parser.add_argument("--n-outer", type=int, default=1024)
    parser.add_argument("--dim-inner", type=int, default=100)
    parser.add_argument("--dim-outer", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--tols", type=float, nargs="+", default=[1e-2, 1e-4],
                        help="tolerances on ‖∇h‖² relative to its value at x0")
    parser.add_argument("--solvers", nargs="+", default=[*PARAMS, "AID-CG"])
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "benchopt_bilevel")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Check the port against the benchmark, run every solver in both libraries, write the
    JSON, the table and the PNG."""
    args = _parser().parse_args(argv)
    args.benchmark_dir = args.benchmark_dir.resolve()
    require_peers()
    torch.set_num_threads(1)
    if args.check:
        print(json.dumps(check(args)))
        return 0
    cmd = [sys.executable, "-m", "bench.benchopt_bilevel", "--check", "--benchmark-dir",
           str(args.benchmark_dir), "--n-inner", str(args.n_inner), "--n-outer",
           str(args.n_outer), "--dim-inner", str(args.dim_inner), "--dim-outer", str(args.dim_outer)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    agreement = json.loads(done.stdout.strip().splitlines()[-1])
    if max(agreement.values()) > CHECK_TOL:
        raise SystemExit(f"the torch port disagrees with the benchmark: {agreement}")
    with _in_tempdir():
        objective, port, _ = load_benchmark(args.benchmark_dir, args)
        import jax

        meta = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                         if k != "benchmark_dir"},
                "env": {**harness.environment(torch.device("cpu")), "jax": jax.__version__,
                        "benchopt": importlib.metadata.version("benchopt")},
                "port_vs_benchmark_float64": agreement, "params": PARAMS}
        h0 = port.metrics(torch.as_tensor(np.asarray(objective.inner_var0)),
                          torch.as_tensor(np.asarray(objective.outer_var0)))["value"]
        meta["value_at_x0"] = h0
        meta["load"] = [os.getloadavg()[0]]
        rec = harness.Recorder(args.out.with_suffix(".json"), meta)
        for name in args.solvers:
            libs = ["bilevel"] if name not in PARAMS else ["benchopt_jax", "bilevel"]
            for lib in libs:
                print(name, lib, flush=True)
                if lib == "bilevel":
                    solver: Any = TorchRun(name, port, objective.inner_var0,
                                           objective.outer_var0, seed=1)
                else:
                    cls = _load(args.benchmark_dir / "solvers" / f"{FILES[name]}.py",
                                f"bb_solver_{FILES[name]}").Solver
                    solver = cls.get_instance(**{k: v for k, v in PARAMS[name].items()})
                    solver._set_objective(objective)  # benchopt's: set_objective + JIT warm-up
                curve = run_one(solver, port, args.timeout,
                                sync=None if lib == "bilevel" else block_until_ready)
                freq = PARAMS.get(name, {}).get("eval_freq", 1)
                per = oracles_per_step(name, args.n_inner, args.n_outer)
                for c in curve:
                    c["oracles"] = c["it"] * freq * per
                rec.add({"solver": name, "library": lib, "curve": curve,
                         **{f"time_to_{t:g}": time_to(curve, t * h0) for t in args.tols},
                         **{f"oracles_to_{t:g}": time_to(curve, t * h0, "oracles")
                            for t in args.tols}})
    meta["load"].append(os.getloadavg()[0])
    rec.save()
    write_md_png(args.out, rec.records, meta, args.tols)
    return 0


def write_md_png(out: Path, records: list[dict[str, Any]], meta: dict[str, Any],
                 tols: Sequence[float]) -> None:
    """The time-to-tolerance table (bilevel / benchmark ratio) and the curves' PNG."""
    by = {(r["solver"], r["library"]): r for r in records}
    rows = []
    for (name, lib), r in by.items():
        if lib != "bilevel":
            continue
        peer = by.get((name, "benchopt_jax"))
        cells = [name]
        for t in tols:
            mine, theirs = r[f"time_to_{t:g}"], peer and peer[f"time_to_{t:g}"]
            cells += [harness.fmt(mine), harness.fmt(theirs),
                      harness.fmt(mine / theirs, "x") if mine and theirs else "–"]
        final = r["curve"][-1]
        cells += [f"{final['value']:.2e}", f"{peer['curve'][-1]['value']:.2e}" if peer else "–"]
        rows.append(cells)
    head = ["solver"]
    for t in tols:
        head += [f"bilevel s to {t:g}·h0", f"benchmark s to {t:g}·h0", "ratio"]
    head += ["bilevel final ‖∇h‖²", "benchmark final ‖∇h‖²"]
    a = meta["args"]
    text = (f"# bilevel beside benchopt's bilevel benchmark (simulated quadratic)\n\n"
            f"n_inner={a['n_inner']}, n_outer={a['n_outer']}, dim_inner={a['dim_inner']}, "
            f"dim_outer={a['dim_outer']}, {a['timeout']:g} s per run, one repeat (seed 1). "
            f"‖∇h(x0)‖² = h0 = {meta['value_at_x0']:.3g}. Environment: {meta['env']}.\n\n"
            f"1-minute load average of the machine at the start / end: {meta['load'][0]:.2f} / "
            f"{meta['load'][1]:.2f} ({meta['env']['cpus']} CPUs; about 1 = this run alone on it).\n\n"
            f"Port vs the benchmark's JAX functions (float64, max rel. error): "
            f"{meta['port_vs_benchmark_float64']}\n\n"
            + harness.markdown_table(head, rows) + "\n\nratio = bilevel's seconds / the "
            "benchmark's (> 1: bilevel slower); – = the tolerance was not reached within "
            "the run. Time excludes the callback's evaluations and, for the benchmark, its JIT "
            "warm-up in `set_objective` (benchopt's convention; BOME jits inside `run`, so its "
            "compilation is in its curve). JAX dispatches asynchronously: each JAX step is "
            "waited for (`jax.block_until_ready`) before benchopt's callback reads the clock, "
            "so its time is the step's, not only its dispatch.\n")
    out.with_suffix(".md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for r in records:
        style = "-" if r["library"] == "bilevel" else "--"
        label = f"{r['solver']} ({r['library']})"
        for col, xkey in enumerate(("oracles", "time")):
            for row, ykey in enumerate(("value", "inner_distance")):
                xs = [c[xkey] for c in r["curve"]]
                axes[row][col].loglog([max(v, 1e-3) for v in xs],
                                      [c[ykey] for c in r["curve"]], style, label=label)
    for row, y in enumerate(("‖∇h(x_k)‖²", "‖z*(x_k) − z_k‖²")):
        for col, x in enumerate(("sample oracles", "seconds")):
            axes[row][col].set_xlabel(x)
            axes[row][col].set_ylabel(y)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)


if __name__ == "__main__":
    raise SystemExit(main())
