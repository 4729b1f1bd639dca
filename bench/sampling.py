"""Sampling n free-form answers per question: shared prompt cache vs num_return_sequences, n calls, plain generate.

    python -m bench.sampling [--quick] [--model smollm2|tiny] [--n-questions 16] [--n 20]

TriviaQA questions (`apps.calm_llm.data.open_qa.load_open_qa("trivia_qa")`), each prompt the
app's (`apps.calm_llm.tasks.open_qa.INSTRUCTION` in the chat template), n samples per
question at ``--temperature`` (1.0), top-p 1.0, at most 16 new tokens, timed side by side in one process
(round-robin, `harness.time_alternating`):

- ``shared``: `apps.calm_llm.sampling.sample_answers(share_prompt=True)`: each batch's prompts
  prefilled once, the KV cache repeated n times, the module's `decode` loop, which drops each
  sequence from the batch once it has ended;
- ``shared_generate``: the same shared cache continued by one ``generate`` call, which keeps
  every sequence to the end of the batch (the engine before `decode`);
- ``num_return_sequences``: the same with ``share_prompt=False`` (HF expands the inputs before
  the prefill, so each prompt is computed n times);
- ``n_calls``: ``generate`` called n times per question batch, one sample per prompt each;
- ``hf_generate``: the plain transformers call a user writes, without the app's code: the
  tokenizer left-pads each batch of prompts and one ``model.generate(**inputs, do_sample=True,
  num_return_sequences=n, top_k=0, top_p=1.0, temperature=T, max_new_tokens=M)`` samples it
  (same prompts, batches, sampling settings and token cap; it stops at EOS only, where the app
  also stops at a newline, so its rows run on after the answer: the records give its answer
  length and the tokens it generated).

The four above ``hf_generate`` go through the app's `generate_batch`/`decode` (its stopping
rule, its processors). Before the timing, one untimed pass of every candidate (the warm-up)
records its answer lengths: the mean answer length in tokens and the share that reach the cap
(what `decode` saves grows as answers get shorter than the batch's longest; the candidates
draw different samples, so their lengths differ a little). Prints seconds per question and
the ratios to ``shared`` and the speed-up over ``hf_generate`` (ratio of medians and
min / median / max of the per-round paired ratios); writes bench/results/sampling[_quick].json.
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
    from apps.calm_llm.tasks.open_qa import INSTRUCTION, prompt_text

    style = "chat" if getattr(tokenizer, "chat_template", None) else "paper"
    collator = Collator(tokenizer, mode="cloze", prompt_style=style)
    return [prompt_text(collator, INSTRUCTION.format(question=q)) for q in questions]


def stop_answers(rows: torch.Tensor, stop: torch.Tensor) -> list[list[int]]:
    """Each generated row (R, T) up to and including its first ``stop`` id (V,), or all T ids
    where none came (the answer as the app cuts it)."""
    hit = stop.to(rows.device)[rows.clamp(max=stop.numel() - 1)]  # (R, T)
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, rows.shape[1])
    return [row[:k] for row, k in zip(rows.tolist(), first.tolist())]


def generate_rows(lm: Any, prompts: list[str], *, n: int, calls: int, share_prompt: bool,
                  temperature: float, max_new_tokens: int, batch_size: int,
                  seed: int) -> list[list[int]]:
    """``calls`` ``generate`` calls of n samples per batch of prompts through the app's
    `generate_batch` (its stopping rule: newline or EOS, every row kept to the batch's end);
    returns each sequence's answer ids (`stop_answers`).

    ``shared_generate``: share_prompt, calls = 1; ``num_return_sequences``: not shared,
    calls = 1; ``n_calls``: not shared, n = 1 per call, n calls."""
    from apps.calm_llm import sampling as S

    encoded = S.encode_prompts(lm.tokenizer, prompts)
    cfg = S.generation_config(lm, do_sample=True, max_new_tokens=max_new_tokens)
    stop, plist, answers = S.stop_mask(lm), S.processor_list(None, temperature), []
    with lm.mode(False), torch.no_grad():
        torch.manual_seed(seed)
        for lo in range(0, len(encoded), batch_size):
            ids, mask = S.left_pad(encoded[lo:lo + batch_size], S.pad_id_of(lm.tokenizer), lm.device)
            for _ in range(calls):
                out = S.generate_batch(lm, ids, mask, n=n, config=cfg, processors=plist,
                                       share_prompt=share_prompt, stop=stop)
                answers += stop_answers(out.sequences[:, ids.shape[1]:], stop)
    return answers


def decode_answers(lm: Any, prompts: list[str], *, n: int, temperature: float,
                   max_new_tokens: int, batch_size: int, seed: int) -> list[list[int]]:
    """Answer ids of the ``shared`` path: `sample_answers`' batches through `decode` (the
    same draws, before the ids become text)."""
    from apps.calm_llm import sampling as S

    encoded = S.encode_prompts(lm.tokenizer, prompts)
    stop, plist, answers = S.stop_mask(lm), S.processor_list(None, temperature), []
    with lm.mode(False), torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for lo in range(0, len(encoded), batch_size):
            ids, mask = S.left_pad(encoded[lo:lo + batch_size], S.pad_id_of(lm.tokenizer), lm.device)
            answers += S.decode(lm, ids, mask, n=n, processors=plist, do_sample=True,
                                max_new_tokens=max_new_tokens, stop=stop).token_ids
    return answers


class HFGenerate:
    """The plain transformers peer a user writes: the tokenizer left-pads each batch of prompts,
    one ``model.generate(**inputs, do_sample=True, num_return_sequences=n, top_k=0,
    top_p=1.0, temperature=T, max_new_tokens=M)`` per batch, stopping at the model's EOS only
    (the app also stops at a newline). Calling it returns each sequence's answer ids (to the
    first newline or EOS, as the app cuts it); ``generated`` keeps the count of tokens each
    sequence generated up to its EOS or the cap (what generate paid for)."""

    def __init__(self, lm: Any, prompts: list[str], args: argparse.Namespace) -> None:
        from apps.calm_llm import sampling as S

        self.lm, self.prompts, self.args = lm, prompts, args
        self.stop, self.pad = S.stop_mask(lm), S.pad_id_of(lm.tokenizer)
        self.eos = torch.zeros_like(self.stop)
        self.eos[S.eos_ids(lm)] = True
        self.generated: list[int] = []
        enc = lm.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        # whether the user's tokenizer call gives the app's token ids (recorded in the results)
        self.same_ids = [list(x) for x in enc] == S.encode_prompts(lm.tokenizer, prompts)

    def __call__(self) -> list[list[int]]:
        a, tok, model = self.args, self.lm.tokenizer, self.lm.model
        answers, self.generated = [], []
        with self.lm.mode(False), torch.no_grad():
            torch.manual_seed(0)
            for lo in range(0, len(self.prompts), a.batch_size):
                inputs = tok(self.prompts[lo:lo + a.batch_size], return_tensors="pt", padding=True,
                             padding_side="left", add_special_tokens=False).to(self.lm.device)
                out = model.generate(**inputs, do_sample=True, num_return_sequences=a.n, top_k=0,
                                     top_p=1.0, temperature=a.temperature,
                                     max_new_tokens=a.max_new_tokens, pad_token_id=self.pad)
                rows = out[:, inputs["input_ids"].shape[1]:]
                answers += stop_answers(rows, self.stop)
                self.generated += [len(r) for r in stop_answers(rows, self.eos)]
        return answers


def candidates(lm: Any, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """name -> (timed call, untimed call returning each sequence's answer ids)."""
    from apps.calm_llm.sampling import sample_answers

    kw = dict(n=args.n, temperature=args.temperature, top_p=1.0,
              max_new_tokens=args.max_new_tokens, seed=0, batch_size=args.batch_size)
    gk = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
              batch_size=args.batch_size, seed=0)

    def rows(n: int, calls: int, share: bool) -> Any:
        return lambda: generate_rows(lm, prompts, n=n, calls=calls, share_prompt=share, **gk)

    hf = HFGenerate(lm, prompts, args)
    return {
        "shared": (lambda: sample_answers(lm, prompts, share_prompt=True, desc="shared", **kw),
                   lambda: decode_answers(lm, prompts, n=args.n, **gk)),
        "shared_generate": (rows(args.n, 1, True), rows(args.n, 1, True)),
        "num_return_sequences": (
            lambda: sample_answers(lm, prompts, share_prompt=False, desc="num_return_sequences",
                                   **kw), rows(args.n, 1, False)),
        "n_calls": (rows(1, args.n, False), rows(1, args.n, False)),
        "hf_generate": (hf, hf),
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 questions, n = 4")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--n-questions", type=int, default=None)
    ap.add_argument("--n", type=int, default=None, help="samples per question")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--batch-size", type=int, default=8, help="questions per generate call")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; quick 1)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's own choice)")
    return ap


def answer_stats(answers: list[list[int]], cap: int) -> dict[str, float]:
    """Mean answer length in tokens and the share of answers cut at ``cap`` (--max-new-tokens)."""
    lengths = [len(a) for a in answers]
    return {"mean_answer_tokens": sum(lengths) / len(lengths),
            "share_at_max_new_tokens": sum(x == cap for x in lengths) / len(lengths)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.n_questions = args.n_questions or (4 if args.quick else 16)
    args.n = args.n or (4 if args.quick else 20)
    args.rounds = args.rounds or (1 if args.quick else 3)
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
    cands = candidates(lm, prompts, args)
    hf = cands["hf_generate"][0]
    # answer lengths (untimed; the warm-up round): how much a batch's longest answer pads the rest
    answers = {name: untimed() for name, (_, untimed) in cands.items()}
    stats = {name: answer_stats(a, args.max_new_tokens) for name, a in answers.items()}
    meta.update(stats["shared_generate"])
    meta["hf_generate_same_prompt_ids"] = hf.same_ids
    # same prompt ids, same seed, same logits: the same draws as the app's num_return_sequences
    meta["hf_generate_same_answers"] = answers["hf_generate"] == answers["num_return_sequences"]
    meta["hf_generate_mean_generated_tokens"] = sum(hf.generated) / len(hf.generated)
    for name, st in stats.items():
        print(f"{name:>22}: answers {st['mean_answer_tokens']:.1f} tokens on average, "
              f"{st['share_at_max_new_tokens']:.0%} reach --max-new-tokens")
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    times = harness.time_alternating({k: v[0] for k, v in cands.items()}, device=torch.device("cpu"),
                                     warmup=0, repeats=args.rounds, min_repeats=args.rounds)
    base, peer = harness.median(times["shared"]), harness.median(times["hf_generate"])
    for name, ts in times.items():
        s = harness.median(ts)
        spread = harness.paired_ratios(times, "hf_generate", name)
        rec.add({"candidate": name, "seconds": ts, "seconds_median": s,
                 "s_per_question": s / len(prompts), "ratio_vs_shared": s / base,
                 "speedup_vs_hf_generate": peer / s, "speedup_round_min": spread["min"],
                 "speedup_round_median": spread["median"], "speedup_round_max": spread["max"],
                 **stats[name]})
        print(f"{name:>22}: {s / len(prompts):.3f} s/question  ({s / base:.2f}x shared, "
              f"{peer / s:.2f}x faster than hf_generate; rounds {spread['min']:.2f}-"
              f"{spread['max']:.2f}x)")
    return {"meta": meta, "records": rec.records}


if __name__ == "__main__":
    main()
