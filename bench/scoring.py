"""Cloze scoring against lm-evaluation-harness and against its own compute floor.

    python -m bench.scoring [--quick] [--model smollm2|tiny] [--sets sciq arc_easy ...]

Scores the same multiple-choice questions (the embedded default run's SciQ test and
ARC-Easy OOD questions, plus other sets on request) with the same model and prompt
("Question: {q}\\nAnswer:" + " {option}"), side by side in one process, round-robin:

- ``before``: the layout this project used until the shared-prefix change (every option
  repeats its question; 16 questions per batch in data order);
- ``shared@B``: `apps.calm_llm.train.predict_option_logits` as the runner calls it — each
  question's context encoded once, options scored against its KV cache, batches of at most B
  padded tokens, longest first;
- ``lm_eval``: lm-evaluation-harness's ``HFLM.loglikelihood`` on the same (context,
  continuation) pairs (the request a local-file multiple-choice task with this prompt
  produces), at each of its batch sizes ``--lm-eval-batch`` (default 32 and 64: which is
  faster depends on the thread count — 64 at 2 threads, 32 at 1 in the issue's runs — so
  both are candidates); the faster is the reference.

Speed-ups over lm-eval are reported as the ratio of medians and, round by round (each round
times every candidate once, round-robin), as min / median / max of the paired ratios: the
spread says whether two speed-ups (e.g. 2.8× and 3.4×) can be told apart. A full run takes
``ROUNDS`` = 7 rounds (``--rounds``).

Correctness, before any timing: per-option log-likelihoods of every candidate against
``before`` (max |Δ|, accuracy), on each set and on a set cut by a short ``max_length``
(questions longer than the model input, where each option is cut at its own place).

The floor: question tokens once plus option tokens, forward only, at the model's dense
throughput (tokens per second of one unpadded 8 × 128-token forward, measured here), i.e.
the time the shared-prefix work would take with no padding and no per-call overhead.

``--dtype bf16`` adds the shared path in bfloat16 (score drift against fp32 and its speed).
Writes bench/results/scoring[_quick].json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from . import harness

SETS = ("sciq", "arc_easy", "mmlu", "commonsense_qa")
# timed rounds of a full run: enough for the per-round speed-ups' spread to tell 2.8x from
# 3.4x against lm-eval on 2 shared cores (two rounds could not)
ROUNDS = 7


def make_context(model: str, *, dtype: str = "fp32", n: int = 120, seed: int = 0,
                 max_length: int | None = None) -> Any:
    """The runner's context for the embedded default (cloze), on ``model``."""
    from apps.calm_llm import model as model_lib
    from apps.calm_llm.config import from_dict, load_file, resolve_config_file, validate
    from apps.calm_llm.data import Collator
    from apps.calm_llm.methods.base import Context

    cfg = from_dict(load_file(resolve_config_file("default" if model == "smollm2" else "tiny")))
    model_over: dict[str, Any] = {"dtype": dtype}
    if max_length:
        model_over["max_length"] = max_length
    cfg = from_dict({"seed": seed, "device": "cpu", "model": model_over,
                     "data": {"n_test": n, "n_ood": n}}, cfg)
    validate(cfg)
    lm = model_lib.load(cfg.model, device=torch.device("cpu"), seed=seed)
    d = cfg.data
    collator = Collator(lm.tokenizer, mode="cloze", prompt_style=d.prompt_style,
                        max_length=cfg.model.max_length, max_options=d.max_options,
                        share_prefix=True, prefix_layout=lm.prefix_layout)
    return Context(cfg=cfg, lm=lm, collator=collator, train_examples=[], calib_examples=[],
                   train_collator=collator, option_token_ids=None)


def question_sets(ctx: Any, names: list[str], n: int) -> dict[str, list]:
    """The default run's SciQ test / ARC-Easy OOD questions; the first n of a seeded shuffle
    of any other set."""
    from apps.calm_llm.data import load_source
    from apps.calm_llm.tasks.mcqa import load_data

    splits = load_data(ctx.cfg)
    have = {**splits.test, **splits.ood}
    out = {}
    for name in names:
        if name in have:
            out[name] = list(have[name])[:n]
        else:
            rows = load_source(name, seed=ctx.cfg.seed)
            g = torch.Generator().manual_seed(ctx.cfg.seed)
            out[name] = [rows[i] for i in torch.randperm(len(rows), generator=g)[:n].tolist()]
    return out


def predict_before(ctx: Any, examples: list, batch_size: int = 16, *,
                   exact: bool = False) -> torch.Tensor:
    """The unshared layout, batched by question count in data order (the old runner).

    ``exact``: the float32 logits' log-softmax taken in float64, i.e. the scores without the
    rounding of a float32 normalizer over the vocabulary (the reference both the project's
    scores and lm-eval's are measured against)."""
    import copy

    from apps.calm_llm.data import batch_iterator

    collator = copy.copy(ctx.collator)
    collator.share_prefix = False
    outs = []
    with torch.no_grad():
        for batch in batch_iterator(examples, collator, 4 if exact else batch_size, shuffle=False,
                                    seed=0):
            logits, batch = ctx.forward(None, batch)
            ol = ctx.option_logits(logits.double() if exact else logits, batch)
            outs.append(ol if exact else ol.float())
    return torch.cat(outs)


def predict_shared(ctx: Any, examples: list, budget: int, layout: str = "packed") -> torch.Tensor:
    """The runner's prediction with the shared prefix in ``layout`` ("packed" or "cache")."""
    import copy

    from apps.calm_llm.methods import get
    from apps.calm_llm.predict import predict_option_logits

    cfg = dataclasses.replace(ctx.cfg, train=dataclasses.replace(ctx.cfg.train, eval_tokens=budget))
    col = copy.copy(ctx.collator)
    col.prefix_layout = layout
    c = dataclasses.replace(ctx, cfg=cfg, collator=col)
    return predict_option_logits(c, get("none")(c), examples)[0]


class LmEval:
    """lm-evaluation-harness's HF model on the same weights; None when lm-eval is missing."""

    def __init__(self, ctx: Any, batch_size: int) -> None:
        from lm_eval.models.huggingface import HFLM

        # the very model object the project scores with (LoRA at its zero-initialized B, so
        # the same function as the base), so both sides compute on identical weights
        base = ctx.lm.model.get_base_model()
        self.lm = HFLM(pretrained=base, tokenizer=ctx.lm.tokenizer, batch_size=batch_size,
                       max_length=ctx.cfg.model.max_length, device="cpu")
        self.collator = ctx.collator

    def predict(self, examples: list, K: int) -> torch.Tensor:
        from lm_eval.api.instance import Instance

        reqs, where = [], []
        for n, ex in enumerate(examples):
            context, conts = self.collator.cloze_texts(ex)
            for j, cont in enumerate(conts):
                reqs.append(Instance(request_type="loglikelihood", doc={}, arguments=(context, cont),
                                     idx=j))
                where.append((n, j))
        lls = self.lm.loglikelihood(reqs, disable_tqdm=True)
        out = torch.full((len(examples), K), float("-inf"))
        for (n, j), (ll, _) in zip(where, lls):
            out[n, j] = ll
        return out


def token_counts(ctx: Any, examples: list) -> dict[str, int]:
    """Tokens per set: the floor (question once + options), the unshared layout unpadded, and
    the target positions (where the output projection must run)."""
    import copy

    col = copy.copy(ctx.collator)
    col.share_prefix = False
    cache = copy.copy(ctx.collator)
    cache.prefix_layout = "cache"  # its prefix and continuation masks count the floor's tokens
    floor = unshared = targets = 0
    for ex in examples:
        b = cache([ex])
        floor += int(b.attention_mask.sum())
        floor += int(b.prefix.attention_mask.sum()) if b.prefix is not None else 0
        targets += int((b.target_ids != -100).sum())
        unshared += int(col([ex]).attention_mask.sum())
    return {"floor_tokens": floor, "unshared_tokens": unshared, "target_tokens": targets}


def dense_throughput(ctx: Any, repeats: int = 3) -> float:
    """Tokens/s of one unpadded 8 × 128 forward of real ids (the hardware's best case here)."""
    ids = torch.randint(100, 1000, (8, 128))
    mask = torch.ones_like(ids)
    batch = type("B", (), {"input_ids": ids, "attention_mask": mask, "prefix": None, "packed": None,
                           "position_ids": mask.cumsum(1) - 1})()
    with torch.no_grad():
        ctx.lm.logits(None, batch, keep=1)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ctx.lm.logits(None, batch, keep=1)
            times.append(time.perf_counter() - t0)
    return ids.numel() / harness.median(times)


def head_to_body_flops(ctx: Any) -> float:
    """FLOPs of the output projection at one token over those of the decoder at one token
    (H·V over the decoder's matrix parameters; attention scores left out, as in the floor)."""
    base = ctx.lm.model.get_base_model()
    head = base.get_output_embeddings().weight
    body = sum(p.numel() for n, p in base.get_decoder().named_parameters()
               if p.dim() == 2 and "embed" not in n)
    return head.numel() / body


def _n_groups(b: Any) -> int:
    """Prefixes of a one-question shared batch: 1, or one per option where its options were cut."""
    if b.packed is not None:
        return int(b.packed.input_ids.shape[0])
    return b.prefix.n_groups if b.prefix is not None else 0


def _fits(collator: Any, ex: Any) -> bool:
    """Whether every option's answer fits the collator's max_length (else it is an error)."""
    try:
        collator([ex])
    except ValueError:
        return False
    return True


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not bool((torch.isfinite(a) == torch.isfinite(b)).all()):
        return math.inf
    return float((a[fin] - b[fin]).abs().max()) if bool(fin.any()) else 0.0


def _accuracy(ol: torch.Tensor, examples: list) -> float:
    y = torch.tensor([ex.label for ex in examples])
    return float((ol.argmax(-1) == y).float().mean())


def _ece(ol: torch.Tensor, examples: list) -> float:
    from calibration import metrics

    y = torch.tensor([ex.label for ex in examples])
    return float(metrics.conf_ece(torch.softmax(ol.double(), -1), y))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 8 questions, 1 round")
    ap.add_argument("--model", default=None, choices=("smollm2", "tiny"))
    ap.add_argument("--sets", nargs="+", default=["sciq", "arc_easy"], help="sets timed")
    ap.add_argument("--check-sets", nargs="*", default=["mmlu", "commonsense_qa"],
                    help="more sets checked for agreement only")
    ap.add_argument("--n", type=int, default=None, help="questions per set")
    ap.add_argument("--rounds", type=int, default=None, help=f"timed rounds (default {ROUNDS}; quick 1)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--layouts", nargs="+", default=["packed", "cache"], choices=("packed", "cache"),
                    help="shared-prefix layouts timed (the first is the one --dtype and the "
                    "default run use)")
    ap.add_argument("--lm-eval-batch", type=int, nargs="+", default=[32, 64],
                    help="lm-eval batch sizes, each a candidate (its faster one is the reference)")
    ap.add_argument("--no-lm-eval", action="store_true")
    ap.add_argument("--no-before", action="store_true", help="skip timing the old layout")
    ap.add_argument("--dtype", nargs="+", default=["fp32"], choices=("fp32", "bf16"))
    ap.add_argument("--cut-length", type=int, default=128,
                    help="max_length of the extra correctness check on cut questions")
    ap.add_argument("--no-agreement", action="store_true", help="timing only")
    ap.add_argument("--no-timing", action="store_true", help="agreement only")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's own choice)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or ("tiny" if args.quick else "smollm2")
    n = args.n or (8 if args.quick else 120)
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    out = args.out or harness.RESULTS / ("scoring_quick" if args.quick else "scoring")

    ctx = make_context(model, n=n)
    sets = question_sets(ctx, list(args.sets), n)
    checks = {**sets, **question_sets(ctx, [s for s in args.check_sets if s not in sets], n)}
    meta = {"env": harness.environment(torch.device("cpu")), "model": model, "n": n,
            "rounds": rounds, "max_length": ctx.cfg.model.max_length}
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    lmevals: dict[str, LmEval] = {}
    if not args.no_lm_eval:
        try:
            lmevals = {f"lm_eval@{b}": LmEval(ctx, b) for b in args.lm_eval_batch}
        except ImportError as e:
            meta["lm_eval"] = f"skipped: {e}"
    other = {dt: make_context(model, dtype=dt, n=n) for dt in args.dtype if dt != "fp32"}
    meta["dense_tokens_per_s"] = dense_throughput(ctx)
    meta["head_to_body_flops"] = head_to_body_flops(ctx)

    if not args.no_agreement:  # correctness first: every candidate against the old layout
        _agreement(args, ctx, model, n, checks, lmevals, other, rec)
    if not args.no_timing:
        _timing(args, ctx, sets, rounds, lmevals, other, meta, rec)
    write_markdown(out.with_suffix(".md"), meta, rec.records)
    return {"meta": meta, "records": rec.records}


def _agreement(args: argparse.Namespace, ctx: Any, model: str, n: int,
               checks: dict[str, list], lmevals: dict[str, LmEval], other: dict[str, Any],
               rec: harness.Recorder) -> None:
    """One ``agreement`` record per question set and candidate: its option log-likelihoods
    against the old layout's (and an exact float64 recomputation), on every set and on one
    set cut to ``--cut-length`` tokens."""
    K, lay0 = ctx.cfg.data.max_options, args.layouts[0]
    cut_ctx = make_context(model, n=n, max_length=args.cut_length)
    # the set with the longest questions, so that the short max_length cuts many of them
    cut_set = max(checks, key=lambda k: sum(len(ex.question) for ex in checks[k]) / len(checks[k]))
    cut_name = f"{cut_set}@max_length={args.cut_length}"
    cut_examples = [ex for ex in checks[cut_set] if _fits(cut_ctx.collator, ex)]
    for name, examples in [*checks.items(), (cut_name, cut_examples)]:
        c = cut_ctx if name == cut_name else ctx
        ref = predict_before(c, examples)
        exact = predict_before(c, examples, exact=True)
        got = {f"{lay}@{b}": predict_shared(c, examples, b, lay)
               for lay in args.layouts for b in args.budgets}
        if c is ctx:
            got.update({k: v.predict(examples, K) for k, v in lmevals.items()})
            for dt, oc in other.items():
                got[f"{lay0}@{args.budgets[0]} {dt}"] = predict_shared(oc, examples, args.budgets[0], lay0)
        n_cut = sum(int(_n_groups(c.collator([ex])) > 1) for ex in examples)
        for cand, ol in got.items():
            rec.add({"kind": "agreement", "set": name, "candidate": cand, "n": len(examples),
                     "n_cut": n_cut,
                     "max_abs_dll": _max_abs(ol, ref),
                     "max_abs_dll_exact": _max_abs(ol.double(), exact),
                     "accuracy": _accuracy(ol, examples),
                     "accuracy_before": _accuracy(ref, examples), "conf_ece": _ece(ol, examples),
                     "conf_ece_before": _ece(ref, examples)})


def _timing(args: argparse.Namespace, ctx: Any, sets: dict[str, list], rounds: int,
            lmevals: dict[str, LmEval], other: dict[str, Any], meta: dict[str, Any],
            rec: harness.Recorder) -> None:
    """One ``timing`` record per question set and candidate, the candidates timed round-robin,
    each against the token floor of a dense forward."""
    K, lay0, tok_s = ctx.cfg.data.max_options, args.layouts[0], meta["dense_tokens_per_s"]
    for name, examples in sets.items():
        ex = examples
        b0 = args.budgets[0]
        runs = {f"{lay}@{b}": (lambda b=b, ex=ex, lay=lay: predict_shared(ctx, ex, b, lay))
                for lay in args.layouts for b in args.budgets}
        if not args.no_before:
            runs["before"] = lambda ex=ex: predict_before(ctx, ex)
        runs.update({k: (lambda v=v, ex=ex: v.predict(ex, K)) for k, v in lmevals.items()})
        for dt, oc in other.items():
            runs[f"{lay0}@{b0} {dt}"] = lambda oc=oc, ex=ex, b0=b0: predict_shared(oc, ex, b0, lay0)
        times = harness.time_alternating(runs, device=torch.device("cpu"), warmup=0,
                                         repeats=rounds, min_repeats=rounds)
        counts = token_counts(ctx, examples)
        floor_s = counts["floor_tokens"] / tok_s
        # + the output projection at the target tokens (where scoring needs it), at the FLOP
        # rate of the dense forward: a target token costs head_ratio body tokens
        floor_head_s = floor_s + counts["target_tokens"] * meta["head_to_body_flops"] / tok_s
        lm_best = min((harness.median(times[k]) for k in lmevals), default=None)
        for cand, ts in times.items():
            s = harness.median(ts)
            spread = round_speedups(times, list(lmevals), cand)
            rec.add({"kind": "timing", "set": name, "candidate": cand, "n": len(examples),
                     "seconds_median": s, "seconds": ts, "s_per_question": s / len(examples),
                     "floor_tokens_per_s": counts["floor_tokens"] / s, **counts,
                     "floor_seconds": floor_s, "x_floor": s / floor_s,
                     "floor_head_seconds": floor_head_s, "x_floor_head": s / floor_head_s,
                     "speedup_vs_lm_eval": (lm_best / s) if lm_best else None, **spread})


def round_speedups(times: dict[str, list[float]], refs: list[str], cand: str) -> dict[str, Any]:
    """The speed-up over lm-eval round by round: in round r, the fastest of ``refs`` (lm-eval
    at each batch size) over ``cand``'s time; its min / median / max over the rounds (None
    without lm-eval). Round-robin makes each round's ratio a paired measurement."""
    if not refs:
        return {"speedup_round_min": None, "speedup_round_median": None,
                "speedup_round_max": None}
    ratios = [min(times[k][r] for k in refs) / t for r, t in enumerate(times[cand])]
    return {"speedup_round_min": min(ratios), "speedup_round_median": harness.median(ratios),
            "speedup_round_max": max(ratios)}


def _spread(r: dict[str, Any]) -> str:
    if r.get("speedup_round_min") is None:
        return "–"
    f = harness.fmt
    return " / ".join(f(r[k], "x") for k in ("speedup_round_min", "speedup_round_median",
                                               "speedup_round_max"))


def write_markdown(path: Path, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    f = harness.fmt
    agree = [r for r in records if r["kind"] == "agreement"]
    timing = [r for r in records if r["kind"] == "timing"]
    lines = [
        "# Cloze scoring: shared prefix vs the old layout vs lm-evaluation-harness", "",
        f"Model {meta['model']}, {meta['n']} questions per set, {meta['rounds']} round(s) "
        f"round-robin, max_length {meta['max_length']}, {meta['env']['threads']} threads, "
        f"{meta['env']['date']}. "
        + (f"Dense throughput (8 × 128 unpadded forward): {meta['dense_tokens_per_s']:.0f} "
           "tokens/s." if timing else "Agreement only (--no-timing)."), "",
        "## Agreement with the old layout (per-option log-likelihood)", "",
        "Against `before` (the unshared layout, float32 scoring) and against `exact` (the same "
        "float32 logits, log-softmax in float64).", "",
        harness.markdown_table(
            ["set", "candidate", "questions cut", "max abs Δ log-lik", "vs exact",
             "accuracy (before)", "conf-ECE (before)"],
            [[r["set"], r["candidate"], str(r["n_cut"]), f(r["max_abs_dll"], "err"),
              f(r["max_abs_dll_exact"], "err") if "max_abs_dll_exact" in r else "–",
              f"{r['accuracy']:.4f} ({r['accuracy_before']:.4f})",
              f"{r['conf_ece']:.4f} ({r['conf_ece_before']:.4f})"] for r in agree]),
        "", "## Time", "",
        harness.markdown_table(
            ["set", "candidate", "seconds", "s/question", "floor tokens/s", "× floor",
             "× floor + head", "speed-up vs lm-eval", "per round (min / median / max)"],
            [[r["set"], r["candidate"], f"{r['seconds_median']:.2f}", f"{r['s_per_question']:.3f}",
              f"{r['floor_tokens_per_s']:.0f}", f(r["x_floor"], "x"), f(r["x_floor_head"], "x"),
              f(r["speedup_vs_lm_eval"], "x") if r["speedup_vs_lm_eval"] else "–",
              _spread(r)] for r in timing]),
        "",
        "Floor: question tokens once + option tokens (`floor_tokens` in the JSON), forward only, "
        "at the dense throughput above (which keeps one logits column: the decoder alone). "
        "Floor + head adds the output projection at the target tokens (`target_tokens`), which "
        "scoring cannot skip, at the same FLOP rate "
        f"(one target token = {meta['head_to_body_flops']:.3f} decoder tokens).",
    ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
