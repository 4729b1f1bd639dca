"""A study's cells and how they run: each cell is an ordinary ``python -m apps.calm_llm`` run
directory ``<root>/<variant>-seed<k>``, made in a subprocess, so a study can be killed at any
time: an interrupted cell resumes from its checkpoints (``--resume``), a finished one (every
requested row in ``metrics.json``) is skipped. Every cell's arguments are parsed by the run's
own config parser before anything starts, so a bad option fails the whole study at once, naming
the cell.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from apps.calm_llm.config import Config, ConfigError, parse_args
from apps.study.design import Study, Variant
from apps.study.estimates import estimate_s
from apps.study.integrity import read_results


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of a study: a variant at one training seed."""

    variant: Variant
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant.name}-seed{self.seed}"

    def argv(self, study: Study) -> list[str]:
        """The cell's ``python -m apps.calm_llm`` arguments."""
        return [*study.common, "--seed", str(self.seed), "--methods", *self.variant.methods,
                *self.variant.args]

    def config(self, study: Study) -> Config:
        """The cell's run configuration, as ``python -m apps.calm_llm`` will parse it; a
        ConfigError names the cell and the study."""
        try:
            return parse_args(self.argv(study))
        except ConfigError as e:
            raise ConfigError(f"study {study.name}, cell {self.name}: {e}") from e


def cells(study: Study) -> list[Cell]:
    """Variant-major order (the first variants have every seed before later ones start), or
    seed-major with ``study.seed_major``."""
    out = [Cell(v, s) for v in study.variants for s in (v.seeds or study.seeds)]
    if study.seed_major:
        out.sort(key=lambda c: (c.seed, study.variants.index(c.variant)))  # stable, by seed
    return out


def done(run_dir: Path, cell: Cell) -> bool:
    """Whether every requested method has its row in the cell's metrics.json; a metrics.json
    that cannot be read raises ``DamagedCell`` naming it (never counted as not run: a summary
    would drop that seed silently, a rerun would start over a cell that finished)."""
    results = read_results(run_dir)
    return results is not None and all(m in results for m in cell.variant.methods)


def run(study: Study, root: Path, *, dry_run: bool = False, python: str = sys.executable,
        after_cell: Callable[[Cell], None] | None = None, jobs: int = 1) -> int:
    """Run every unfinished cell in order; one progress line per cell with the study's ETA.
    ``after_cell(cell)`` is called after each cell that finished (e.g. to publish it at once, so
    a session that ends mid-study loses no finished cell). (The CLI checks the split discipline
    first: ``discipline.check``.)

    ``jobs`` cells run at once, each on its own share of the CPUs (``_core_shares``); the order
    cells start in is the same, the log and ``after_cell`` are serialized.
    """
    if jobs < 1:
        raise ValueError(f"jobs: at least one cell at a time, got {jobs}")
    todo = [c for c in cells(study) if not done(root / c.name, c)]
    est = {c.name: estimate_s(study, c) for c in todo}  # parses every cell: a bad one fails here
    _announce(study, todo, est, dry_run)
    if dry_run:
        return 0
    root.mkdir(parents=True, exist_ok=True)
    log = root / "cells.jsonl"
    lock = threading.Lock()
    slots: queue.SimpleQueue[list[int]] = queue.SimpleQueue()  # the cores each running cell may use
    for share in _core_shares(jobs):
        slots.put(share)
    t_start = time.time()
    tally = {"spent": 0.0, "predicted": 0.0, "failures": 0}

    def one(i: int, c: Cell) -> None:
        run_dir = root / c.name
        where = ["--resume", str(run_dir)] if (run_dir / "config.json").is_file() else \
            ["--out", str(run_dir)]
        argv = [python, "-m", "apps.calm_llm", *(c.argv(study) if where[0] == "--out" else []), *where]
        with lock:  # measured cells rescale the estimate of the rest
            scale = tally["spent"] / tally["predicted"] if tally["predicted"] else 1.0
            eta = scale * sum(est[x.name] for x in todo[i:]) / 60 / min(jobs, len(todo) - i)
            print(f"[{i + 1}/{len(todo)}] {c.name}: started {time.strftime('%H:%M')}, study ETA "
                  f"{eta:.0f} min", flush=True)
        cores = slots.get()
        t0 = time.time()
        try:
            rc = _launch(argv, root / f"{c.name}.log", cores if jobs > 1 else None)
        finally:
            slots.put(cores)
        dt = time.time() - t0
        with lock:
            tally["spent"] += dt
            tally["predicted"] += est[c.name]
            with open(log, "a") as f:
                f.write(json.dumps({"cell": c.name, "rc": rc, "seconds": round(dt, 1),
                                    "argv": argv[3:]}) + "\n")
            print(f"[{i + 1}/{len(todo)}] {c.name}: {'done' if rc == 0 else f'FAILED (rc {rc})'} in "
                  f"{dt / 60:.1f} min (log {run_dir}.log)", flush=True)
            tally["failures"] += rc != 0
            if rc == 0 and after_cell is not None:
                after_cell(c)

    if jobs == 1:
        for i, c in enumerate(todo):
            one(i, c)
    else:  # the pool takes cells in order; an error in one (not a failed cell) is raised here
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            for f in [pool.submit(one, i, c) for i, c in enumerate(todo)]:
                f.result()
    failures = int(tally["failures"])
    print(f"study {study.name}: {len(todo) - failures} cells run, {failures} failed, "
          f"{(time.time() - t_start) / 60:.0f} min")
    return 1 if failures else 0


def _launch(argv: list[str], log: Path, cores: list[int] | None) -> int:
    """Run one cell's command, appending its output to ``log``; with ``cores``, at
    ``OMP_NUM_THREADS`` = len(cores) and pinned to them. Returns its exit status."""
    env = None if cores is None else {**os.environ, "OMP_NUM_THREADS": str(max(1, len(cores)))}
    with open(log, "a") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        if cores is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):  # exited already, or pinning not allowed
                os.sched_setaffinity(proc.pid, cores)  # torch's threads, made later, inherit it
        return proc.wait()


def _announce(study: Study, todo: list[Cell], est: dict[str, float], dry_run: bool) -> None:
    """The study's first line (cells, cells to run, the estimate); with ``dry_run`` every
    cell's state or estimate and its command line."""
    if study.flops is not None:
        f = study.flops
        print(f"study {study.name}: {len(cells(study))} cells, {len(todo)} to run, estimated "
              f"{sum(est.values()) / 3600:.0f} GPU-hours on one GPU at {f.utilization:.0%} of "
              f"{f.peak_flops / 1e12:.0f} TFLOP/s, scaled by FLOPs from CPU step ratios "
              f"({study.description})")
    else:
        print(f"study {study.name}: {len(cells(study))} cells, {len(todo)} to run, "
              f"estimated {sum(est.values()) / 60:.0f} min = {sum(est.values()) / 3600:.1f} h of "
              f"the 2-core CPU machine ({study.description})")
    if dry_run:
        for c in cells(study):
            unit = (3600, "GPU-h") if study.flops is not None else (60, "min")
            state = "done" if c not in todo else f"~{est[c.name] / unit[0]:.1f} {unit[1]}"
            print(f"  {c.name:<22} {state:<10} python -m apps.calm_llm {' '.join(c.argv(study))}")


def _core_shares(jobs: int) -> list[list[int]]:
    """This process's CPUs dealt into ``jobs`` equal, disjoint shares (the remainder left out;
    with fewer CPUs than jobs, shares of one CPU are reused round-robin). A cell run with
    ``jobs`` > 1 gets ``OMP_NUM_THREADS`` = its share's size and, where the OS allows, is pinned
    to it, so two cells on a 2-core machine do not fight over both cores (torch's default of
    one thread per CPU in each would oversubscribe them); ``jobs=1`` leaves the environment."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    if len(cpus) < jobs:
        return [[cpus[k % len(cpus)]] for k in range(jobs)]
    per = len(cpus) // jobs
    return [cpus[k * per:(k + 1) * per] for k in range(jobs)]

