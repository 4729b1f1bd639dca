"""The default run's SFT step under a competing load: torch threads × OpenMP wait policy × load.

    python -m bench.contention [--quick] [--threads 1 2] [--policies passive active default]
                               [--loads none busy twin] [--steps 12] [--repeats 1]

Each cell is one subprocess ``python -m apps.calm_llm --methods sft --steps N --threads T
--no-zero-shot --checkpoint-every 0 --n-ood 8`` with ``OMP_WAIT_POLICY`` exported (``passive``,
``active``, or ``default``: exported empty, which the CLI turns into libgomp's own default),
while a competitor runs beside it:

- ``none``: nothing;
- ``busy``: a plain Python busy loop (one runnable thread), started before the cell;
- ``twin``: a second copy of the same command (same threads and policy, twice the steps, so it
  is still training when the measured copy ends), started at the same moment.

The measured number is the median ``step_seconds`` of the run's own history
(``history_sft.jsonl``, written by the app around each optimizer step), first step left out
(warm-up). ``--n-ood 8`` only shortens the evaluation after training: out-of-domain questions are
drawn separately from the in-domain ones, so the training batches are the default run's.

Per cell: ``slowdown`` = its step time / the same threads and policy with no load;
``fair`` = the slowdown that a fair share of the CPUs allows: with C usable CPUs, a run of t
threads beside k runnable competitor threads gets min(t, C·t/(t + k)) CPUs instead of min(t, C),
so fair = min(t, C) / min(t, C·t/(t + k)) (on 2 CPUs: 1.5× for 2 threads beside a busy loop,
2× beside a 2-thread twin, 1× for 1 thread beside either); ``vs fair`` = slowdown / fair (≤ 1:
it slows at most in proportion to the CPU it gets); ``vs best`` = its step time / the fastest
uncontended cell. ``cpu/wall`` is the whole run's CPU seconds over its wall seconds (os.wait4):
a spinning OpenMP pool shows up there. A probe per policy also measures the CPU an idle
2-thread pool burns while the main thread sleeps (20 × 50 ms after a parallel op): the check
that the policy reached libgomp.

Writes bench/results/contention[_quick].json and .md. ``--quick``: the tiny model
(``--config tiny``), 4 steps, for a smoke test; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import harness

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"passive": "PASSIVE", "active": "ACTIVE", "default": ""}
COMPETITOR_THREADS = {"none": 0, "busy": 1}  # twin: as many as the measured run

SPIN_PROBE = """
import resource, time
import apps.calm_llm.__main__  # sets the wait policy exactly as the CLI does
import torch
torch.set_num_threads(2)
x = torch.randn(2_000_000)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for _ in range(20):
    (x * 2.0).sum()  # one parallel region, then the pool has nothing to do
    time.sleep(0.05)
r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
print((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), wall)
"""


def child_env(policy: str) -> dict[str, str]:
    """The environment of a cell: the policy exported, thread-count variables removed (the
    cell's ``--threads`` decides), this checkout first on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["OMP_WAIT_POLICY"] = POLICIES[policy]
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TQDM_DISABLE"] = "1"
    return env


def app_command(out: Path, *, threads: int, steps: int, quick: bool) -> list[str]:
    """The measured command: the default run's SFT (the tiny preset with --quick)."""
    cmd = [sys.executable, "-m", "apps.calm_llm", "--methods", "sft", "--steps", str(steps),
           "--threads", str(threads), "--no-zero-shot", "--checkpoint-every", "0", "--out", str(out)]
    return cmd + (["--config", "tiny"] if quick else ["--n-ood", "8"])


def fair_slowdown(threads: int, competitor_threads: int, cpus: int) -> float:
    """min(t, C) / min(t, C·t/(t + k)): the slowdown of a fair share of ``cpus`` CPUs."""
    alone = min(threads, cpus)
    if competitor_threads == 0:
        return 1.0
    return alone / min(threads, cpus * threads / (threads + competitor_threads))


def run_cell(threads: int, policy: str, load: str, *, steps: int, quick: bool) -> dict[str, Any]:
    """One measurement: the app's SFT run beside ``load``; its step times and CPU use."""
    env = child_env(policy)
    with tempfile.TemporaryDirectory(prefix="contention-") as tmp:
        competitor = None
        if load == "busy":
            competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        elif load == "twin":
            twin = app_command(Path(tmp) / "twin", threads=threads, steps=2 * steps, quick=quick)
            competitor = subprocess.Popen(twin, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
        log = Path(tmp) / "run.log"  # a file, not a pipe: a full pipe would block the child
        t0 = time.perf_counter()
        with open(log, "wb") as fh:
            proc = subprocess.Popen(app_command(Path(tmp) / "run", threads=threads, steps=steps,
                                                quick=quick),
                                    env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)  # its own CPU time, not the competitor's
        wall = time.perf_counter() - t0
        err = log.read_text(errors="replace")
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped above: Popen must not wait
        if competitor is not None:
            competitor.kill()
            competitor.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"cell threads={threads} policy={policy} load={load} failed "
                               f"(exit {proc.returncode}):\n{err[-3000:]}")
        history = Path(tmp) / "run" / "history_sft.jsonl"
        steps_s = [json.loads(line)["step_seconds"] for line in history.read_text().splitlines()]
    timed = steps_s[1:] or steps_s  # the first step warms up the allocator and the kernels
    return {"threads": threads, "policy": policy, "load": load, "step_seconds": steps_s,
            "s_per_step": statistics.median(timed), "run_wall_s": wall,
            "run_cpu_s": usage.ru_utime + usage.ru_stime}


def spin_probe(policy: str) -> dict[str, Any]:
    """CPU seconds an idle 2-thread OpenMP pool burns over 1 s of sleeps under ``policy``."""
    out = subprocess.run([sys.executable, "-c", SPIN_PROBE], env=child_env(policy), cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    cpu, wall = float(out[-2]), float(out[-1])
    return {"policy": policy, "idle_cpu_s": cpu, "wall_s": wall}


def summarize(records: list[dict[str, Any]], cpus: int) -> None:
    """Add slowdown, fair, vs_fair and vs_best to every record (in place)."""
    alone = {(r["threads"], r["policy"]): r["s_per_step"] for r in records if r["load"] == "none"}
    best = min(alone.values()) if alone else float("nan")
    for r in records:
        k = COMPETITOR_THREADS.get(r["load"], r["threads"])
        base = alone.get((r["threads"], r["policy"]), float("nan"))
        r["slowdown"] = r["s_per_step"] / base
        r["fair"] = fair_slowdown(r["threads"], k, cpus)
        r["vs_fair"] = r["slowdown"] / r["fair"]
        r["vs_best"] = r["s_per_step"] / best
        r["cpu_per_wall"] = r["run_cpu_s"] / r["run_wall_s"]


def markdown(meta: dict[str, Any], records: list[dict[str, Any]], probes: list[dict[str, Any]]) -> str:
    """The tables of the .md file: the cells, then the idle-pool probe."""
    rows = [[str(r["threads"]), r["policy"], r["load"], harness.fmt(r["s_per_step"]),
             harness.fmt(r["slowdown"], "x"), harness.fmt(r["fair"], "x"),
             harness.fmt(r["vs_fair"], "x"), harness.fmt(r["vs_best"], "x"),
             f"{r['cpu_per_wall']:.2f}"] for r in records]
    probe_rows = [[p["policy"], f"{p['idle_cpu_s']:.3f}", f"{p['wall_s']:.2f}"] for p in probes]
    return "\n\n".join([
        f"# SFT step under contention ({'quick, tiny model' if meta['quick'] else 'default run'})",
        f"{meta['env']['date']}, {meta['cpus']} usable CPUs, load average at start "
        f"{meta['loadavg'][0]:.2f}, torch {meta['env']['torch']}, {meta['steps']} steps per run "
        f"(first left out), median of {meta['repeats']} repeat(s).",
        harness.markdown_table(["threads", "OMP_WAIT_POLICY", "load", "s/step", "slowdown",
                                "fair", "vs fair", "vs best", "cpu/wall"], rows),
        "Idle 2-thread pool (1 s of sleeps after parallel ops): CPU seconds burnt.",
        harness.markdown_table(["OMP_WAIT_POLICY", "idle CPU s", "wall s"], probe_rows),
    ]) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, 4 steps (smoke test)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--loads", nargs="+", default=["none", "busy", "twin"],
                    choices=["none", "busy", "twin"])
    ap.add_argument("--steps", type=int, default=None, help="SFT steps per run (12; 4 --quick)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over all cells (median kept)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 12)
    if args.steps < 2 or args.repeats < 1 or min(args.threads) < 1:
        ap.error(f"--steps must be >= 2 (the first is warm-up), --repeats >= 1 and --threads >= 1;"
                 f" got {args.steps}, {args.repeats}, {args.threads}")
    if "none" not in args.loads:
        ap.error("--loads must include 'none': every slowdown is relative to the uncontended run")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse(argv)
    out = args.out or harness.RESULTS / ("contention_quick" if args.quick else "contention")
    from apps.calm_llm.threads import usable_cpus

    cpus = usable_cpus()
    meta = {"env": harness.environment(torch.device("cpu")), "cpus": cpus, "quick": args.quick,
            "loadavg": list(os.getloadavg()), "steps": args.steps, "repeats": args.repeats}
    cells = [(t, p, ld) for ld in args.loads for p in args.policies for t in args.threads]
    runs: dict[tuple, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # one pass over every cell per repeat: drift hits all alike
        for cell in cells:
            r = run_cell(*cell, steps=args.steps, quick=args.quick)
            runs.setdefault(cell, []).append(r)
            print(f"threads {cell[0]} {cell[1]:>7} load {cell[2]:>4}: {r['s_per_step']:.3f} s/step",
                  flush=True)
    records = [dict(rs[0], s_per_step=statistics.median(r["s_per_step"] for r in rs),
                    repeats=[r["s_per_step"] for r in rs]) for rs in runs.values()]
    summarize(records, cpus)
    probes = [spin_probe(p) for p in args.policies]
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "records": records, "idle_probe": probes}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, records, probes))
    print(out.with_suffix(".md").read_text())
    return result


if __name__ == "__main__":
    main()
