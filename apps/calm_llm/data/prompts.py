"""Prompt text for the three batch kinds (pure string functions, no tokenizer).

Letter (the CFT/CALM papers' format, reproduced exactly; docs/data.md)::

    ### Question: Question: {q}\n\nOptions:\nA. {o0}\nB. {o1}\n\nAnswer with only a single letter:\n ### Answer:

followed by the answer letter token. Cloze (lm-eval-harness convention for small models)::

    Question: {q}\nAnswer:   +   " {option}"

Instruction: the Stanford Alpaca template; the loss falls on the response only.
"""

from __future__ import annotations

LETTERS = "ABCDEFGHIJ"

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def letter_body(question: str, options: tuple[str, ...] | list[str]) -> str:
    """The question with lettered options and the instruction, without any answer header."""
    if len(options) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options are supported, got {len(options)}")
    lines = "\n".join(f"{LETTERS[i]}. {opt}" for i, opt in enumerate(options))
    return f"Question: {question}\n\nOptions:\n{lines}\n\nAnswer with only a single letter:"


def letter_prompt(question: str, options: tuple[str, ...] | list[str]) -> str:
    """The papers' letter prompt, ending right before the answer letter."""
    return f"### Question: {letter_body(question, options)}\n ### Answer:"


def cloze_context(question: str) -> str:
    """Cloze context; each option is scored as the continuation ``" " + option``."""
    return f"Question: {question}\nAnswer:"


def cloze_continuation(option: str) -> str:
    return f" {option}"


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """Alpaca prompt (the response follows directly)."""
    if input.strip():
        return ALPACA_WITH_INPUT.format(instruction=instruction, input=input)
    return ALPACA_NO_INPUT.format(instruction=instruction)
