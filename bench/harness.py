"""Measurement: alternating timing, peak memory of one call, errors, JSON and markdown output.

Every number the benchmarks publish is a ratio of runs taken side by side in one process:
``time_alternating`` runs the candidates round-robin (rotating the order each round) so
that machine-load drift hits all of them alike, and reports per-candidate medians.
"""

from __future__ import annotations

import collections
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock times cover the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_alternating(
    runs: dict[str, Callable[[], Any]],
    *,
    device: torch.device,
    warmup: int = 1,
    repeats: int = 7,
    budget_s: float = float("inf"),
    min_repeats: int = 3,
) -> dict[str, list[float]]:
    """Seconds per call of each run, measured round-robin after ``warmup`` rounds.

    Round r starts at candidate r mod n. Stops after ``repeats`` rounds, or after
    ``min_repeats`` rounds once ``budget_s`` seconds have passed.
    """
    names = list(runs)
    gc.collect()
    for _ in range(warmup):
        for name in names:
            runs[name]()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        # A cyclic-GC pass inside a timed call would charge one candidate for everyone's
        # garbage: collect between rounds (young generations: a full pass over torch's heap
        # costs ~0.1 s), never during one.
        gc.collect(1)
        gc.disable()
        try:
            for name in order:
                sync(device)
                t0 = time.perf_counter()
                runs[name]()
                sync(device)
                times[name].append(time.perf_counter() - t0)
        finally:
            gc.enable()
        if r + 1 >= min_repeats and time.perf_counter() - start > budget_s:
            break
    return times


def peak_memory_mb(
    fn: Callable[[], Any], device: torch.device, enabled: bool = True
) -> float | None:
    """Peak bytes allocated by ``fn()`` above what was live before it, in MiB.

    CUDA: the allocator's peak statistic. CPU: torch keeps no such statistic, so the
    profiler records every allocation and free, and the running sum's maximum is the peak
    (tensors only; Python objects and allocator caching are not counted). ``enabled=False``
    returns None without calling ``fn`` (the profiler takes seconds to start).
    """
    if not enabled:
        return None
    gc.collect()
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak / 2**20


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ computed in float64."""
    got64, ref64 = got.detach().double().cpu().reshape(-1), ref.detach().double().cpu().reshape(-1)
    denom = float(ref64.norm())
    return float((got64 - ref64).norm()) / denom if denom > 0 else float((got64 - ref64).norm())


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


class Recorder:
    """Collects records and rewrites ``path`` after each one, so partial runs survive."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.records: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.save()

    def save(self) -> None:
        """Rewrite ``path`` now (e.g. after ``meta`` changed)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "records": self.records}, indent=1))
        tmp.replace(self.path)


def fmt(value: Any, kind: str = "") -> str:
    """Compact table cell: ms for seconds, 2 significant digits for errors."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if kind == "ms":
        return f"{1000 * value:.3g}"
    if kind == "err":
        return f"{value:.1e}"
    if kind == "x":
        return f"{value:.2f}×"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratios(times: dict[str, list[float]], ref: str, name: str) -> dict[str, float]:
    """min / median / max over rounds of ``ref``'s time over ``name``'s in the same round of
    `time_alternating` (> 1: ``name`` is faster). Each round's pair ran back to back, so its
    ratio is what load drift disturbs least; the range is the speed-up's spread."""
    ratios = [a / b for a, b in zip(times[ref], times[name])]
    return {"min": min(ratios), "median": median(ratios), "max": max(ratios)}


def run_logged(cmd: list[str]) -> tuple[int, float, str]:
    """Run ``cmd`` with its output echoed as it comes (progress bars stay visible); returns
    (exit code, wall seconds, its last 60 lines, kept for a failure report)."""
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    tail: collections.deque[str] = collections.deque(maxlen=60)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            tail.append(line)
    return proc.returncode, time.time() - t0, "".join(tail)
