"""Row mappers: one raw row of a named dataset (a mapping, offline or from the hub) to the
unified `MCQAExample` / `InstructionExample`, with the field checks that name the row.

Ids are stable across runs and machines: ``source:original_id`` where the data has one, else
``source:sha1(question + options)[:16]`` (`content_id`). A missing field, a label that is not
an index or letter, and ``options`` that is not a list of texts each raise `DataError`
naming the row. `data.sources` registers these mappers in `SOURCES`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...errors import DataError
from .prompts import LETTERS
from .schema import InstructionExample, MCQAExample

Row = Mapping[str, Any]


def content_id(source: str, question: str, options: Iterable[str]) -> str:
    """``source:`` + the first 16 hex digits of sha1 over the question and options."""
    h = hashlib.sha1("\x1f".join([question, *options]).encode("utf-8")).hexdigest()[:16]
    return f"{source}:{h}"


def _field(row: Row, key: str, where: str) -> Any:
    if key not in row or row[key] is None:
        raise DataError(f"{where}: missing required field {key!r} (has: {sorted(row)})")
    return row[key]


def _letter_index(key: Any, labels: list[str], where: str) -> int:
    key = str(key).strip()
    if key in labels:
        return labels.index(key)
    raise DataError(f"{where}: answer key {key!r} is not one of the option labels {labels}")


def parse_label(value: Any, n_options: int, where: str) -> int:
    """A 0-based int, an int-like string, or a letter ("A" = 0) -> 0-based index."""
    if isinstance(value, bool):
        raise DataError(f"{where}: label {value!r} is a bool, not an index or letter")
    if isinstance(value, int | float) and float(value).is_integer():
        idx = int(value)
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        idx = int(value.strip())
    elif isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS:
        idx = LETTERS.index(value.strip().upper())
    else:
        raise DataError(f"{where}: label {value!r} is neither a 0-based index nor a letter")
    if not 0 <= idx < n_options:
        raise DataError(f"{where}: label {value!r} is outside the {n_options} options")
    return idx



def short_repr(text: str, n: int = 60) -> str:
    """``repr(text)``, cut to ``n`` characters with an ellipsis: a long row quoted in an error."""
    return repr(text if len(text) <= n else text[: n - 1] + "…")


# ---- per-source row mappers (the same for offline and hub rows) ---------------------------
def map_mmlu(row: Row, where: str = "mmlu") -> MCQAExample:
    q = str(_field(row, "question", where))
    opts = tuple(str(o) for o in _field(row, "choices", where))
    label = parse_label(_field(row, "answer", where), len(opts), where)
    subject = str(row.get("subject") or "")
    return MCQAExample(content_id(f"mmlu:{subject}" if subject else "mmlu", q, opts), q, opts, label, "mmlu")


def map_medmcqa(row: Row, where: str = "medmcqa") -> MCQAExample:
    q = str(_field(row, "question", where))
    opts = tuple(str(_field(row, k, where)) for k in ("opa", "opb", "opc", "opd"))
    label = parse_label(_field(row, "cop", where), 4, where)
    rid = row.get("id")
    return MCQAExample(f"medmcqa:{rid}" if rid else content_id("medmcqa", q, opts), q, opts, label, "medmcqa")


def _map_labelled_choices(row: Row, source: str, question_key: str, where: str) -> MCQAExample:
    q = str(_field(row, question_key, where))
    choices = _field(row, "choices", where)
    texts = [str(t) for t in _field(choices, "text", where + ".choices")]
    labels = [str(x) for x in _field(choices, "label", where + ".choices")]
    label = _letter_index(_field(row, "answerKey", where), labels, where)
    rid = row.get("id")
    opts = tuple(texts)
    return MCQAExample(f"{source}:{rid}" if rid else content_id(source, q, opts), q, opts, label, source)


def map_arc(row: Row, source: str = "arc_challenge", where: str | None = None) -> MCQAExample:
    """ARC: ``answerKey`` is a letter or, in a few rows, a digit label ("1".."4")."""
    return _map_labelled_choices(row, source, "question", where or source)


def map_openbookqa(row: Row, where: str = "openbookqa") -> MCQAExample:
    return _map_labelled_choices(row, "openbookqa", "question_stem", where)


def map_commonsense_qa(row: Row, where: str = "commonsense_qa") -> MCQAExample:
    return _map_labelled_choices(row, "commonsense_qa", "question", where)


def map_sciq(row: Row, seed: int = 0, where: str = "sciq") -> MCQAExample:
    """SciQ stores the answer apart from three distractors; their order is a seeded shuffle
    keyed by the question's id, so it does not depend on row order and is stable per seed."""
    q = str(_field(row, "question", where))
    correct = str(_field(row, "correct_answer", where))
    distractors = [str(_field(row, f"distractor{i}", where)) for i in (1, 2, 3)]
    qid = content_id("sciq", q, [correct, *distractors])
    opts = [correct, *distractors]
    random.Random(f"{seed}:{qid}").shuffle(opts)
    return MCQAExample(qid, q, tuple(opts), opts.index(correct), "sciq")


def _option_list(raw: Any, where: str) -> tuple[str, ...]:
    """``options`` as texts: a list (or a JSON list in a string) of strings or numbers.

    A dict would iterate over its keys and an int over nothing: both are refused, as is an
    entry that is not text (None, a list, a dict, a bool)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'options' is a string but not a JSON list") from e
    if isinstance(raw, Mapping) or isinstance(raw, str) or not isinstance(raw, Sequence):
        raise DataError(
            f"{where}: field 'options' must be a list of option texts, got {type(raw).__name__} "
            f"{short_repr(str(raw))} (write e.g. \"options\": [\"Paris\", \"Rome\"], or columns A, B, ...)"
        )
    out = []
    for j, o in enumerate(raw):
        if isinstance(o, bool) or not isinstance(o, str | int | float):
            raise DataError(
                f"{where}: option {j + 1} of 'options' is {type(o).__name__} {short_repr(str(o))}, "
                "not a text; every option must be a string (or a number)"
            )
        out.append(str(o))
    return tuple(out)


def map_unified(row: Row, source: str, where: str) -> MCQAExample:
    """The unified file format: question, options (list, JSON list string, or A/B/... columns), label."""
    q = str(_field(row, "question", where))
    if "options" in row and row["options"] is not None:
        opts = _option_list(row["options"], where)
    else:
        cols = []
        for k, letter in enumerate(LETTERS):
            v = row.get(letter)
            if v is None or (isinstance(v, str) and v == ""):
                # the options end at the first empty column: one after it would be lost
                later = [x for x in LETTERS[k + 1 :] if row.get(x) not in (None, "")]
                if later:
                    raise DataError(
                        f"{where}: option column {letter} is empty but {later[0]} is not; the "
                        "options are the columns A, B, ... up to the first empty one"
                    )
                break
            cols.append(str(v))
        if not cols:
            raise DataError(
                f"{where}: missing required field 'options' (a list, or columns A, B, ...; has: {sorted(row)})"
            )
        opts = tuple(cols)
    label = parse_label(_field(row, "label", where), len(opts), where)
    rid = row.get("id")
    qid = f"{source}:{rid}" if rid not in (None, "") else content_id(source, q, opts)
    return MCQAExample(qid, q, opts, label, str(row.get("source") or source))


def map_alpaca(row: Row, source: str = "alpaca", where: str = "alpaca") -> InstructionExample:
    """Alpaca: ``instruction`` and ``output`` required, ``input`` optional (empty when absent)."""
    ins = str(_field(row, "instruction", where))
    out = str(_field(row, "output", where))
    inp = str(row.get("input") or "")
    rid = row.get("id")
    qid = f"{source}:{rid}" if rid not in (None, "") else content_id(source, ins, [inp, out])
    return InstructionExample(qid, ins, inp, out, source)
