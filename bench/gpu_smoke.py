"""A few steps of every method on one model: step time and peak memory per method.

    python -m bench.gpu_smoke --model allenai/Llama-3.1-Tulu-3-8B-DPO          # one GPU, <= 10 min
    python -m bench.gpu_smoke --model smollm2 --dtype fp32 --device cpu         # the CPU ratios
    python -m bench.gpu_smoke --config tiny --methods sft calm --steps 2        # a test

One ordinary run of ``python -m apps.calm_llm`` in a subprocess, on the paper-7b preset
(letter mode, LoRA r = 128 on all linear layers, bf16, gradient checkpointing, CALM's T = 3
inner steps) with tiny data sizes (24 training / 8 calibration / 16 test and out-of-domain
questions, no bootstrap, no checkpoints), ``--steps`` optimizer steps (3) per method. Every
training step writes ``step_seconds`` and, on a GPU, ``max_memory_gib`` to the run's
``history_<method>.jsonl``; this script reads them back and prints per method the median step
time after the first step (which pays for compilation and allocator warm-up), its ratio to
``sft``'s, and the peak memory, then writes ``bench/results/gpu_smoke[_NAME].json`` and ``.md``.
A method that fails is reported with the tail of the run's log; the others still count.

The ratios to SFT measured on the CPU with SmolLM2 are what ``apps.study``'s paper-7b GPU-hour
estimate scales by FLOPs (docs/calm.md, "Studies").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import harness

METHODS = ("sft", "label_smoothing", "rcft", "calm", "calm_iterate", "calm_regularization",
           "calm_scalar")
# small enough that loading the model and scoring are a small part of the ten minutes
SIZES = ("--n-train", "24", "--n-calib", "8", "--n-test", "16", "--n-ood", "16", "--n-boot", "0",
         "--no-zero-shot", "--checkpoint-every", "0")


def read_history(run_dir: Path, method: str) -> list[dict[str, Any]]:
    """The per-step records a run wrote for ``method`` (``[]`` when it has none)."""
    f = run_dir / f"history_{method}.jsonl"
    if not f.is_file():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    """Median step seconds after the first step (all steps when there is only one), the first
    step's seconds, and the largest recorded peak memory (GiB; ``None`` off the GPU)."""
    times = [h["step_seconds"] for h in history if "step_seconds" in h]
    if not times:
        return {"steps": 0}
    steady = times[1:] or times
    mem = [h["max_memory_gib"] for h in history if "max_memory_gib" in h]
    return {"steps": len(times), "first_step_s": times[0], "step_s": statistics.median(steady),
            "max_memory_gib": max(mem) if mem else None}


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | steps | s per step | vs sft | first step s | peak memory GiB |",
             "|---|---|---|---|---|---|"]
    base = rows.get("sft", {}).get("step_s")
    for m, r in rows.items():
        if not r.get("steps"):
            lines.append(f"| {m} | 0 | failed | – | – | – |")
            continue
        ratio = f"{r['step_s'] / base:.2f}×" if base else "–"
        mem = f"{r['max_memory_gib']:.1f}" if r.get("max_memory_gib") is not None else "–"
        lines.append(f"| {m} | {r['steps']} | {r['step_s']:.3f} | {ratio} | {r['first_step_s']:.3f} | {mem} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="paper-7b", help="preset or file (default: paper-7b)")
    ap.add_argument("--model", default="", help="model name or folder (default: the preset's)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per method")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="", choices=("", "fp32", "bf16"), help="default: the preset's")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                    help="further apps.calm_llm options, passed as given (last on the line)")
    ap.add_argument("--name", default="", help="suffix of the results files")
    ap.add_argument("--out", type=Path, default=None,
                    help="results path without suffix (default: bench/results/gpu_smoke[_NAME])")
    ap.add_argument("--keep", default="", help="run directory to keep (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.keep) if args.keep else Path(tmp) / "run"
        cmd = [sys.executable, "-m", "apps.calm_llm", "--config", args.config, *SIZES,
               "--steps", str(args.steps), "--device", args.device, "--methods", *args.methods,
               "--out", str(run_dir)]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--dtype", args.dtype] if args.dtype else []
        cmd += args.extra
        returncode, wall, tail = harness.run_logged(cmd)
        rows = {m: summarize(read_history(run_dir, m)) for m in args.methods}
        config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}

    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    meta = {"env": harness.environment(device), "command": cmd[1:], "returncode": returncode,
            "wall_s": round(wall, 1), "model": config.get("model", {}).get("name_or_path", args.model),
            "dtype": config.get("model", {}).get("dtype")}
    print(table(rows))
    print(f"wall {wall / 60:.1f} min, exit code {returncode}")
    if returncode != 0:
        meta["log_tail"] = tail
    out = args.out or harness.RESULTS / (f"gpu_smoke_{args.name}" if args.name else "gpu_smoke")
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    for m, r in rows.items():
        rec.add({"method": m, **r})
    out.with_suffix(".md").write_text(f"# {' '.join(cmd[1:])}\n\n{table(rows)}\n")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    result = main()
    raise SystemExit(result["meta"]["returncode"])
