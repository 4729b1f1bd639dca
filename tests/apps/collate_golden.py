"""The golden batches of `Collator`: every mode and layout on fixed examples, for the test that
splitting the collator by mode changed no tensor (tests/apps/test_collate_golden.py).

``python -m tests.apps.collate_golden`` writes tests/apps/data/collate_golden.json; it was run
once at the commit before the split (the single-class collator), and the test compares what
the current code builds with that file. Each case is stored as the sha256 of every tensor's
dtype, shape and bytes (and every other value's repr), in field order: equal digests mean
equal batches tensor for tensor, and the file stays a few kilobytes where the tensors
themselves take 1.5 MB. Regenerate only on purpose: a change of the batches is a change of
every score.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from apps.calm_llm.assets import tiny_model_and_tokenizer
from apps.calm_llm.data import Collator, InstructionExample, MCQAExample, batch_iterator
from apps.calm_llm.data.collate import budget_batches

PATH = Path(__file__).resolve().parent / "data" / "collate_golden.json"
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = ["red", "blue", "green", "cold", "warm", "tall", "short", "fast", "slow", "soft"]
MCQA = [
    MCQAExample("t:0", "What is 2+2?", ("3", "4", "5", "6"), 1, "t"),
    MCQAExample("t:1", "Which colour is the clear daytime sky?", ("blue", "green", "red"), 0, "t"),
    MCQAExample("t:2", "Pick E.", ("a", "b", "c", "d", "the fifth option"), 4, "t"),
    MCQAExample("t:long", "Why " * 40 + "?", ("yes", "no, because it is long"), 1, "t"),
] + [
    MCQAExample(f"s{i}", f"Question {i}: " + "which word fits the clue? " * (1 + i % 4),
                tuple(WORDS[(i + j) % 10] + (" and a much longer tail" if j == 1 else "")
                      for j in range(2 + i % 4)), i % 2, "synthetic")
    for i in range(6)
]
INSTRUCTIONS = [
    InstructionExample("i:0", "Name a colour.", "", "Blue.", "alpaca"),
    InstructionExample("i:1", "Add the numbers.", "2 and 3", "They add up to 5.", "alpaca"),
    InstructionExample("i:2", "Explain " * 30, "", "Because it is so, and for no other reason.",
                       "alpaca"),
]


def flat(batch: Any) -> dict[str, Any]:
    """A `Batch` as {field: tensor or value}, its `Prefix` / `Packed` fields as
    ``prefix.NAME`` / ``packed.NAME`` (None kept, so an absent layout is compared too)."""
    out: dict[str, Any] = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if f.name in ("prefix", "packed") and v is not None:
            out.update({f"{f.name}.{g.name}": getattr(v, g.name) for g in fields(v)})
        else:
            out[f.name] = v
    return out


def _collators(tok: Any, chat_tok: Any) -> Iterator[tuple[str, Collator]]:
    for length in (512, 40, 12):
        yield f"letter/{length}", Collator(tok, mode="letter", max_length=length)
        yield f"cloze/{length}", Collator(tok, mode="cloze", max_length=length)
        for layout in ("packed", "cache"):
            yield f"cloze-{layout}/{length}", Collator(tok, mode="cloze", max_length=length,
                                                       share_prefix=True, prefix_layout=layout)
    yield "letter-bare", Collator(tok, mode="letter", letter_prefix="")
    yield "letter-chat", Collator(chat_tok, mode="letter", prompt_style="chat")
    yield "cloze-chat", Collator(chat_tok, mode="cloze", prompt_style="chat", share_prefix=True)


def build() -> dict[str, Any]:
    """{case name: flat batch, or a list of them, or the collator's other outputs}."""
    _, tok = tiny_model_and_tokenizer(seed=0)
    _, chat_tok = tiny_model_and_tokenizer(seed=0)
    chat_tok.chat_template = CHAT_TEMPLATE
    out: dict[str, Any] = {}
    for name, col in _collators(tok, chat_tok):
        out[f"{name}/option_token_ids"] = col.option_token_ids
        out[f"{name}/n_truncated"] = col.n_truncated([*MCQA, *INSTRUCTIONS])
        out[f"{name}/sequences"] = [col.sequences(ex, options=o) for ex in MCQA
                                    for o in ("all", "gold")]
        out[f"{name}/instruction"] = flat(col(INSTRUCTIONS))
        for options in ("all", "gold"):
            out[f"{name}/{options}"] = flat(col(MCQA, options=options))
            out[f"{name}/{options}/budget"] = [
                (idx, flat(b)) for idx, b in budget_batches(MCQA, col, 300, max_examples=3,
                                                            options=options)]
    col = Collator(tok, mode="cloze", max_length=64)
    out["stream"] = [flat(b) for _, b in zip(range(5), batch_iterator(
        [*MCQA], col, 3, shuffle=True, seed=3, options="gold", start=1))]
    return out


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"tensor {value.dtype} {tuple(value.shape)}|".encode())
        h.update(value.contiguous().numpy().tobytes())
    elif isinstance(value, dict):
        for k, v in value.items():
            h.update(f"key {k}|".encode())
            _feed(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(f"seq {len(value)}|".encode())
        for v in value:
            _feed(h, v)
    else:
        h.update(f"value {value!r}|".encode())


def digests() -> dict[str, str]:
    """{case name: sha256 of its batches (`_feed`)}."""
    out = {}
    for name, value in build().items():
        h = hashlib.sha256()
        _feed(h, value)
        out[name] = h.hexdigest()
    return out


def main() -> None:
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text(json.dumps(digests(), indent=1) + "\n")
    print(f"wrote {PATH} ({PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
