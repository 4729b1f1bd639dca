"""Synthetic questions generated in code: multiple choice and open QA, no data package needed.

What a run on a machine without datasets, network or the offline asset packages trains and
scores on (``bench.gpu_check``): the code path is the real one (the rows are written as .jsonl
and read through ``--data-files NAME=PATH``, the unified fields of `sources.map_unified` and
`open_qa.map_open_qa_row`), only the questions are made up. Three kinds, each deterministic in
its seed:

* ``arithmetic``: "What is 17 plus 25?" with the sum and three near misses (in-domain MCQA);
* ``categories``: "Which of these is a fruit?" with one word of that category and three of
  others (out-of-domain MCQA: other wording, other answers);
* ``open_arithmetic``: the arithmetic question without options; gold answers the number in
  digits and in words where it has a short one (open QA, in-domain);
* ``open_categories``: "Name a fruit other than pear." with the category's other words as
  gold answers (open QA, out-of-domain).

Every question is distinct within a kind (no two rows share a question with another answer,
which `sources` refuses), and the answers are balanced over the option letters.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

KINDS = ("arithmetic", "categories", "open_arithmetic", "open_categories")

CATEGORIES: dict[str, tuple[str, ...]] = {
    "fruit": ("apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "pear", "plum"),
    "color": ("red", "blue", "green", "yellow", "purple", "brown", "black", "white", "pink"),
    "animal": ("horse", "tiger", "rabbit", "eagle", "salmon", "spider", "camel", "otter", "wolf"),
    "tool": ("hammer", "wrench", "saw", "chisel", "drill", "pliers", "shovel", "rake", "axe"),
    "country": ("France", "Peru", "Kenya", "Japan", "Norway", "Chile", "Egypt", "India", "Spain"),
    "instrument": ("violin", "piano", "flute", "drum", "guitar", "trumpet", "harp", "cello", "oboe"),
}
_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
          "fourteen fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """``n`` (0..99) in English words: 42 -> "forty-two"."""
    if not 0 <= n < 100:
        raise ValueError(f"number_words covers 0..99, got {n}")
    if n < 20:
        return _UNITS[n]
    tens, unit = divmod(n, 10)
    return _TENS[tens - 2] + (f"-{_UNITS[unit]}" if unit else "")


def _letter_slots(n: int, n_options: int, rng: random.Random) -> list[int]:
    """Gold positions balanced over the letters (each used ⌊n/k⌋ or ⌈n/k⌉ times), shuffled."""
    slots = [i % n_options for i in range(n)]
    rng.shuffle(slots)
    return slots


def arithmetic_questions(n: int, *, seed: int = 0, source: str = "synth_arith") -> list[dict[str, Any]]:
    """``n`` distinct "What is a plus b?" / "a minus b" questions with four numeric options.

    The distractors are the answer ± 1..9 (distinct, non-negative), so a model must read the
    numbers, not guess from magnitude. Rows hold the unified fields (``id``, ``question``,
    ``options``, ``label``)."""
    rng = random.Random(f"{source}:{seed}")
    pairs = [(a, b, op) for a in range(2, 60) for b in range(2, 40) for op in ("plus", "minus") if op == "plus" or a > b]
    if n > len(pairs):
        raise ValueError(f"arithmetic_questions: at most {len(pairs)} distinct questions, asked for {n}")
    slots = _letter_slots(n, 4, rng)
    rows = []
    for i, (a, b, op) in enumerate(rng.sample(pairs, n)):
        answer = a + b if op == "plus" else a - b
        wrong = rng.sample([answer + d for d in (-9, -7, -5, -3, -2, -1, 1, 2, 3, 5, 7, 9) if answer + d >= 0], 3)
        options = wrong[: slots[i]] + [answer] + wrong[slots[i]:]
        rows.append({"id": f"{i}", "question": f"What is {a} {op} {b}?",
                     "options": [str(o) for o in options], "label": slots[i]})
    return rows


def category_questions(n: int, *, seed: int = 0, source: str = "synth_words") -> list[dict[str, Any]]:
    """``n`` distinct "Which of these is a <category>?" questions: one word of the category,
    three of three other categories."""
    rng = random.Random(f"{source}:{seed}")
    names = sorted(CATEGORIES)
    slots = _letter_slots(n, 4, rng)
    rows, seen, tries = [], set(), 0
    while len(rows) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"category_questions: cannot draw {n} distinct questions")
        cat = rng.choice(names)
        gold = rng.choice(CATEGORIES[cat])
        others = [rng.choice(CATEGORIES[c]) for c in rng.sample([c for c in names if c != cat], 3)]
        key = (cat, gold, *sorted(others))
        if key in seen:
            continue
        seen.add(key)
        k = slots[len(rows)]
        rows.append({"id": f"{len(rows)}", "question": f"Which of these is a {cat}?",
                     "options": others[:k] + [gold] + others[k:], "label": k})
    return rows


def open_arithmetic_questions(n: int, *, seed: int = 0, source: str = "synth_open") -> list[dict[str, Any]]:
    """``n`` distinct open questions "What is a plus b?" with gold ``answers`` = the number in
    digits and (below 100) in words."""
    rows = []
    for r in arithmetic_questions(n, seed=seed, source=source):
        value = int(r["options"][r["label"]])
        answers = [str(value)] + ([number_words(value)] if value < 100 else [])
        rows.append({"id": r["id"], "question": r["question"], "answers": answers})
    return rows


def open_category_questions(n: int, *, seed: int = 0, source: str = "synth_open_words") -> list[dict[str, Any]]:
    """``n`` distinct "Name a <category> other than <word>." questions; every other word of the
    category is a gold answer."""
    pairs = [(c, w) for c in sorted(CATEGORIES) for w in CATEGORIES[c]]
    if n > len(pairs):
        raise ValueError(f"open_category_questions: at most {len(pairs)} distinct questions, asked for {n}")
    rng = random.Random(f"{source}:{seed}")
    return [{"id": f"{i}", "question": f"Name a {c} other than {w}.",
             "answers": [x for x in CATEGORIES[c] if x != w]}
            for i, (c, w) in enumerate(rng.sample(pairs, n))]


def questions(kind: str, n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of one of `KINDS` (a clear error naming the kinds otherwise)."""
    makers = {"arithmetic": arithmetic_questions, "categories": category_questions,
              "open_arithmetic": open_arithmetic_questions, "open_categories": open_category_questions}
    if kind not in makers:
        raise ValueError(f"unknown synthetic question kind {kind!r}; one of {KINDS}")
    if n < 1:
        raise ValueError(f"synthetic {kind}: n must be at least 1, got {n}")
    return makers[kind](n, seed=seed)


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """The rows as one JSON object per line (what ``--data-files NAME=PATH`` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def corpus(seed: int = 0) -> list[str]:
    """Text of every kind of question with its answers: what the built-in tokenizer learns
    its merges from (`apps.calm_llm.synthetic.synthetic_tokenizer`)."""
    out = []
    for r in arithmetic_questions(300, seed=seed) + category_questions(300, seed=seed):
        out.append(r["question"] + " " + " ".join(r["options"]))
    out += [f"{number_words(k)} {k}" for k in range(100)]
    return out
