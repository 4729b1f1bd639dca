"""Do two runs give the same results? The check behind bench/results/refactor_check.md.

    python -m bench.same_results BEFORE AFTER          # two run folders, or two folders of them
    python -m bench.same_results --bench BEFORE.json AFTER.json   # two bench result files

Run folders (``python -m apps.calm_llm --out DIR``; a folder without ``metrics.json`` is
searched for run folders below it, matched by their relative path, e.g. a study's cells):

* ``metrics.json``: every number, nested (a key holding "seconds" is a timing and left out);
* ``predictions.safetensors``: every tensor, bit for bit (``torch.equal``), and max |Δ|;
* ``open_qa_predictions.json`` (open QA): the records, value for value (timings left out);
* ``history_*.jsonl``: every logged value but the step's seconds;
* ``splits.json``, ``results.md``: byte for byte.

Bench files (``bench.hypergrad`` / ``bench.scaling`` JSON): each record's ``rel_error`` (the
error against the dense float64 oracle) and ``rel_error_vs_f64_same_method`` where it has one,
records matched by their identifying fields.

Prints one markdown table (what, compared, differ, max |Δ|); exits 1 when anything differs.
Cost: reading both folders once.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

_ID_FIELDS = ("problem", "size", "method", "library", "solver", "T", "steps", "study", "note")


def numbers(x: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a JSON value by its path (``a/b/0``); keys with "seconds" left out."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() if "seconds" not in str(key)
                for k, v in numbers(val, f"{path}/{key}").items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in numbers(val, f"{path}/{i}").items()}
    return {path: x}


def _delta(a: Any, b: Any) -> float:
    """|a - b| for numbers (0 for equal NaNs), 0/inf for other values (equal or not)."""
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        if math.isnan(a) and math.isnan(b):
            return 0.0
        return abs(a - b) if a != b else 0.0
    return 0.0 if a == b else math.inf


def compare_leaves(a: dict[str, Any], b: dict[str, Any], what: str) -> dict[str, Any]:
    """One table row: how many leaves, how many differ (missing on one side counts), max |Δ|."""
    deltas = [_delta(a[k], b[k]) for k in a.keys() & b.keys()]
    differ = sum(d != 0 for d in deltas) + len(a.keys() ^ b.keys())
    return {"what": what, "compared": f"{len(a.keys() | b.keys())} values", "differ": differ,
            "max_abs": max(deltas, default=0.0)}


def compare_tensors(a: Path, b: Path, what: str) -> dict[str, Any]:
    """Every tensor of two safetensors files, bit for bit."""
    import torch
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    common = ta.keys() & tb.keys()
    differ = sum(not torch.equal(ta[k], tb[k]) for k in common) + len(ta.keys() ^ tb.keys())
    deltas = [float((ta[k].double() - tb[k].double()).abs().max()) if ta[k].numel() else 0.0
              for k in common if ta[k].shape == tb[k].shape]
    return {"what": what, "compared": f"{len(ta.keys() | tb.keys())} tensors", "differ": differ,
            "max_abs": max(deltas, default=0.0)}


def _jsonl(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare_run(a: Path, b: Path, label: str = "") -> list[dict[str, Any]]:
    """The table rows of two run folders (what either one lacks is a row that differs)."""
    rows = []
    for name, kind in [("metrics.json", "json"), ("predictions.safetensors", "tensors"),
                       ("open_qa_predictions.json", "json"), ("splits.json", "bytes"),
                       ("results.md", "bytes"),
                       *[(p.name, "jsonl") for p in sorted(a.glob("history_*.jsonl"))]]:
        fa, fb, what = a / name, b / name, f"{label}{name}"
        if not fa.is_file() and not fb.is_file():
            continue
        if not (fa.is_file() and fb.is_file()):
            rows.append({"what": what, "compared": "present on one side", "differ": 1,
                         "max_abs": math.inf})
        elif kind == "tensors":
            rows.append(compare_tensors(fa, fb, what))
        elif kind == "bytes":
            rows.append({"what": what, "compared": "byte for byte",
                         "differ": int(fa.read_bytes() != fb.read_bytes()), "max_abs": 0.0})
        else:
            read = json.loads if kind == "json" else None
            va = read(fa.read_text()) if read else _jsonl(fa)
            vb = read(fb.read_text()) if read else _jsonl(fb)
            rows.append(compare_leaves(numbers(va), numbers(vb), what))
    return rows


def compare_folders(a: Path, b: Path) -> list[dict[str, Any]]:
    """One run folder against another, or every run folder below ``a`` against its namesake
    below ``b``."""
    if (a / "metrics.json").is_file():
        return compare_run(a, b)
    rows = []
    for m in sorted(a.rglob("metrics.json")):
        rel = m.parent.relative_to(a)
        rows += compare_run(m.parent, b / rel, f"{rel}/")
    return rows


def compare_bench(a: Path, b: Path) -> list[dict[str, Any]]:
    """Each bench record's ``rel_error*`` numbers, matched by its identifying fields."""
    def keyed(path: Path) -> tuple[dict[str, Any], int]:
        records = json.loads(path.read_text())["records"]
        out = {"/".join([*(str(r.get(f)) for f in _ID_FIELDS), field]): v
               for r in records for field, v in r.items() if field.startswith("rel_error")}
        return out, len(records)

    (ka, n), (kb, _) = keyed(a), keyed(b)
    given = {k: v for k, v in ka.items() if v is not None}
    row = compare_leaves(given, {k: kb.get(k) for k in given}, f"{a.name} rel_error*")
    row["compared"] = f"{len(given)} numbers over {n} records"
    return [row]


def render(rows: list[dict[str, Any]]) -> str:
    """The markdown table."""
    lines = ["| what | compared | differ | max \\|Δ\\| |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['compared']} | {r['differ']} | {r['max_abs']:.3g} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--bench", action="store_true", help="compare two bench result JSON files")
    args = ap.parse_args(argv)
    for p in (args.before, args.after):
        if not p.exists():
            ap.error(f"{p} does not exist; give two run folders (or, with --bench, two JSON files)")
    rows = (compare_bench if args.bench else compare_folders)(args.before, args.after)
    if not rows:
        ap.error(f"no run folder (a metrics.json) under {args.before}; give run folders")
    print(render(rows))
    return int(any(r["differ"] for r in rows))


if __name__ == "__main__":
    sys.exit(main())
