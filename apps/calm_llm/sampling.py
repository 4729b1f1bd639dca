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

Prompt sharing (``share_prompt=True``): a batch's prompts are prefilled once, without their last
token, the KV cache is repeated n times per question, and ``generate`` continues from it (it
feeds the last prompt token, then samples), so the prompt costs one forward rather than n.
``share_prompt=False`` is the reference path: ``num_return_sequences=n``, which expands the
inputs before the prefill. Both take position ids from the left-padded attention mask
(``cumsum - 1``, padding at 0), as ``generate`` does.
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

from .data.collate import _leading_special_ids, _pad_id


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
    lead = _leading_special_ids(tokenizer)
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
        num_beams=1, pad_token_id=_pad_id(lm.tokenizer), eos_token_id=eos_ids(lm),
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

    Each batch of ``batch_size`` prompts (B·n sequences) is one ``generate`` call. Deterministic
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
    stop, pad = stop_mask(lm), _pad_id(lm.tokenizer)
    out: list[list[str]] = []
    devices = [lm.device] if lm.device.type == "cuda" else []
    with lm.mode(False), torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for lo in _batches(len(encoded), batch_size, desc):
            ids, mask = left_pad(encoded[lo:lo + batch_size], pad, lm.device)
            res = generate_batch(lm, ids, mask, n=n, config=config, processors=plist,
                                 share_prompt=share_prompt, stop=stop)
            texts = lm.tokenizer.batch_decode(res.sequences[:, ids.shape[1]:], skip_special_tokens=True)
            out.extend([answer_text(t) for t in texts[i:i + n]] for i in range(0, len(texts), n))
    return out


def greedy_answers(
    lm: Any, prompts: list[str], *, max_new_tokens: int, processors: list | None = None,
    batch_size: int = 8, desc: str = "greedy",
) -> list[GreedyAnswer]:
    """The greedy answer of each prompt under ``processors``, with its token log-probabilities
    (see `GreedyAnswer`). Eval mode and no_grad inside; train/eval mode restored after."""
    encoded = encode_prompts(lm.tokenizer, prompts)
    config = generation_config(lm, do_sample=False, max_new_tokens=max_new_tokens, scores=True)
    plist = processor_list(processors)
    stop, pad = stop_mask(lm), _pad_id(lm.tokenizer)
    out: list[GreedyAnswer] = []
    with lm.mode(False), torch.no_grad():
        for lo in _batches(len(encoded), batch_size, desc):
            ids, mask = left_pad(encoded[lo:lo + batch_size], pad, lm.device)
            res = generate_batch(lm, ids, mask, n=1, config=config, processors=plist,
                                 share_prompt=False, stop=stop)
            out.extend(_greedy_rows(lm, res.sequences[:, ids.shape[1]:], res.scores, stop))
    return out


def _greedy_rows(lm: Any, gen: torch.Tensor, scores: tuple, stop: torch.Tensor) -> list[GreedyAnswer]:
    """GreedyAnswers of generated ids (B, T) and processed scores (T × (B, V)): each row cut
    after its first end-of-answer token."""
    logp = torch.stack(scores, 1).float().log_softmax(-1)  # (B, T, V)
    chosen = logp.gather(-1, gen.unsqueeze(-1)).squeeze(-1).cpu()  # (B, T)
    ends = stop.to(gen.device)[gen].cpu()  # (B, T) True at end-of-answer tokens
    rows = []
    for b in range(gen.shape[0]):
        hits = ends[b].nonzero()
        k = int(hits[0]) + 1 if hits.numel() else gen.shape[1]
        text = lm.tokenizer.decode(gen[b, :k].tolist(), skip_special_tokens=True)
        rows.append(GreedyAnswer(text=answer_text(text), token_logprobs=chosen[b, :k].tolist(),
                                 token_ids=gen[b, :k].tolist()))
    return rows
