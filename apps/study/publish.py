"""Publishing a study: the small files of every finished cell and the summary, copied into the
repository (``docs/results/<study>``), so that the summary can be recomputed from them."""

from __future__ import annotations

import lzma
from pathlib import Path

from apps.study.design import Study
from apps.study.integrity import cross_check, read_results
from apps.study.runner import cells, done

# what a published cell keeps: its inputs, its numbers, its curves, and the option probabilities
# the pooled intervals and paired tests are computed from (~10 KB per cell; open-QA cells keep
# their answers instead, xz-compressed by publish); no checkpoints
PUBLISHED = ("config.json", "metrics.json", "results.md", "predictions.safetensors")


def publish_cell(root: Path, dest: Path, name: str) -> list[Path]:
    """Copy one finished cell ``root/name`` into ``dest/name`` (its small files, its open-QA
    answers xz-compressed); returns the files written. A cell whose metrics.json disagrees with
    its predictions, or cannot be read, raises ``integrity.DamagedCell`` before it is copied."""
    import shutil

    from apps.calm_llm.open_qa.score import PREDICTIONS as OPEN_QA_RECORDS

    src = root / name
    cross_check(src, read_results(src) or {})  # a damaged cell is named, never published
    written = []
    for file in [*PUBLISHED, *sorted(p.name for p in src.glob("history_*.jsonl"))]:
        if (src / file).is_file():
            (dest / name).mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy2(src / file, dest / name / file)))
    if (src / OPEN_QA_RECORDS).is_file():  # every sampled answer: ~1 MB a cell, ~0.2 MB as xz
        out = dest / name / f"{OPEN_QA_RECORDS}.xz"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(lzma.compress((src / OPEN_QA_RECORDS).read_bytes(), preset=9))
        written.append(out)
    return written


def publish(study: Study, root: Path, dest: Path) -> list[Path]:
    """Copy the small files of every finished cell, ``study.json``/``study.md`` and
    ``cells.jsonl`` from ``root`` to ``dest`` (e.g. ``docs/results/<study>``); returns the
    files written (``publish_cell`` per cell)."""
    import shutil

    written = []
    for c in cells(study):
        if done(root / c.name, c):
            written += publish_cell(root, dest, c.name)
    for name in ("study.json", "study.md", "cells.jsonl"):
        if (root / name).is_file():
            dest.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy2(root / name, dest / name)))
    return written


def restore(study: Study, published: Path, root: Path) -> list[str]:
    """Seed the study root with the finished cells of a published folder, so that a study run
    on a fresh machine (whose ``runs/`` is empty) resumes after the cells already published
    instead of recomputing them; returns the names of the cells restored. A cell already under
    ``root`` is never overwritten, and a published cell is cross-checked against its saved
    predictions first (``integrity.DamagedCell`` names a damaged one). Open-QA answers come
    back decompressed. The published ``cells.jsonl`` lines of the restored cells are appended
    to the root's, so the log still says which cells finished."""
    import shutil

    from apps.calm_llm.open_qa.score import PREDICTIONS as OPEN_QA_RECORDS

    restored = []
    for c in cells(study):
        src, dst = published / c.name, root / c.name
        if dst.exists() or not done(src, c):
            continue
        cross_check(src, read_results(src) or {})
        shutil.copytree(src, dst)
        if (dst / f"{OPEN_QA_RECORDS}.xz").is_file():
            xz = dst / f"{OPEN_QA_RECORDS}.xz"
            (dst / OPEN_QA_RECORDS).write_bytes(lzma.decompress(xz.read_bytes()))
            xz.unlink()
        restored.append(c.name)
    log = published / "cells.jsonl"
    if restored and log.is_file():
        import json

        lines = [line for line in log.read_text(encoding="utf-8").splitlines()
                 if line.strip() and json.loads(line).get("cell") in restored]
        root.mkdir(parents=True, exist_ok=True)
        with open(root / "cells.jsonl", "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
    return restored
