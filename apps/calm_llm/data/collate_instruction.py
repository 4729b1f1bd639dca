"""Instruction mode: Alpaca-format examples, the loss on the response (and EOS) only.

The sequence is the prompt (the Stanford Alpaca template, Taori et al. 2023, or the tokenizer's chat
template around instruction and input) followed by the response and the EOS token, so the
model also learns where to stop. Batches are right-padded.
"""

from __future__ import annotations

from collections.abc import Sequence

from .collate_base import CollatorBase
from .prompts import alpaca_prompt
from .schema import Batch, InstructionExample


class InstructionCollator(CollatorBase):
    """The instruction part of `collate.Collator` (a mixin; every collator takes instruction
    examples, whatever its multiple-choice mode)."""

    def instruction_texts(self, ex: InstructionExample) -> tuple[str, str]:
        """(prompt, response) of one example."""
        if self.prompt_style == "chat":
            user = ex.instruction if not ex.input.strip() else f"{ex.instruction}\n\n{ex.input}"
            return self._chat(user), ex.output
        return alpaca_prompt(ex.instruction, ex.input), ex.output

    def instruction_sequence(self, ex: InstructionExample) -> tuple[list[int], int]:
        """(prompt + response (+ EOS) ids, number of response tokens (+ 1 for EOS))."""
        prompt, response = self.instruction_texts(ex)
        full, n_resp = self.continuation_ids(prompt, response)
        if self.eos_id is not None:  # the model should also learn where to stop
            full, n_resp = full + [self.eos_id], n_resp + 1
        return full, n_resp

    def _instruction(self, examples: Sequence[InstructionExample]) -> Batch:
        seqs = [self.instruction_sequence(ex) for ex in examples]
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
