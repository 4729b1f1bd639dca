"""Tokenization and padding: examples -> `Batch` for the letter, cloze and instruction modes.

Every sequence is built the same way: the full token list ``ids`` (prompt followed by the
answer tokens) and the number ``n_ans`` of trailing answer tokens. The model input is
``ids[:-1]`` and the target at position t is ``ids[t + 1]`` (already shifted), kept only for
the answer tokens. Letter batches are LEFT-padded so the answer position is the last column
(a model may then be called with ``logits_to_keep=1``); cloze and instruction batches are
right-padded. Positions are ``cumsum(attention_mask) - 1`` so that padding never shifts them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .prompts import (
    LETTERS,
    alpaca_prompt,
    cloze_context,
    cloze_continuation,
    letter_body,
    letter_prompt,
)
from .schema import Batch, InstructionExample, MCQAExample

IGNORE = -100
MODES = ("letter", "cloze")
PROMPT_STYLES = ("paper", "chat")


class Collator:
    """Turns a list of examples into a `Batch` for one forward pass.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        mode: "letter" (the papers' answer-letter scoring) or "cloze" (each option's text
            log-likelihood). Instruction examples are always collated as instruction batches.
        prompt_style: "paper" (method-notes §4 text) or "chat" (``tokenizer.apply_chat_template``
            around the same question; needs a tokenizer with a chat template).
        max_length: cap on the model input length; longer prompts lose their *left* part (the
            answer tokens are always kept).
        max_options: K, the number of option slots; questions with more options are an error.
        letter_prefix: text placed between "### Answer:" and the letter. Default " " for the
            paper style (the letter as this text is written, "Answer: A", and the convention
            of the measurements in offline-assets.md) and "" for the chat style (after a
            generation prompt the bare letter is what the model emits). The letter token is
            what ``tok(prompt + prefix + letter)`` adds beyond ``tok(prompt)``; it must be
            exactly one token.
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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
        if not 2 <= max_options <= len(LETTERS):
            raise ValueError(f"max_options must be in 2..{len(LETTERS)}, got {max_options}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        if prompt_style == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "prompt_style='chat' needs a tokenizer with a chat template; this one has none "
                "(use prompt_style='paper')"
            )
        self.tokenizer = tokenizer
        self.mode = mode
        self.prompt_style = prompt_style
        self.max_length = max_length
        self.max_options = max_options
        self.letter_prefix = (" " if prompt_style == "paper" else "") if letter_prefix is None else letter_prefix
        self.pad_id = _pad_id(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self._lead = _leading_special_ids(tokenizer)
        self.option_token_ids = self._letter_ids()

    # ---- text -> ids -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's leading special tokens (BOS) and no
        trailing ones, so that prefixes of the text give prefixes of the ids."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self._lead and ids[: len(self._lead)] == self._lead:
            return list(ids)  # a chat template already wrote the BOS
        return self._lead + list(ids)

    def _chat(self, user: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )

    def letter_prompt_text(self, ex: MCQAExample) -> str:
        """The prompt up to (not including) ``letter_prefix`` and the letter."""
        if self.prompt_style == "chat":
            return self._chat(letter_body(ex.question, ex.options))
        return letter_prompt(ex.question, ex.options)

    def cloze_texts(self, ex: MCQAExample) -> tuple[str, list[str]]:
        """(context, continuations) for one question."""
        if self.prompt_style == "chat":
            return self._chat(ex.question), list(ex.options)
        return cloze_context(ex.question), [cloze_continuation(o) for o in ex.options]

    def instruction_texts(self, ex: InstructionExample) -> tuple[str, str]:
        if self.prompt_style == "chat":
            user = ex.instruction if not ex.input.strip() else f"{ex.instruction}\n\n{ex.input}"
            return self._chat(user), ex.output
        return alpaca_prompt(ex.instruction, ex.input), ex.output

    def continuation_ids(self, context: str, continuation: str) -> tuple[list[int], int]:
        """(ids of context+continuation, number of trailing tokens that the continuation adds).

        The continuation tokens are what ``tok(ctx + cont)`` adds beyond ``tok(ctx)``; where
        a merge crosses the boundary the shared prefix decides (lm-eval-harness convention).
        """
        ctx = self.encode(context)
        full = self.encode(context + continuation)
        common = 0
        for a, b in zip(ctx, full):
            if a != b:
                break
            common += 1
        n_cont = len(full) - common
        if n_cont < 1:
            raise ValueError(f"continuation {continuation!r} adds no tokens after {context[-40:]!r}")
        return full, n_cont

    def _letter_ids(self) -> torch.Tensor:
        ref = MCQAExample("ref", "q", tuple("ab"), 0, "ref")
        prompt = self.letter_prompt_text(ref)
        base = self.encode(prompt)
        ids = []
        for letter in LETTERS[: self.max_options]:
            full = self.encode(prompt + self.letter_prefix + letter)
            if len(full) != len(base) + 1 or full[: len(base)] != base:
                raise ValueError(
                    f"option letter {letter!r} after {prompt[-20:]!r} does not encode as one extra "
                    f"token with this tokenizer (got {full[len(base) - 1:]}); "
                    "try another letter_prefix"
                )
            ids.append(full[-1])
        if len(set(ids)) != len(ids):
            raise ValueError(f"option letters share token ids: {ids}")
        return torch.tensor(ids, dtype=torch.long)

    # ---- examples -> Batch ---------------------------------------------------------------
    def __call__(self, examples: Sequence[MCQAExample | InstructionExample], *, options: str = "all") -> Batch:
        if options not in ("all", "gold"):
            raise ValueError(f"options must be 'all' or 'gold', got {options!r}")
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        kinds = {type(e) for e in examples}
        if kinds == {InstructionExample}:
            return self._instruction(examples)
        if kinds != {MCQAExample}:
            raise ValueError(f"a batch must hold only MCQAExample or only InstructionExample, got {kinds}")
        for ex in examples:
            if len(ex.options) > self.max_options:
                raise ValueError(
                    f"question {ex.id!r} has {len(ex.options)} options > max_options={self.max_options}"
                )
        if self.mode == "letter":
            return self._letter(examples)
        return self._cloze(examples, options)

    def _letter(self, examples: Sequence[MCQAExample]) -> Batch:
        seqs = []
        for ex in examples:
            ids = self.encode(self.letter_prompt_text(ex)) + [int(self.option_token_ids[ex.label])]
            seqs.append((ids, 1))
        n = len(examples)
        return self._assemble(
            "letter",
            seqs,
            left_pad=True,
            labels=[ex.label for ex in examples],
            n_options=[len(ex.options) for ex in examples],
            seq_question=list(range(n)),
            seq_option=[-1] * n,
            cont_chars=[1] * n,
            option_token_ids=self.option_token_ids.clone(),
        )

    def _cloze(self, examples: Sequence[MCQAExample], options: str) -> Batch:
        seqs, seq_q, seq_o, chars = [], [], [], []
        for qi, ex in enumerate(examples):
            context, conts = self.cloze_texts(ex)
            which = range(len(conts)) if options == "all" else [ex.label]
            for j in which:
                seqs.append(self.continuation_ids(context, conts[j]))
                seq_q.append(qi)
                seq_o.append(j)
                chars.append(len(conts[j]))
        return self._assemble(
            "cloze",
            seqs,
            left_pad=False,
            labels=[ex.label for ex in examples],
            n_options=[len(ex.options) for ex in examples],
            seq_question=seq_q,
            seq_option=seq_o,
            cont_chars=chars,
        )

    def _instruction(self, examples: Sequence[InstructionExample]) -> Batch:
        seqs = []
        for ex in examples:
            prompt, response = self.instruction_texts(ex)
            full, n_resp = self.continuation_ids(prompt, response)
            if self.eos_id is not None:  # the model should also learn where to stop
                full, n_resp = full + [self.eos_id], n_resp + 1
            seqs.append((full, n_resp))
        n = len(examples)
        return self._assemble(
            "instruction",
            seqs,
            left_pad=False,
            labels=[-1] * n,
            n_options=[0] * n,
            seq_question=list(range(n)),
            seq_option=[-1] * n,
            cont_chars=[0] * n,
        )

    def _assemble(
        self,
        mode: str,
        seqs: list[tuple[list[int], int]],
        *,
        left_pad: bool,
        labels: list[int],
        n_options: list[int],
        seq_question: list[int],
        seq_option: list[int],
        cont_chars: list[int],
        option_token_ids: torch.Tensor | None = None,
    ) -> Batch:
        rows = []
        for ids, n_ans in seqs:
            inp, tgt = ids[:-1], ids[1:]
            tgt = [IGNORE] * (len(tgt) - n_ans) + tgt[len(tgt) - n_ans :]
            if len(inp) > self.max_length:
                if n_ans > self.max_length:
                    raise ValueError(
                        f"answer of {n_ans} tokens does not fit max_length={self.max_length}"
                    )
                inp, tgt = inp[-self.max_length :], tgt[-self.max_length :]
            rows.append((inp, tgt))
        L = max(len(r[0]) for r in rows)
        S = len(rows)
        input_ids = torch.full((S, L), self.pad_id, dtype=torch.long)
        target_ids = torch.full((S, L), IGNORE, dtype=torch.long)
        mask = torch.zeros((S, L), dtype=torch.long)
        for s, (inp, tgt) in enumerate(rows):
            sl = slice(L - len(inp), L) if left_pad else slice(0, len(inp))
            input_ids[s, sl] = torch.tensor(inp, dtype=torch.long)
            target_ids[s, sl] = torch.tensor(tgt, dtype=torch.long)
            mask[s, sl] = 1
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        return Batch(
            mode=mode,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            target_ids=target_ids,
            labels=torch.tensor(labels, dtype=torch.long),
            n_options=torch.tensor(n_options, dtype=torch.long),
            seq_question=torch.tensor(seq_question, dtype=torch.long),
            seq_option=torch.tensor(seq_option, dtype=torch.long),
            cont_chars=torch.tensor(cont_chars, dtype=torch.long),
            option_token_ids=option_token_ids,
            max_options=self.max_options,
        )


def _pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return 0  # masked out everywhere; any valid id works


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer puts in front of a text (e.g. BOS), found by comparison."""
    with_sp = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    for k in range(len(with_sp) - len(without) + 1):
        if with_sp[k : k + len(without)] == without:
            return with_sp[:k]
    return []


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
