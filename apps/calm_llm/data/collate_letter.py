"""Letter mode: the papers' answer-letter scoring, one sequence per question.

The sequence is the question with its lettered options, then ``letter_prefix`` and the gold
letter, the one answer token (the CFT/CALM papers' format, `prompts.letter_prompt`; docs/data.md "Prompts and batches").
Batches are LEFT-padded, so the answer position is the last column for every question and a
model may be called with ``logits_to_keep=1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .collate_base import CollatorBase
from .prompts import LETTERS, letter_body, letter_prompt
from .schema import Batch, MCQAExample


class LetterCollator(CollatorBase):
    """The letter-mode part of `collate.Collator` (a mixin: ``Collator`` sets ``letter_prefix``
    and ``option_token_ids``)."""

    letter_prefix: str
    option_token_ids: torch.Tensor

    def letter_prompt_text(self, ex: MCQAExample) -> str:
        """The prompt up to (not including) ``letter_prefix`` and the letter."""
        if self.prompt_style == "chat":
            return self._chat(letter_body(ex.question, ex.options))
        return letter_prompt(ex.question, ex.options)

    def _letter_ids(self) -> torch.Tensor:
        """(K,) the vocabulary id of each option letter: what ``tok(prompt + prefix + letter)``
        adds beyond ``tok(prompt)``, which must be exactly one token, distinct per letter."""
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

    def letter_sequence(self, ex: MCQAExample) -> tuple[list[int], int]:
        """(prompt ids + the gold letter's id, 1)."""
        return self.encode(self.letter_prompt_text(ex)) + [int(self.option_token_ids[ex.label])], 1

    def _letter(self, examples: Sequence[MCQAExample]) -> Batch:
        seqs = [self.letter_sequence(ex) for ex in examples]
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
