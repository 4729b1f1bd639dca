"""What every collator mode shares: the tokenizer and its prompt style, text -> ids, the cut to
``max_length``, padding, and the `Batch` a mode's sequences become.

Every sequence is built the same way: the full token list ``ids`` (prompt followed by the
answer tokens) and the number ``n_ans`` of trailing answer tokens. The model input is
``ids[:-1]`` and the target at position t is ``ids[t + 1]`` (already shifted), kept only for
the answer tokens. A prompt longer than ``max_length`` input tokens loses its *left* part (the
answer tokens are always kept). Positions are ``cumsum(attention_mask) - 1``, so that padding
never shifts them.

The modes (`collate_letter`, `collate_cloze`, `collate_instruction`) are mixins over
`CollatorBase`; `collate.Collator` combines them and is the one constructor.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import ConfigError, DataError
from .prompts import LETTERS
from .schema import Batch, Packed, Prefix

IGNORE = -100
PROMPT_STYLES = ("paper", "chat")


class CollatorBase:
    """The tokenizer, prompt style and length limits every mode reads, and the shared steps
    from token lists to a padded `Batch` (cost: one tokenizer call per text, memoized for
    prompt + continuation pairs; O(S·L) to pad S sequences of at most L tokens)."""

    def __init__(self, tokenizer: Any, *, prompt_style: str, max_length: int, max_options: int) -> None:
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
        if not 2 <= max_options <= len(LETTERS):
            raise ValueError(f"max_options must be in 2..{len(LETTERS)}, got {max_options}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.tokenizer = tokenizer
        self.prompt_style = prompt_style
        self.max_length = max_length
        self.max_options = max_options
        self._encoded: dict[tuple[str, str], tuple[list[int], int]] = {}
        self.pad_id = pad_id_of(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self._lead = leading_special_ids(tokenizer)

    def _check_chat_template(self) -> None:
        if self.prompt_style == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                "prompt_style='chat' needs a tokenizer with a chat template; this one has none "
                "(use prompt_style='paper')"
            )

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

    def continuation_ids(self, context: str, continuation: str) -> tuple[list[int], int]:
        """(ids of context+continuation, number of trailing tokens that the continuation adds).

        The continuation tokens are what ``tok(ctx + cont)`` adds beyond ``tok(ctx)``; where
        a merge crosses the boundary the shared prefix decides (lm-eval-harness convention).
        Memoized: evaluation collates the same questions once per method.
        """
        key = (context, continuation)
        if key in self._encoded:
            full, n_cont = self._encoded[key]
            return list(full), n_cont
        if len(self._encoded) >= 200_000:  # bound the memo on endless instruction streams
            self._encoded.clear()
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
        self._encoded[key] = (full, n_cont)
        return list(full), n_cont

    # ---- ids -> tensors ------------------------------------------------------------------
    def _cut(self, ids: list[int], n_ans: int) -> tuple[list[int], list[int], bool]:
        """(model input, aligned targets, whether the input was cut to ``max_length``)."""
        inp, tgt = ids[:-1], ids[1:]
        tgt = [IGNORE] * (len(tgt) - n_ans) + tgt[len(tgt) - n_ans :]
        if len(inp) <= self.max_length:
            return inp, tgt, False
        if n_ans > self.max_length:
            raise DataError(f"answer of {n_ans} tokens does not fit max_length={self.max_length}")
        return inp[-self.max_length :], tgt[-self.max_length :], True

    def _pad(
        self, rows: list[tuple[list[int], list[int]]], *, left_pad: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, target_ids, attention_mask, position_ids), each (len(rows), longest)."""
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
        return input_ids, target_ids, mask, position_ids

    def _assemble(
        self, mode: str, seqs: list[tuple[list[int], int]], *, left_pad: bool, **meta: Any
    ) -> Batch:
        rows = [self._cut(ids, n_ans)[:2] for ids, n_ans in seqs]
        input_ids, target_ids, mask, position_ids = self._pad(rows, left_pad=left_pad)
        return self._batch(mode, input_ids, mask, position_ids, target_ids, **meta)

    def _batch(
        self,
        mode: str,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        target_ids: torch.Tensor,
        *,
        labels: list[int],
        n_options: list[int],
        seq_question: list[int],
        seq_option: list[int],
        cont_chars: list[int],
        option_token_ids: torch.Tensor | None = None,
        prefix: Prefix | None = None,
        packed: Packed | None = None,
    ) -> Batch:
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
            prefix=prefix,
            packed=packed,
        )


def pad_id_of(tokenizer: Any) -> int:
    """The id that pads a row: the tokenizer's pad id, else its EOS id, else 0 (padding is
    masked out everywhere, so any valid id would do)."""
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return 0  # masked out everywhere; any valid id works


def leading_special_ids(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer puts in front of a text (e.g. BOS), found by comparison."""
    with_sp = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    for k in range(len(with_sp) - len(without) + 1):
        if with_sp[k : k + len(without)] == without:
            return with_sp[:k]
    return []
