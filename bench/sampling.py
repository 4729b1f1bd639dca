"""Sampling n free-form answers per question: shared prompt cache vs num_return_sequences vs n calls.

    python -m bench.sampling [--quick] [--model smollm2|tiny] [--n-questions 16] [--n 20]

TriviaQA questions (`apps.calm_llm.data.open_qa.load_open_qa("trivia_qa")`), each prompt the
app's (`apps.calm_llm.runner.load.INSTRUCTION` in the chat template), n samples per
question at ``--temperature`` (1.0), top-p 1.0, at most 16 new tokens, timed side by side in one process
(round-robin, `harness.time_alternating`):

- ``shared``: `apps.calm_llm.sampling.sample_answers(share_prompt=True)`: each batch's prompts
  prefilled once, the KV cache repeated n times, the module's `decode` loop, which drops each
  sequence from the batch once it has ended;
- ``shared_generate``: the same shared cache continued by one ``generate`` call, which keeps
  every sequence to the end of the batch (the engine before `decode`);
- ``num_return_sequences``: the same with ``share_prompt=False`` (HF expands the inputs before
  the prefill, so each prompt is computed n times);
- ``n_calls``: ``generate`` called n times per question batch, one sample per prompt each.

Prints seconds per question and the ratios to ``shared``, and the mean answer length in tokens
(what `decode` saves grows as answers get shorter than the batch's longest); writes
bench/results/sampling[_quick].json.
``--quick``: 4 questions, n = 4 (``--model tiny`` for a test).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from . import harness


def prompts_for(tokenizer: Any, questions: list[str]) -> list[str]:
    """The app's open-QA prompts: its instruction in the chat template (or, for a tokenizer
    without one such as the tiny model's, the Alpaca template), as ``--task open_qa`` asks."""
    from apps.calm_llm.data import Collator
    from apps.calm_llm.runner.evaluate import prompt_text
    from apps.calm_llm.runner.load import INSTRUCTION

    style = "chat" if getattr(tokenizer, "chat_template", None) else "paper"
    collator = Collator(tokenizer, mode="cloze", prompt_style=style)
    return [prompt_text(collator, INSTRUCTION.format(question=q)) for q in questions]


def n_calls(lm: Any, prompts: list[str], *, n: int, max_new_tokens: int, batch_size: int, seed: int) -> int:
    """n ``generate`` calls per batch of prompts, one sample each; returns the sequences made."""
    from apps.calm_llm import sampling as S

    encoded = S.encode_prompts(lm.tokenizer, prompts)
    cfg = S.generation_config(lm, do_sample=True, max_new_tokens=max_new_tokens)
    stop, plist, made = S.stop_mask(lm), S.processor_list(None), 0
    with lm.mode(False), torch.no_grad():
        torch.manual_seed(seed)
        for lo in range(0, len(encoded), batch_size):
            ids, mask = S.left_pad(encoded[lo:lo + batch_size], S._pad_id(lm.tokenizer), lm.device)
            for _ in range(n):
                out = S.generate_batch(lm, ids, mask, n=1, config=cfg, processors=plist,
                                       share_prompt=False, stop=stop)
                made += out.sequences.shape[0]
    return made


def shared_generate(lm: Any, prompts: list[str], *, n: int, temperature: float, max_new_tokens: int,
                    batch_size: int, seed: int) -> list[int]:
    """The shared prompt cache continued by ``generate`` (no row leaves the batch); returns each
    sequence's answer length in tokens (up to and including its end-of-answer token)."""
    from apps.calm_llm import sampling as S

    encoded = S.encode_prompts(lm.tokenizer, prompts)
    cfg = S.generation_config(lm, do_sample=True, max_new_tokens=max_new_tokens)
    stop, plist, lengths = S.stop_mask(lm), S.processor_list(None, temperature), []
    with lm.mode(False), torch.no_grad():
        torch.manual_seed(seed)
        for lo in range(0, len(encoded), batch_size):
            ids, mask = S.left_pad(encoded[lo:lo + batch_size], S._pad_id(lm.tokenizer), lm.device)
            out = S.generate_batch(lm, ids, mask, n=n, config=cfg, processors=plist,
                                   share_prompt=True, stop=stop)
            for row in out.sequences[:, ids.shape[1]:]:
                hits = stop[row].nonzero()
                lengths.append(int(hits[0]) + 1 if hits.numel() else row.numel())
    return lengths


def candidates(lm: Any, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from apps.calm_llm.sampling import sample_answers

    kw = dict(n=args.n, temperature=args.temperature, top_p=1.0,
              max_new_tokens=args.max_new_tokens, seed=0, batch_size=args.batch_size)
    return {
        "shared": lambda: sample_answers(lm, prompts, share_prompt=True, desc="shared", **kw),
        "shared_generate": lambda: shared_generate(
            lm, prompts, n=args.n, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=0),
        "num_return_sequences": lambda: sample_answers(lm, prompts, share_prompt=False,
                                                       desc="num_return_sequences", **kw),
        "n_calls": lambda: n_calls(lm, prompts, n=args.n, max_new_tokens=args.max_new_tokens,
                                   batch_size=args.batch_size, seed=0),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 questions, n = 4")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--n-questions", type=int, default=None)
    ap.add_argument("--n", type=int, default=None, help="samples per question")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--batch-size", type=int, default=8, help="questions per generate call")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.n_questions = args.n_questions or (4 if args.quick else 16)
    args.n = args.n or (4 if args.quick else 20)
    out = args.out or harness.RESULTS / ("sampling_quick" if args.quick else "sampling")

    from apps.calm_llm.config import ModelConfig
    from apps.calm_llm.data.open_qa import load_open_qa
    from apps.calm_llm.model import load

    lm = load(ModelConfig(name_or_path=args.model), device=torch.device("cpu"), seed=0)
    questions = [ex.question for ex in load_open_qa("trivia_qa", limit=args.n_questions)]
    prompts = prompts_for(lm.tokenizer, questions)
    meta = {"env": harness.environment(torch.device("cpu")), "model": args.model,
            "questions": len(prompts), "n": args.n, "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size, "rounds": args.rounds, "temperature": args.temperature}
    # answer lengths (untimed): how much a batch's longest answer pads the others
    lengths = shared_generate(lm, prompts, n=args.n, temperature=args.temperature,
                              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=0)
    meta["mean_answer_tokens"] = sum(lengths) / len(lengths)
    meta["share_at_max_new_tokens"] = sum(x == args.max_new_tokens for x in lengths) / len(lengths)
    print(f"answers: {meta['mean_answer_tokens']:.1f} tokens on average, "
          f"{meta['share_at_max_new_tokens']:.0%} reach --max-new-tokens")
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    times = harness.time_alternating(candidates(lm, prompts, args), device=torch.device("cpu"),
                                     warmup=0, repeats=args.rounds, min_repeats=args.rounds)
    base = harness.median(times["shared"])
    for name, ts in times.items():
        s = harness.median(ts)
        rec.add({"candidate": name, "seconds": ts, "seconds_median": s,
                 "s_per_question": s / len(prompts), "ratio_vs_shared": s / base})
        print(f"{name:>22}: {s / len(prompts):.3f} s/question  ({s / base:.2f}x shared)")
    return {"meta": meta, "records": rec.records}


if __name__ == "__main__":
    main()
