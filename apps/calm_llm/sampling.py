"""Free-form answers for open-ended QA: n sampled answers per question, and a greedy answer with
its per-token log-probabilities, with calibration processors applied at every step.

An answer is the generated text up to the first newline (`answer_text`); generation stops once
every sequence has produced a newline token or EOS, or after ``max_new_tokens``.

Logits order at each step: raw model logits -> ``processors`` (the calibration: CALM's α,
`export.AlphaLogitsProcessor`, or temperature scaling ``scores / T``) -> sampling temperature ->
top-p. Transformers puts its own warpers at a place of its choosing relative to a user
``logits_processor`` (after it in 5.x, before it in some 4.x versions), so its warpers are all
switched off (temperature 1, top-k 0, top-p 1) and ours are appended after ``processors``.

Prompts are full strings (already chat-templated). They are tokenized as
`data.collate.Collator.encode` does: no special tokens added by the tokenizer, the tokenizer's
leading special ids (BOS) put in front unless the text already starts with them.

Two engines:

- `decode` (what `sample_answers` and `greedy_answers` use): this module's own decoding loop. A
  batch's prompts are prefilled once (B rows), their next-token logits and KV cache are repeated
  n times per question, and every step feeds only the rows that are still answering: a row that
  produced its end-of-answer token leaves the batch (its cache rows are dropped with
  ``batch_select_indices``). ``generate`` instead keeps every row to the end of the batch,
  padding the finished ones, so a batch of 8 questions × 20 samples costs ``max_new_tokens``
  steps of 160 rows as soon as one sample rambles (docs/performance.md §5).
- `generate_batch`: one Hugging Face ``generate`` call, the reference the loop is tested
  against; ``share_prompt=True`` prefills the prompts without their last token and continues from
  the repeated cache, ``share_prompt=False`` uses ``num_return_sequences=n``, which expands the
  inputs before the prefill (what `sample_answers(share_prompt=False)` runs).

Both take position ids from the left-padded attention mask (``cumsum - 1``, padding at 0), as
``generate`` does, and draw a sample as it does (``multinomial(softmax(scores))`` over the rows
of the step); the loop's random stream differs from ``generate``'s only because finished rows
no longer draw.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from .data.collate_base import leading_special_ids, pad_id_of


@dataclass
class GreedyAnswer:
    """A greedy answer.

    ``token_logprobs[k]`` is log p of the k-th generated token under the processed distribution
    (log-softmax of the scores after ``processors``), up to and including the end-of-answer token
    (the first token whose text holds a newline, or EOS) when one was generated; all generated
    tokens when none was within ``max_new_tokens``.
    """

    text: str
    token_logprobs: list[float]
    token_ids: list[int] = field(default_factory=list)  # the generated ids those are for


def answer_text(decoded: str) -> str:
    """The answer: ``decoded`` up to its first newline, stripped."""
    return decoded.split("\n", 1)[0].strip()


# -- prompts -> padded ids --------------------------------------------------------------------------
def encode_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, as `Collator.encode`: leading special ids (BOS) unless present."""
    lead = leading_special_ids(tokenizer)
    out = []
    for text in prompts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        out.append(ids if lead and ids[: len(lead)] == lead else lead + ids)
    return out


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, L), attention mask (B, L)), left-padded to the longest sequence."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions (B, L) from a left-padded mask, as ``generate`` makes them (padding at 0)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


# -- stopping ----------------------------------------------------------------------------------------
_NEWLINE_IDS: dict[int, tuple[Any, torch.Tensor]] = {}


def newline_mask(tokenizer: Any, width: int) -> torch.Tensor:
    """Bool (width,): the ids whose decoded text contains a newline; memoized per tokenizer.

    Decodes the whole vocabulary once (the Rust backend does 50k ids in ~0.1 s; the Python
    fallback takes seconds). ``width`` is the logits' width (may exceed the tokenizer's).
    """
    hit = _NEWLINE_IDS.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        ids = [[i] for i in range(len(tokenizer))]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        texts = (backend.decode_batch(ids, skip_special_tokens=False) if backend is not None
                 else tokenizer.batch_decode(ids))
        flags = torch.tensor(["\n" in t for t in texts], dtype=torch.bool)
        hit = _NEWLINE_IDS[id(tokenizer)] = (tokenizer, flags)  # the tokenizer kept: ids stay unique
    flags = hit[1]
    out = torch.zeros(max(width, flags.numel()), dtype=torch.bool)
    out[: flags.numel()] = flags
    return out


class AnswerStop(StoppingCriteria):
    """Per-row stop (B,) once a row's last token is a newline token or an EOS id."""

    def __init__(self, stop_mask: torch.Tensor) -> None:
        self.stop_mask = stop_mask  # (V,) bool: newline tokens and EOS ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        mask = self.stop_mask.to(input_ids.device)
        return mask[input_ids[:, -1].clamp(max=mask.numel() - 1)]


def eos_ids(lm: Any) -> list[int]:
    """The EOS ids: the tokenizer's and the model's generation config's (an int or a list)."""
    ids = {lm.tokenizer.eos_token_id}
    gen = getattr(lm.model, "generation_config", None)
    more = getattr(gen, "eos_token_id", None)
    ids.update(more if isinstance(more, (list, tuple)) else [more])
    return sorted(int(i) for i in ids if i is not None)


def stop_mask(lm: Any) -> torch.Tensor:
    """Bool (V,): end-of-answer ids (newline tokens and EOS)."""
    mask = newline_mask(lm.tokenizer, lm.vocab_size).clone()
    mask[eos_ids(lm)] = True
    return mask


# -- one generate call ---------------------------------------------------------------------------
def generation_config(lm: Any, *, do_sample: bool, max_new_tokens: int, scores: bool = False) -> GenerationConfig:
    """A config with every transformers warper off (our warpers follow the calibration)."""
    return GenerationConfig(
        do_sample=do_sample, max_new_tokens=max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
        num_beams=1, pad_token_id=pad_id_of(lm.tokenizer), eos_token_id=eos_ids(lm),
        output_scores=scores, return_dict_in_generate=True, use_cache=True,
    )


def processor_list(processors: list | None, temperature: float = 1.0, top_p: float = 1.0) -> LogitsProcessorList:
    """Calibration processors first, then the sampling temperature and top-p (no-ops left out)."""
    out = LogitsProcessorList(list(processors or []))
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return out


def prefill_cache(lm: Any, ids: torch.Tensor, mask: torch.Tensor, n: int) -> Any:
    """KV cache of ``ids[:, :-1]`` (B, L-1), repeated to (B·n, ..., L-1, d), row b·n + k for
    question b: the layout ``generate``'s ``num_return_sequences`` expansion uses."""
    out = lm.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                   position_ids=position_ids(mask)[:, :-1], use_cache=True, logits_to_keep=1)
    cache = getattr(out, lm._cache_kwarg)
    if n > 1:
        cache.batch_repeat_interleave(n)
    return cache


def generate_batch(
    lm: Any, ids: torch.Tensor, mask: torch.Tensor, *, n: int, config: GenerationConfig,
    processors: LogitsProcessorList, share_prompt: bool, stop: torch.Tensor,
) -> Any:
    """One ``generate`` call for B prompts (B, L) -> n continuations each, rows grouped by prompt:
    ``out.sequences`` (B·n, L + T), ``out.scores`` (T × (B·n, V)) when the config asks."""
    kwargs: dict[str, Any] = {}
    if share_prompt and ids.shape[1] > 1:  # a one-token prompt has nothing to share
        kwargs[lm._cache_kwarg] = prefill_cache(lm, ids, mask, n)
        ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    elif n > 1:
        config = copy.deepcopy(config)  # in the config: generate warns on config + kwargs
        config.num_return_sequences = n
    return lm.model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=processors,
        stopping_criteria=StoppingCriteriaList([AnswerStop(stop)]), **kwargs,
    )


@dataclass
class Decoded:
    """Per row of `decode` (B·n rows, grouped by prompt): the generated ids up to and including
    the end-of-answer token, or ``max_new_tokens`` ids when none came; with ``logprobs``, log p of
    each under the processed distribution (log-softmax of the scores after the processors)."""

    token_ids: list[list[int]]
    token_logprobs: list[list[float]] | None = None


def prefill(lm: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The prompts' forward (B, L): (their KV cache, next-token logits (B, V) in float32).

    What `decode` starts from; computed once, it can start several decodes of the same prompts
    (`sample_and_greedy`): the same inputs give the same bits, so sharing changes no answer."""
    out = lm.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                   use_cache=True, logits_to_keep=1)
    return getattr(out, lm._cache_kwarg), out.logits[:, -1].float()


def decode(
    lm: Any, ids: torch.Tensor, mask: torch.Tensor, *, n: int, processors: LogitsProcessorList,
    do_sample: bool, max_new_tokens: int, stop: torch.Tensor, logprobs: bool = False,
    start: tuple[Any, torch.Tensor] | None = None,
) -> Decoded:
    """n continuations of each of B left-padded prompts (B, L), finished rows leaving the batch.

    Step t feeds the R_t rows still answering, one token each, against the KV cache:
    scores = processors(ids so far (R_t, L + t), logits (R_t, V) in float32), then a draw
    ``multinomial(softmax(scores))`` (``do_sample``) or ``argmax``; a row whose token is in
    ``stop`` (V,) is done. Cost ∝ Σ_t R_t rather than ``generate``'s B·n × (longest answer).
    ``start``: the `prefill` of these prompts, if already computed (its cache is consumed: it
    grows and is repeated in place). Call under ``no_grad`` in eval mode (the callers do).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    model, key = lm.model, lm._cache_kwarg
    cache, logits = start if start is not None else prefill(lm, ids, mask)
    if n > 1:  # the prompt is computed once per question, its cache shared by the n samples
        cache.batch_repeat_interleave(n)
        logits, ids, mask = (x.repeat_interleave(n, 0) for x in (logits, ids, mask))
    stop = stop.to(ids.device)
    rows = torch.arange(ids.shape[0], device=ids.device)  # the original row of each active row
    pos = mask.long().sum(-1)  # next position of each row (left padding: the count of tokens)
    got: list[list[int]] = [[] for _ in range(ids.shape[0])]
    got_lp: list[list[float]] = [[] for _ in range(ids.shape[0])]
    for t in range(max_new_tokens):
        scores = processors(ids, logits)
        tok = (torch.multinomial(scores.softmax(-1), 1).squeeze(1) if do_sample
               else scores.argmax(-1))
        for r, v in zip(rows.tolist(), tok.tolist()):
            got[r].append(v)
        if logprobs:
            lp = scores.log_softmax(-1).gather(1, tok[:, None]).squeeze(1)
            for r, v in zip(rows.tolist(), lp.tolist()):
                got_lp[r].append(v)
        going = ~stop[tok]
        if t == max_new_tokens - 1 or not bool(going.any()):
            break
        if not bool(going.all()):
            keep = going.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, ids, mask, pos, tok = rows[keep], ids[keep], mask[keep], pos[keep], tok[keep]
        ids = torch.cat([ids, tok[:, None]], 1)
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos[:, None],
                    use_cache=True, **{key: cache})
        cache, logits, pos = getattr(out, key), out.logits[:, -1].float(), pos + 1
    return Decoded(got, got_lp if logprobs else None)


def _batches(n_items: int, batch_size: int, desc: str) -> Any:
    from tqdm import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, n_items, batch_size)
    return tqdm(starts, desc=desc, total=len(starts), file=sys.stderr, unit="batch")


# -- the two entry points ------------------------------------------------------------------------
def sample_answers(
    lm: Any, prompts: list[str], *, n: int, temperature: float, top_p: float, max_new_tokens: int,
    seed: int, processors: list | None = None, batch_size: int = 8, share_prompt: bool = True,
    desc: str = "sampling",
) -> list[list[str]]:
    """n sampled answers (`answer_text`) per prompt: ``out[i]`` has n strings for ``prompts[i]``.

    Each batch of ``batch_size`` prompts (B·n sequences) is one `decode` (``share_prompt``, the
    default) or one ``generate`` call with ``num_return_sequences`` (the reference). Deterministic
    for a fixed ``seed`` and fixed batches (the global RNG is seeded inside a fork, so the
    caller's RNG state is untouched); another ``batch_size`` or order draws other samples, since
    the random stream is consumed across the whole batch. Eval mode and no_grad inside; the
    model's train/eval mode is restored after.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    encoded = encode_prompts(lm.tokenizer, prompts)
    config = generation_config(lm, do_sample=True, max_new_tokens=max_new_tokens)
    plist = processor_list(processors, temperature, top_p)
    stop, pad = stop_mask(lm), pad_id_of(lm.tokenizer)
    out: list[list[str]] = []
    devices = [lm.device] if lm.device.type == "cuda" else []
    with lm.mode(False), torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for lo in _batches(len(encoded), batch_size, desc):
            ids, mask = left_pad(encoded[lo:lo + batch_size], pad, lm.device)
            if share_prompt:
                gen = decode(lm, ids, mask, n=n, processors=plist, do_sample=True,
                             max_new_tokens=max_new_tokens, stop=stop).token_ids
            else:
                gen = generate_batch(lm, ids, mask, n=n, config=config, processors=plist,
                                     share_prompt=False, stop=stop).sequences[:, ids.shape[1]:]
            out.extend(_sample_texts(lm, gen, n))
    return out


def _sample_texts(lm: Any, gen: Any, n: int) -> list[list[str]]:
    """Generated ids (B·n rows, grouped by prompt) → the n answers of each prompt."""
    texts = lm.tokenizer.batch_decode(gen, skip_special_tokens=True)
    return [[answer_text(t) for t in texts[i:i + n]] for i in range(0, len(texts), n)]


def _greedy_texts(lm: Any, res: Decoded) -> list[GreedyAnswer]:
    """A greedy `decode` (n = 1, with log-probabilities) → one `GreedyAnswer` per prompt."""
    return [GreedyAnswer(text=answer_text(lm.tokenizer.decode(tok, skip_special_tokens=True)),
                         token_logprobs=lp, token_ids=tok)
            for tok, lp in zip(res.token_ids, res.token_logprobs or [])]


def greedy_answers(
    lm: Any, prompts: list[str], *, max_new_tokens: int, processors: list | None = None,
    batch_size: int = 8, desc: str = "greedy",
) -> list[GreedyAnswer]:
    """The greedy answer of each prompt under ``processors``, with its token log-probabilities
    (see `GreedyAnswer`), by `decode`. Eval mode and no_grad inside; train/eval mode restored."""
    encoded = encode_prompts(lm.tokenizer, prompts)
    plist = processor_list(processors)
    stop, pad = stop_mask(lm), pad_id_of(lm.tokenizer)
    out: list[GreedyAnswer] = []
    with lm.mode(False), torch.no_grad():
        for lo in _batches(len(encoded), batch_size, desc):
            ids, mask = left_pad(encoded[lo:lo + batch_size], pad, lm.device)
            out.extend(_greedy_texts(lm, decode(lm, ids, mask, n=1, processors=plist,
                                                do_sample=False, max_new_tokens=max_new_tokens,
                                                stop=stop, logprobs=True)))
    return out


def sample_and_greedy(
    lm: Any, prompts: list[str], *, n: int, temperature: float, top_p: float, max_new_tokens: int,
    seed: int, processors: list | None = None, batch_size: int = 8, desc: str = "answers",
) -> tuple[list[list[str]], list[GreedyAnswer]]:
    """``(sample_answers(...), greedy_answers(...))`` of the same prompts, equal to the two calls
    bit for bit, with each batch's prompts computed once instead of twice.

    Per batch of ``batch_size`` prompts: one `prefill`, a copy of its cache kept for the greedy
    `decode` (the sampling decode repeats and grows the cache in place), then the n-sample and
    the greedy decode from it. The samples' random stream is `sample_answers`'s (seeded once
    in a fork of the global RNG, consumed batch after batch; the greedy decode draws nothing,
    and the model in eval mode neither). Saves the greedy pass's prompt forward: B·L prompt
    tokens per batch, for the memory of one more B-row cache.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    encoded = encode_prompts(lm.tokenizer, prompts)
    sampled, greedy = processor_list(processors, temperature, top_p), processor_list(processors)
    stop, pad = stop_mask(lm), pad_id_of(lm.tokenizer)
    samples: list[list[str]] = []
    answers: list[GreedyAnswer] = []
    devices = [lm.device] if lm.device.type == "cuda" else []
    with lm.mode(False), torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for lo in _batches(len(encoded), batch_size, desc):
            ids, mask = left_pad(encoded[lo:lo + batch_size], pad, lm.device)
            cache, logits = prefill(lm, ids, mask)
            kept = (copy.deepcopy(cache), logits.clone())
            gen = decode(lm, ids, mask, n=n, processors=sampled, do_sample=True,
                         max_new_tokens=max_new_tokens, stop=stop, start=(cache, logits))
            samples.extend(_sample_texts(lm, gen.token_ids, n))
            answers.extend(_greedy_texts(lm, decode(lm, ids, mask, n=1, processors=greedy,
                                                    do_sample=False, max_new_tokens=max_new_tokens,
                                                    stop=stop, logprobs=True, start=kept)))
    return samples, answers
