"""Correctness of a free-form answer: alias matching (``--match exact|contains``) or an LLM judge
(``--match judge --judge-model NAME``).

The judge is a causal LM asked, for each (question, gold aliases, proposed answer), whether the
answer is correct; its verdict is read from the next-token distribution of its reply rather
than from generated text, so it always gives one and is deterministic:

    correct  ⇔  Σ_{y ∈ YES} p(y | prompt) > Σ_{n ∈ NO} p(n | prompt)

where YES / NO are the first tokens of "yes", " yes", "Yes", " Yes" (and the same for "no").
Answers that equal a gold alias after normalization are right, and answers that normalize to
"" are wrong, without asking (the judge only decides the cases alias matching cannot). The
protocol's code asks an LLM judge (a large instruction model) for every answer; the model is
the user's choice here (a hub name or a folder; ``smollm2``/``tiny`` offline, which are too small
to judge well and serve the tests and the pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from calibration import semantic

from ...errors import ConfigError

JUDGE_PROMPT = (
    "Question: {question}\nGold answers: {golds}\nProposed answer: {answer}\n"
    "Is the proposed answer correct, i.e. does it mean the same as one of the gold answers? "
    "Reply with yes or no."
)
MAX_ALIASES = 10  # TriviaQA lists up to ~100 spellings; the first ones are the canonical ones
YES, NO = ("yes", " yes", "Yes", " Yes"), ("no", " no", "No", " No")


def _first_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
    return sorted({tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words})


class LLMJudge:
    """``judge(items) -> list[bool]`` for items ``(question, answer, aliases)``, batched.

    ``model`` is a causal LM (frozen, eval mode), ``tokenizer`` its tokenizer; prompts go
    through its chat template when it has one, else they end in ``"\\nAnswer:"``.
    """

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 16) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.yes, self.no = _first_ids(tokenizer, YES), _first_ids(tokenizer, NO)
        if set(self.yes) & set(self.no):
            raise ConfigError("the judge's tokenizer gives 'yes' and 'no' a common first token")

    @classmethod
    def load(cls, name_or_path: str, *, device: torch.device | str = "cpu", dtype: str = "fp32",
             batch_size: int = 16) -> LLMJudge:
        """The judge by ``--judge-model``: a hub name, a folder, or ``smollm2``/``tiny``."""
        from ..config import ModelConfig
        from ..model import load_base

        model, tok = load_base(ModelConfig(name_or_path=name_or_path, dtype=dtype))
        return cls(model.to(device).eval(), tok, batch_size=batch_size)

    def prompt(self, question: str, answer: str, aliases: Sequence[str]) -> str:
        text = JUDGE_PROMPT.format(question=question, answer=answer,
                                   golds="; ".join(list(aliases)[:MAX_ALIASES]))
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return text + "\nAnswer:"

    @torch.no_grad()
    def p_yes(self, items: Sequence[tuple[str, str, Sequence[str]]]) -> list[float]:
        """p(yes) / (p(yes) + p(no)) of each item's verdict."""
        from ..sampling import encode_prompts, left_pad, position_ids

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        device = next(self.model.parameters()).device
        out: list[float] = []
        for lo in range(0, len(items), self.batch_size):
            prompts = [self.prompt(q, a, al) for q, a, al in items[lo:lo + self.batch_size]]
            ids, mask = left_pad(encode_prompts(self.tokenizer, prompts), pad, device)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                                logits_to_keep=1).logits[:, -1].float()
            p = logits.softmax(-1)
            yes, no = p[:, self.yes].sum(-1), p[:, self.no].sum(-1)
            out.extend((yes / (yes + no).clamp_min(1e-30)).tolist())
        return out

    def __call__(self, items: Sequence[tuple[str, str, Sequence[str]]]) -> list[bool]:
        return [p > 0.5 for p in self.p_yes(items)]


def judge_answers(items: Sequence[tuple[str, str, Sequence[str]]], mode: str,
                  judge: LLMJudge | None = None) -> list[bool]:
    """Whether each ``(question, answer, aliases)`` is right: `calibration.semantic.matches`
    with ``mode`` ``exact``/``contains``; ``judge``: an exact alias match is right and an empty
    answer wrong without a call, the rest as ``judge`` decides (one batched pass)."""
    if mode != "judge":
        return [semantic.matches(a, al, mode=mode) for _, a, al in items]
    if judge is None:
        raise ConfigError("--match judge needs a judge model (--judge-model)")
    out: list[bool | None] = []
    for _, a, al in items:
        if semantic.matches(a, al, mode="exact"):
            out.append(True)
        elif not semantic.normalize_answer(a):
            out.append(False)
        else:
            out.append(None)
    ask = [i for i, v in enumerate(out) if v is None]
    for i, verdict in zip(ask, judge([items[i] for i in ask])):
        out[i] = verdict
    return [bool(v) for v in out]
