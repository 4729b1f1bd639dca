"""Examples -> `Batch`: the `Collator` of every mode, and the streams of batches built with it.

`Collator` combines the modes, one module each: `collate_letter` (answer-letter scoring,
left-padded), `collate_cloze` (each option's text log-likelihood; the shared-prefix packed and
cache layouts), `collate_instruction` (Alpaca-format examples), over `collate_base` (tokenizer,
prompt style, text -> ids, the cut to ``max_length``, padding). A collator takes a list of
multiple-choice questions in its ``mode``, or a list of instruction examples.

`budget_batches` groups examples by a token budget, longest first, instead of by count;
`batch_iterator` is the seeded, resumable stream of training batches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ...errors import DataError
from .collate_base import IGNORE, PROMPT_STYLES, leading_special_ids, pad_id_of
from .collate_cloze import PREFIX_LAYOUTS, ClozeCollator
from .collate_instruction import InstructionCollator
from .collate_letter import LetterCollator
from .packing import pack_batch
from .schema import Batch, InstructionExample, MCQAExample

__all__ = ["IGNORE", "MODES", "PREFIX_LAYOUTS", "PROMPT_STYLES", "Collator", "batch_iterator",
           "budget_batches", "leading_special_ids", "pad_id_of", "warn_truncated"]

MODES = ("letter", "cloze")


class Collator(LetterCollator, ClozeCollator, InstructionCollator):
    """Turns a list of examples into a `Batch` for one forward pass.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        mode: "letter" (the papers' answer-letter scoring) or "cloze" (each option's text
            log-likelihood). Instruction examples are always collated as instruction batches.
        prompt_style: "paper" (the CFT paper's prompt, docs/data.md "Prompts and batches") or "chat" (``tokenizer.apply_chat_template``
            around the same question; needs a tokenizer with a chat template).
        max_length: cap on the model input length; longer prompts lose their *left* part (the
            answer tokens are always kept).
        max_options: K, the number of option slots; questions with more options are an error.
        letter_prefix: text placed between "### Answer:" and the letter. Default " " for the
            paper style (the letter as this text is written, "Answer: A", and the convention
            under which the default model was measured, docs/data.md) and "" for the chat
            style (after a generation prompt the bare letter is what the model emits). The
            letter token is what ``tok(prompt + prefix + letter)`` adds beyond
            ``tok(prompt)``; it must be exactly one token.
        share_prefix: cloze batches of all options (``options="all"``) encode each question's
            context once (in ``prefix_layout``); off, every option repeats it (the plain layout that
            a single Hugging Face forward consumes).
        prefix_layout: how a shared prefix is laid out: "packed" (one row per question under a
            block mask: no padding between options and no KV-cache copies; needs an attention
            kernel that takes a custom mask, SDPA or eager) or "cache" (prefixes run first, the
            continuations against their gathered KV cache; any attention kernel).
        pack_sequences: plain right-padded batches (cloze, instruction; not letter batches,
            whose scoring reads their last column, nor shared-prefix ones, packed already)
            come with their sequences packed into rows of at most ``max_length`` tokens
            without padding (`packing.pack_batch`): the training layout of
            ``--train-layout packed``; it needs the same attention kernels as the packed
            shared prefix (`model.CausalLM.prefix_layout` == "packed").
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        mode: str,
        prompt_style: str = "paper",
        max_length: int = 512,
        max_options: int = 5,
        letter_prefix: str | None = None,
        share_prefix: bool = False,
        prefix_layout: str = "packed",
        pack_sequences: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        super().__init__(tokenizer, prompt_style=prompt_style, max_length=max_length,
                         max_options=max_options)
        if prefix_layout not in PREFIX_LAYOUTS:
            raise ValueError(f"prefix_layout must be one of {PREFIX_LAYOUTS}, got {prefix_layout!r}")
        self._check_chat_template()
        self.mode = mode
        self.letter_prefix = (" " if prompt_style == "paper" else "") if letter_prefix is None else letter_prefix
        self.share_prefix = bool(share_prefix)
        self.prefix_layout = prefix_layout
        self.pack_sequences = bool(pack_sequences)
        self.option_token_ids = self._letter_ids()

    # ---- examples -> Batch ---------------------------------------------------------------
    def __call__(self, examples: Sequence[MCQAExample | InstructionExample], *, options: str = "all") -> Batch:
        if options not in ("all", "gold"):
            raise ValueError(f"options must be 'all' or 'gold', got {options!r}")
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        batch = self._collate(examples, options)
        if self.pack_sequences and batch.mode != "letter" and batch.prefix is None \
                and batch.packed is None:
            return pack_batch(batch, self.max_length, self.pad_id)
        return batch

    def _collate(self, examples: Sequence[MCQAExample | InstructionExample], options: str) -> Batch:
        kinds = {type(e) for e in examples}
        if kinds == {InstructionExample}:
            return self._instruction(examples)
        if kinds != {MCQAExample}:
            raise ValueError(f"a batch must hold only MCQAExample or only InstructionExample, got {kinds}")
        for ex in examples:
            if len(ex.options) > self.max_options:
                raise DataError(
                    f"question {ex.id!r} has {len(ex.options)} options > max_options={self.max_options}"
                )
        if self.mode == "letter":
            return self._letter(examples)
        return self._cloze(examples, options)

    def sequences(
        self, ex: MCQAExample | InstructionExample, options: str = "all"
    ) -> list[tuple[list[int], int]]:
        """(token ids, number of trailing answer tokens) of each sequence ``ex`` adds to a batch,
        before any cut to ``max_length``: one for a letter or instruction example, one per
        option in cloze mode (the gold option's alone with ``options="gold"``)."""
        if isinstance(ex, InstructionExample):
            return [self.instruction_sequence(ex)]
        if self.mode == "letter":
            return [self.letter_sequence(ex)]
        return self.cloze_sequences(ex, options)

    def n_truncated(self, examples: Sequence[MCQAExample | InstructionExample]) -> int:
        """How many of ``examples`` have a sequence longer than ``max_length`` input tokens,
        i.e. a prompt that loses its left part (the question's start) when collated."""
        return sum(
            any(len(ids) - 1 > self.max_length for ids, _ in self.sequences(ex)) for ex in examples
        )


def warn_truncated(counts: dict[str, tuple[int, int]], max_length: int) -> int:
    """One warning for every split whose prompts ``--max-length`` cuts: ``counts`` maps a split
    name to (truncated examples, examples) (`Collator.n_truncated`). Returns the total cut.

    A cut prompt loses its left part, the question's start, and is scored anyway; without this
    warning a too small ``--max-length`` would lower every score without a trace."""
    cut = {name: (k, n) for name, (k, n) in counts.items() if k}
    total = sum(k for k, _ in cut.values())
    if total:
        parts = ", ".join(f"{name} {k} of {n}" for name, (k, n) in cut.items())
        warnings.warn(
            f"{total} examples are longer than --max-length {max_length} tokens ({parts}): their "
            "prompts lose their left part (the start of the question) and are scored that way; "
            "raise --max-length to keep them whole",
            UserWarning,
            stacklevel=2,
        )
    return total


def budget_batches(
    examples: Sequence[MCQAExample | InstructionExample],
    collator: Collator,
    max_tokens: int,
    *,
    max_examples: int = 0,
    options: str = "all",
) -> Iterator[tuple[list[int], Batch]]:
    """Evaluation batches under a token budget: ``(indices into examples, batch)``.

    Examples are taken longest first (as lm-eval-harness orders its requests, so that the
    first batch is the largest one and padding stays small) and a batch grows while its padded
    size (`Batch.padded_terms`: R·W for R packed rows of width W, G·P + S·C for the cache
    layout's G prefixes of width P and S continuations of width C, S·L in the plain layout)
    stays within ``max_tokens``; one example always fits.
    ``max_examples`` > 0 also caps the questions per batch. Each example's size is measured on
    its own batch (the collator memoizes tokenization, so collating twice costs little).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(examples) == 0:
        return
    batches = [collator([ex], options=options) for ex in examples]
    sizes = [b.padded_terms() for b in batches]
    # a question that falls back to the plain layout (its answer fills the input) makes the
    # whole batch plain: it is batched only with its own kind, so the budget counts true sizes
    kinds = [(b.packed is not None, b.prefix is not None) for b in batches]
    order = sorted(range(len(examples)), key=lambda i: (kinds[i], -sum(w for _, w in sizes[i])))
    idx: list[int] = []
    rows: list[int] = []  # per padded tensor of the batch so far: total rows and widest row
    widths: list[int] = []
    for i in order:
        terms = sizes[i]
        if idx and kinds[i] != kinds[idx[-1]]:
            yield idx, collator([examples[j] for j in idx], options=options)
            idx = []
        if not idx:
            rows, widths = [0] * len(terms), [0] * len(terms)
        cost = sum((r + t[0]) * max(w, t[1]) for r, w, t in zip(rows, widths, terms))
        if idx and (cost > max_tokens or (max_examples and len(idx) >= max_examples)):
            yield idx, collator([examples[j] for j in idx], options=options)
            idx, rows, widths = [], [0] * len(terms), [0] * len(terms)
        idx.append(i)
        rows = [r + t[0] for r, t in zip(rows, terms)]
        widths = [max(w, t[1]) for w, t in zip(widths, terms)]
    yield idx, collator([examples[j] for j in idx], options=options)


def batch_iterator(
    examples: Sequence[MCQAExample | InstructionExample],
    collator: Collator,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    options: str = "all",
    start: int = 0,
    epochs: int | None = None,
) -> Iterator[Batch]:
    """Batches of ``batch_size`` examples, deterministic for a given ``seed``.

    The example stream is the concatenation of per-epoch orders (epoch e is a permutation
    drawn from ``seed`` and e when ``shuffle``, else the given order); batch b holds stream
    positions ``[b*B, (b+1)*B)``, so batches wrap across epoch boundaries and
    ``start`` (batches already consumed, e.g. when resuming) is skipped in O(1).
    ``epochs=None`` means forever when ``shuffle`` (training) and one pass otherwise
    (evaluation); a finite stream ends with a possibly short batch.
    """
    n = len(examples)
    if n == 0:
        raise ValueError("batch_iterator needs at least one example")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if epochs is None:
        epochs = None if shuffle else 1
    total = math.inf if epochs is None else epochs * n

    cache: dict[int, list[int]] = {}

    def order(epoch: int) -> list[int]:
        if epoch not in cache:
            cache.clear()  # at most two epochs are touched by one batch
            if shuffle:
                g = torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch)
                cache[epoch] = torch.randperm(n, generator=g).tolist()
            else:
                cache[epoch] = list(range(n))
        return cache[epoch]

    b = start
    while b * batch_size < total:
        lo = b * batch_size
        hi = min(lo + batch_size, total)
        idx = []
        for p in range(lo, int(hi)):
            idx.append(order(p // n)[p % n])
        yield collator([examples[i] for i in idx], options=options)
        b += 1
