"""The CALM step against its cost floor: one training step of the app, CALM vs plain SFT.

    python -m bench.calm_step [--quick] [--smallest] [--models tiny smollm2]

Builds the app's own run context (``apps.calm_llm``: config preset, offline data, model with
LoRA, collator) exactly as ``apps.calm_llm.train.run`` does, then times ``method.step(k)`` of
``sft`` and of ``calm`` with T ∈ {1, 3} inner steps, alternating in one process, same batch
sizes (letter mode, so a training and a calibration batch hold the same number of
sequences), LoRA on, α = affine over the full vocabulary. A step includes the optimizer
updates, as in training.

Cost floor (docs/bilevel.md, BOME): T forward-backward passes on the lower batch + 1 on the upper
batch + 1 forward ≈ T + 1.35 SFT steps (a forward ≈ ⅓ of a forward-backward). Targets: time
ratio CALM/SFT ≤ T + 1.6, peak-memory ratio ≤ 1.25.

``bome`` runs with the model's default attention (SDPA); ``itd`` and ``aid`` differentiate
through gradients, which SDPA kernels do not support, so they run on a second copy of the
model loaded with eager attention and are compared with an SFT step on that same copy.

Memory (CPU): ``peak_mem_mb`` is the peak of tensors allocated during one step above what was
live before it (activations, gradients, temporaries; bench.harness.peak_memory_mb);
``state_mem_mb`` is what was live (weights, LoRA, α, optimizer states). ``mem_ratio_vs_sft``
compares totals (state + step peak: what must fit in memory), ``step_mem_ratio_vs_sft`` the
step peaks alone. Writes bench/results/calm_step[_quick].json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from . import harness

MODELS = {"tiny": "tiny", "smollm2": "default"}  # model -> config preset it starts from
FAMILY = {"sft": "sft", "bome": "first_order", "itd": "unrolled", "aid": "implicit_cg"}


def make_context(model: str, *, batch: int, seed: int = 0, eager: bool = False,
                 mode: str = "letter") -> Any:
    """The app's run context for ``model`` (equal batch sizes), as in ``run``.

    ``mode="cloze"``: the lower batch holds each question's gold continuation, the upper
    (calibration) batch all its options, with the runner's shared prefix."""
    from apps.calm_llm import model as model_lib
    from apps.calm_llm.config import from_dict, load_file, resolve_config_file, validate
    from apps.calm_llm.data import Collator
    from apps.calm_llm.methods.base import Context
    from apps.calm_llm.tasks.mcqa import load_data

    cfg = from_dict(load_file(resolve_config_file(MODELS[model])))
    overrides = {
        "methods": ["sft", "calm"],
        "seed": seed,
        "device": "cpu",
        "data": {
            "mode": mode,
            "in_domain": ["sciq"],
            "out_of_domain": ["arc_easy"],
            "n_train": 4 * batch,
            "n_calib": 4 * batch,
            "n_test": 4,
            "n_ood": 4,
            "source_limit": 400,
        },
        "train": {"batch_size": batch, "calib_batch_size": batch, "grad_accum": 1, "steps": 10_000},
        "calm": {"solver": "bome", "alpha_param": "affine", "alpha_support": "vocab"},
    }
    cfg = from_dict(overrides, cfg)
    validate(cfg)
    torch.manual_seed(seed)
    splits = load_data(cfg)
    lm = model_lib.load(cfg.model, device=torch.device("cpu"), eager=eager, seed=seed)
    d = cfg.data
    collator = Collator(
        lm.tokenizer,
        mode=d.mode,
        prompt_style=d.prompt_style,
        max_length=cfg.model.max_length,
        max_options=d.max_options,
        share_prefix=d.share_prefix,
        prefix_layout=lm.prefix_layout,
    )
    return Context(
        cfg=cfg,
        lm=lm,
        collator=collator,
        train_examples=list(splits.train),
        calib_examples=list(splits.calib),
        train_collator=collator,
        option_token_ids=collator.option_token_ids,
    )


def make_method(ctx: Any, solver: str, T: int, share: bool = True) -> Any:
    """``sft``, or ``calm`` with ``solver`` and T inner steps (its own config copy);
    ``share=False`` collates its batches without the shared prefix."""
    import copy

    from apps.calm_llm.methods import get

    if not share:
        col = copy.copy(ctx.collator)
        col.share_prefix = False
        ctx = dataclasses.replace(ctx, collator=col, train_collator=col)

    if solver == "sft":
        return get("sft")(ctx)
    cfg = dataclasses.replace(
        ctx.cfg, calm=dataclasses.replace(ctx.cfg.calm, solver=solver, inner_steps=T)
    )
    return get("calm")(dataclasses.replace(ctx, cfg=cfg))


def _name(solver: str, T: int, share: bool) -> str:
    return f"{solver}-T{T}" + ("" if share else "-unshared")


def state_mb(ctx: Any, method: Any) -> float:
    """MiB of tensors live between steps: weights, buffers, α, optimizer states (unique storages)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for t in list(ctx.lm.model.parameters()) + list(ctx.lm.model.buffers()):
        add(t)
    for t in method.outer_params().values():
        add(t)
    for opt in method.optimizers.values():
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    add(v)
    return total / 2**20


def measure_group(
    ctx: Any,
    variants: list[tuple[str, int, bool]],
    *,
    model: str,
    attention: str,
    rounds: int,
    budget_s: float,
    memory: bool = True,
) -> list[dict[str, Any]]:
    """Alternate the steps of ``variants`` ([(solver, T, share)], first = ("sft", 0, True))."""
    methods = {_name(s, T, sh): make_method(ctx, s, T, sh) for s, T, sh in variants}
    counters = dict.fromkeys(methods, 0)

    def stepper(name: str) -> Any:
        def run() -> None:
            methods[name].step(counters[name])
            counters[name] += 1

        return run

    runs = {name: stepper(name) for name in methods}
    device = torch.device("cpu")
    n_lora = sum(p.numel() for p in ctx.lm.inner().values())
    out = []
    with ctx.lm.mode(True):
        for run in runs.values():  # warm-up; creates the optimizer states
            run()
        peak = {name: harness.peak_memory_mb(run, device, memory) for name, run in runs.items()}
        state = {name: state_mb(ctx, methods[name]) for name in methods}
        times = harness.time_alternating(
            runs, device=device, warmup=0, repeats=rounds, budget_s=budget_s, min_repeats=3
        )
    sft = "sft-T0"
    t_sft = harness.median(times[sft])
    mode = ctx.cfg.data.mode
    for (solver, T, share), name in zip(variants, methods):
        t = harness.median(times[name])
        total, total_sft = state[name] + (peak[name] or 0.0), state[sft] + (peak[sft] or 0.0)
        rec = {
            "problem": "calm_step", "size": n_lora,
            "library": "bilevel" if solver != "sft" else "apps.calm_llm",
            "method": FAMILY[solver], "solver": solver, "model": model, "attention": attention,
            "T": T, "mode": mode, "shared_prefix": bool(share and mode == "cloze"),
            "seconds_median": t, "seconds_min": min(times[name]), "seconds_all": times[name],
            "peak_mem_mb": peak[name], "state_mem_mb": state[name], "rel_error": None,
            "time_ratio_vs_sft": t / t_sft,
            "time_ratio_vs_sft_best": min(times[name]) / min(times[sft]),
            "mem_ratio_vs_sft": total / total_sft,
            "step_mem_ratio_vs_sft": peak[name] / peak[sft] if memory and peak[sft] else None,
            "floor_ratio": T + 1.35 if solver != "sft" else 1.0,
            "target_ratio": T + 1.6 if solver == "bome" and mode == "letter" else None,
        }
        out.append(rec)
        print(
            f"  {model} {attention:5s} {name:8s} {1000 * t:9.1f} ms  ×SFT {rec['time_ratio_vs_sft']:5.2f}"
            f"  step peak {harness.fmt(peak[name]):>8s} MiB  state {state[name]:8.1f} MiB  "
            f"mem ×SFT {rec['mem_ratio_vs_sft']:.3f}",
            flush=True,
        )
    return out


def render(records: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    rows = []
    for r in records:
        target = ""
        if r["solver"] == "bome" and r.get("target_ratio"):
            ok_t = r["time_ratio_vs_sft"] <= r["target_ratio"]
            ok_m = r["mem_ratio_vs_sft"] <= 1.25 or r["step_mem_ratio_vs_sft"] is None
            target = (
                ("time ok" if ok_t else "**time MISSED**")
                + ", "
                + ("mem ok" if ok_m else "**mem MISSED**")
            )
        rows.append(
            [
                r["model"],
                r.get("mode", "letter") + (" shared" if r.get("shared_prefix") else ""),
                r["attention"],
                r["solver"],
                str(r["T"]),
                harness.fmt(r["seconds_median"], "ms"),
                harness.fmt(r["time_ratio_vs_sft"], "x"),
                harness.fmt(r["time_ratio_vs_sft_best"], "x"),
                harness.fmt(r["floor_ratio"], "x"),
                harness.fmt(r["peak_mem_mb"]),
                harness.fmt(r["state_mem_mb"]),
                harness.fmt(r["mem_ratio_vs_sft"], "x"),
                harness.fmt(r["step_mem_ratio_vs_sft"], "x"),
                target,
            ]
        )
    header = [
        "model",
        "mode",
        "attention",
        "step",
        "T",
        "ms (median)",
        "× SFT",
        "× SFT (best-of)",
        "floor",
        "step peak MiB",
        "state MiB",
        "mem × SFT",
        "step mem × SFT",
        "target (BOME: ≤ T+1.6×, ≤ 1.25× mem)",
    ]
    return (
        f"# CALM step vs SFT step ({meta['mode']})\n\nEnvironment: {meta['env']}. "
        f"Batch {meta['batch']} questions for both levels ({meta.get('data_mode', 'letter')} "
        "mode; cloze: the lower batch holds the gold continuations, the upper batch every "
        "option, with or without the shared prefix; the T + 1.6 target is for letter mode, "
        "where both batches hold one sequence per question); LoRA from the preset; α affine "
        "over the vocabulary.\n\n"
        + harness.markdown_table(header, rows)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, few rounds")
    ap.add_argument("--smallest", action="store_true", help="tiny model, T = 1 only (CI)")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    ap.add_argument("--T", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--solvers", nargs="+", default=["bome", "itd", "aid"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--data-mode", default="letter", choices=("letter", "cloze"),
                    help="cloze also times CALM with an unshared upper batch")
    ap.add_argument("--rounds", type=int, default=None, help="most timing rounds")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per group")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="output stem")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (CI)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    models = args.models or (["tiny"] if args.quick or args.smallest else ["tiny", "smollm2"])
    ts = args.T[:1] if args.smallest else args.T
    rounds = args.rounds or (5 if args.quick or args.smallest else 30)
    budget = args.budget if args.budget is not None else (10.0 if args.quick else 300.0)
    stem = args.out or harness.RESULTS / f"calm_step{'_quick' if args.quick else ''}"
    meta = {
        "mode": "quick" if args.quick else "full",
        "env": harness.environment(torch.device("cpu")),
        "batch": args.batch,
        "data_mode": args.data_mode,
    }
    rec = harness.Recorder(stem.with_suffix(".json"), meta)
    for model in models:
        groups = [("sdpa", False, [s for s in args.solvers if s == "bome"])]
        groups.append(("eager", True, [s for s in args.solvers if s in ("itd", "aid")]))
        for attention, eager, solvers in groups:
            if not solvers:
                continue
            t0 = time.time()
            ctx = make_context(model, batch=args.batch, eager=eager, mode=args.data_mode)
            print(f"{model} ({attention}) context ready in {time.time() - t0:.0f} s", flush=True)
            shares = (True, False) if args.data_mode == "cloze" else (True,)
            variants = [("sft", 0, True)] + [(s, T, sh) for s in solvers for T in ts for sh in shares]
            for r in measure_group(
                ctx,
                variants,
                model=model,
                attention=attention,
                rounds=rounds,
                budget_s=budget,
                memory=not args.no_memory,
            ):
                rec.add(r)
            del ctx
    text = render(rec.records, meta)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
