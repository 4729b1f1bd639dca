"""The GPU path in one self-contained command: every method on Llama-3.1-8B's shape, no download.

    python -m bench.gpu_check                                  # one GPU: the 8B shape, < 10 min
    python -m bench.gpu_check --layers 8                       # less memory and time
    python -m bench.gpu_check --device cpu --layers 1 --hidden 64 --steps 2   # this machine

What runs: ordinary runs of ``python -m apps.calm_llm`` in subprocesses (the real code path:
config validation, data loading through ``--data-files``, model loading, LoRA, training,
scoring, export, and for open QA sampling), on the ``paper-7b`` preset (letter mode, LoRA
r = 128 on all linear layers, gradient checkpointing, bf16, CALM's T = 3 inner steps) with

* the model ``random:llama-3.1-8b[@layers=N,hidden=H]`` (`apps.calm_llm.synthetic`: built on
  the meta device and materialized on the target device in bf16 with random weights, a
  tokenizer learned in code), so nothing is downloaded and no model file is needed;
* synthetic questions written as .jsonl (`apps.calm_llm.data.synthetic`): arithmetic (in
  domain) and word categories (out of domain) multiple choice, open arithmetic and open
  category questions for open QA; 24 training / 8 calibration / 16 test questions per set;
* four runs: the first-order methods (sft, label_smoothing, rcft, calm with BOME, calm_iterate,
  calm_regularization, calm_scalar), calm through ITD, calm through AID (both with eager
  attention, which the second-order solvers need), and open QA (sft and calm: training,
  then 4 sampled answers per question).

Per method (row) it prints and writes ``bench/results/gpu_check[_NAME].json`` and ``.md``: the
median step time after the first step, the first step's time, the peak device memory (GPU
only), training tokens per second (the mean token count of the run's training questions as
collated, times batch size × gradient accumulation, over the median step time), every step's
loss, and the test-set accuracy and ECE (open QA: Semantic-ECE). Every one of those numbers must
be finite; a run that fails or a number that is not finite makes the exit code 1 (open QA's
AUROC is left out: it is undefined when a random model answers nothing right).

Then `bench.device_agreement`: a tiny model of the same architecture and one batch in float64
on the CPU against float32 on ``--device`` (the CPU itself when there is no GPU): option
log-likelihoods, BOME's directions and the ITD and AID hypergradients, each within its stated
tolerance (printed with the largest deviation; exit code 1 beyond it).

Start-up included, the default (32 layers, bf16, one H100) is sized to end in under 10 minutes:
each run loads the model in seconds (random init on the device) and takes 3 optimizer steps per
method on small batches; scoring 16 + 16 questions and sampling 4 × 4 answers per set are
seconds. That is a design estimate until a GPU has run it (docs/calm.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import harness
from .gpu_smoke import read_history

ARCH = "llama-3.1-8b"
FIRST_ORDER = ("sft", "label_smoothing", "rcft", "calm", "calm_iterate", "calm_regularization",
               "calm_scalar")
ROWS = (*FIRST_ORDER, "calm_itd", "calm_aid", "open_qa_sft", "open_qa_calm")
COMMON = ("--config", "paper-7b", "--n-calib", "8", "--n-boot", "0", "--no-zero-shot",
          "--checkpoint-every", "0")
# the synthetic sets: kind, rows written, and the source name the app sees
DATA = {"synth_arith": ("arithmetic", 80), "synth_words": ("categories", 40),
        "synth_open": ("open_arithmetic", 80), "synth_open_words": ("open_categories", 40)}


@dataclass(frozen=True)
class RunSpec:
    """One ``apps.calm_llm`` run: its name, the app's methods, the rows they are reported as,
    and its own options."""

    name: str
    methods: tuple[str, ...]
    rows: tuple[str, ...]
    options: tuple[str, ...]


# multiple choice: arithmetic in domain, word categories out of domain
MCQA = ("--in-domain", "synth_arith", "--out-of-domain", "synth_words", "--n-train", "24",
        "--n-test", "16", "--n-ood", "16")
RUNS = (
    RunSpec("first_order", FIRST_ORDER, FIRST_ORDER, MCQA),
    RunSpec("itd", ("calm",), ("calm_itd",), ("--solver", "itd", *MCQA)),
    RunSpec("aid", ("calm",), ("calm_aid",), ("--solver", "aid", *MCQA)),
    RunSpec("open_qa", ("sft", "calm"), ("open_qa_sft", "open_qa_calm"),
            ("--task", "open_qa", "--in-domain", "synth_open", "--out-of-domain", "synth_open_words",
             "--n-train", "24", "--n-test", "4", "--n-ood", "4", "--upper-objective",
             "answer_tokens", "--n-samples", "4", "--max-new-tokens", "8", "--gen-batch-size", "4")),
)


def plan(rows: list[str]) -> list[tuple[RunSpec, tuple[str, ...]]]:
    """The runs that produce ``rows``, each with the app methods it needs (in table order)."""
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise ValueError(f"--methods {' '.join(unknown)}: unknown; choose from {' '.join(ROWS)}")
    out = []
    for spec in RUNS:
        methods = tuple(m for m, r in zip(spec.methods, spec.rows) if r in rows)
        if methods:
            out.append((spec, methods))
    return out


def model_name(layers: int, hidden: int, vocab: int = 0) -> str:
    """``random:llama-3.1-8b`` with the overrides asked for (0 = the architecture's own)."""
    over = [f"{k}={v}" for k, v in (("layers", layers), ("hidden", hidden), ("vocab", vocab)) if v]
    return f"random:{ARCH}" + ("@" + ",".join(over) if over else "")


def write_data(folder: Path, seed: int = 0) -> list[str]:
    """The synthetic sets as .jsonl files; returns the ``--data-files`` entries."""
    from apps.calm_llm.data import synthetic

    return [f"{name}={synthetic.write_jsonl(synthetic.questions(kind, n, seed=seed), folder / f'{name}.jsonl')}"
            for name, (kind, n) in DATA.items()]


def tokens_per_step(run_dir: Path) -> float:
    """Mean collated tokens of the run's training questions × batch size × grad accumulation,
    read back through the app's own config, data loading and collator."""
    from apps.calm_llm.config import from_dict
    from apps.calm_llm.data import Collator
    from apps.calm_llm.synthetic import synthetic_tokenizer

    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    vocab = _vocab_size(cfg.model.name_or_path)
    tok = synthetic_tokenizer(vocab)
    if cfg.task == "open_qa":
        from apps.calm_llm.tasks.open_qa import load_open_qa_splits, to_instruction

        train = [to_instruction(ex) for ex in load_open_qa_splits(cfg).train]
        collator = Collator(tok, mode="cloze", prompt_style=cfg.data.prompt_style)
    else:
        from apps.calm_llm.tasks.mcqa import load_data

        train = list(load_data(cfg).train)
        collator = Collator(tok, mode=cfg.data.mode, prompt_style=cfg.data.prompt_style,
                            max_options=cfg.data.max_options)
    # what a training batch holds: the gold sequence alone (cloze trains on it; letter and
    # instruction examples have one sequence anyway), cut to --max-length as collated
    lengths = [min(len(ids), cfg.model.max_length + 1)
               for ex in train for ids, _ in collator.sequences(ex, options="gold")]
    return statistics.mean(lengths) * cfg.train.batch_size * cfg.train.grad_accum


def _vocab_size(name: str) -> int:
    from apps.calm_llm.synthetic import random_config

    return int(random_config(name).vocab_size)


def summarize(history: list[dict[str, Any]], step_tokens: float | None) -> dict[str, Any]:
    """Steps, median step seconds after the first (all when one), first step's seconds, peak
    memory (GiB; None off the GPU), training tokens per second, and every step's loss."""
    times = [h["step_seconds"] for h in history if "step_seconds" in h]
    if not times:
        return {"steps": 0}
    step_s = _nan_or(statistics.median, times[1:] or times)
    mem = [h["max_memory_gib"] for h in history if "max_memory_gib" in h]
    return {"steps": len(times), "first_step_s": times[0], "step_s": step_s,
            "max_memory_gib": _nan_or(max, mem) if mem else None,
            "tokens_per_s": step_tokens / step_s if step_tokens and step_s > 0 else None,
            "losses": [h.get("loss") for h in history]}


def _nan_or(f: Any, xs: list[float]) -> float:
    """``f(xs)``, or NaN when some x is not finite or missing (the history writes a NaN as
    null; max and median would pass over a NaN)."""
    return f(xs) if all(isinstance(x, int | float) and math.isfinite(x) for x in xs) else math.nan


def scores(run_dir: Path, method: str) -> dict[str, float]:
    """Per test set: accuracy and conf-ECE (open QA: Semantic-ECE) from the run's metrics.json."""
    f = run_dir / "metrics.json"
    if not f.is_file():
        return {}
    res = json.loads(f.read_text()).get("results", {}).get(method, {})
    out = {}
    for ds, r in res.items():
        ece = "semantic_ece" if "semantic_ece" in r else "conf_ece"
        out[f"{ds}_accuracy"], out[f"{ds}_{ece}"] = r.get("accuracy"), r.get(ece)
    return out


def not_finite(row: dict[str, Any], *, gpu: bool = False) -> list[str]:
    """The names of a row's numbers that are missing or not finite (peak memory may be None
    off the GPU only)."""
    bad = []
    for key, v in row.items():
        if key in ("steps", "failed") or (key == "max_memory_gib" and v is None and not gpu):
            continue
        values = v if isinstance(v, list) else [v]
        if not values or any(isinstance(x, bool) or not isinstance(x, int | float)
                             or not math.isfinite(x) for x in values):
            bad.append(key)
    return bad


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | steps | s per step | first step s | peak GiB | tokens/s | losses | test scores |",
             "|---|---|---|---|---|---|---|---|"]
    for m, r in rows.items():
        if not r.get("steps"):
            lines.append(f"| {m} | 0 | failed ({r.get('failed', 'no steps')}) | – | – | – | – | – |")
            continue
        mem = f"{r['max_memory_gib']:.1f}" if r.get("max_memory_gib") is not None else "–"
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "–"
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        sc = ", ".join(f"{k} {v:.3f}" for k, v in r.get("scores", {}).items())
        lines.append(f"| {m} | {r['steps']} | {r['step_s']:.3f} | {r['first_step_s']:.3f} | {mem} | "
                     f"{tps} | {losses} | {sc} |")
    return "\n".join(lines)


def run_one(spec: RunSpec, methods: tuple[str, ...], base: list[str], work: Path) -> dict[str, Any]:
    """One app run; its rows (summaries, scores, what is not finite) and its record."""
    run_dir = work / spec.name
    cmd = [sys.executable, "-m", "apps.calm_llm", *base, *spec.options, "--methods", *methods,
           "--out", str(run_dir)]
    code, wall, tail = harness.run_logged(cmd)
    step_tokens = tokens_per_step(run_dir) if (run_dir / "config.json").is_file() else None
    rows = {}
    for m in methods:
        row = spec.rows[spec.methods.index(m)]
        r = summarize(read_history(run_dir, m), step_tokens)
        if r["steps"]:
            r["scores"] = scores(run_dir, m)
        else:
            r["failed"] = f"run {spec.name} exit {code}"
        rows[row] = r
    record = {"run": spec.name, "command": cmd[1:], "returncode": code, "wall_s": round(wall, 1)}
    if code != 0:
        record["log_tail"] = tail
    return {"rows": rows, "record": record}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, ...")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0 = the 8B model's 32)")
    ap.add_argument("--hidden", type=int, default=0,
                    help="width (0 = the 8B model's 4096; heads and FFN scale with it)")
    ap.add_argument("--vocab", type=int, default=0,
                    help="vocabulary (0 = the 8B model's 128,256; a CPU test may shrink the head)")
    ap.add_argument("--methods", nargs="+", default=list(ROWS), help=f"rows to run, of {' '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per method")
    ap.add_argument("--no-agreement", action="store_true", help="skip the float64/float32 check")
    ap.add_argument("--name", default="", help="suffix of the results files")
    ap.add_argument("--out", type=Path, default=None,
                    help="results path without suffix (default: bench/results/gpu_check[_NAME])")
    ap.add_argument("--keep", type=Path, default=None, help="folder to keep the runs in (default: temporary)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.steps < 1 or min(args.layers, args.hidden, args.vocab) < 0:
        ap.error("--steps must be >= 1; --layers, --hidden and --vocab >= 0 (0 = the 8B model's)")
    try:
        plan(args.methods)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.device == "cpu" and not args.hidden:
        # measured: one SFT step of the full-width 1-layer model took minutes on 2 cores
        print("warning: the full-width model on the CPU takes hours for every method; "
              "--hidden 64 runs the same code path in minutes (docs/calm.md)", file=sys.stderr)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        base = [*COMMON, "--model", model_name(args.layers, args.hidden, args.vocab), "--device", args.device,
                "--steps", str(args.steps), "--data-files", *write_data(work / "data")]
        rows: dict[str, dict[str, Any]] = {}
        records = []
        for spec, methods in plan(args.methods):
            out = run_one(spec, methods, base, work)
            rows.update(out["rows"])
            records.append(out["record"])
    agreement = None
    if not args.no_agreement:
        from .device_agreement import check

        agreement = check(args.device)
    return report(args, rows, records, agreement, time.time() - t0)


def report(args: argparse.Namespace, rows: dict[str, dict[str, Any]], records: list[dict[str, Any]],
           agreement: dict[str, Any] | None, wall: float) -> dict[str, Any]:
    """Print and write the results; ``ok`` is False when a run failed, a number is not finite
    or the agreement check is beyond its tolerance."""
    import torch

    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    problems = [f"{m}: {', '.join(b)} not finite" for m, r in rows.items() if r.get("steps")
                and (b := not_finite({k: v for k, v in r.items() if k != "scores"} | r["scores"], gpu=cuda))]
    problems += [f"{m}: failed" for m, r in rows.items() if not r.get("steps")]
    problems += [f"run {r['run']}: exit code {r['returncode']}" for r in records if r["returncode"]]
    if agreement is not None:
        problems += [f"agreement: {k} deviation {v['deviation']:.2e} > {v['tolerance']:.0e}"
                     for k, v in agreement["quantities"].items() if not v["ok"]]
    meta = {"env": harness.environment(device), "model": model_name(args.layers, args.hidden, args.vocab),
            "steps": args.steps, "runs": records, "wall_s": round(wall, 1),
            "agreement": agreement, "problems": problems, "ok": not problems}
    text = table(rows)
    if agreement is not None:
        text += "\n\n" + agreement["table"]
    text += f"\n\nwall {wall / 60:.1f} min; " + ("all numbers finite, every run ok" if not problems
                                                 else "PROBLEMS: " + "; ".join(problems))
    print(text)
    out = args.out or harness.RESULTS / (f"gpu_check_{args.name}" if args.name else "gpu_check")
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    for m, r in rows.items():
        rec.add({"method": m, **r})
    head = f"# python -m bench.gpu_check {' '.join(args.argv)}\n\nmodel {meta['model']} on {device}"
    out.with_suffix(".md").write_text(f"{head}\n\n{text}\n")
    return {"meta": meta, "rows": rows, "ok": not problems}


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
