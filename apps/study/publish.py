"""Publishing a study: the small files of every finished cell and the summary, copied into the
repository (``docs/results/<study>``), so that the summary can be recomputed from them."""

from __future__ import annotations

import lzma
from pathlib import Path

from apps.study.catalogue import Study
from apps.study.integrity import cross_check, read_results
from apps.study.runner import cells, done

# what a published cell keeps: its inputs, its numbers, its curves, and the option probabilities
# the pooled intervals and paired tests are computed from (~10 KB per cell; open-QA cells keep
# their answers instead, xz-compressed by publish); no checkpoints
PUBLISHED = ("config.json", "metrics.json", "results.md", "predictions.safetensors")


def publish(study: Study, root: Path, dest: Path) -> list[Path]:
    """Copy the small files of every finished cell, ``study.json``/``study.md`` and
    ``cells.jsonl`` from ``root`` to ``dest`` (e.g. ``docs/results/<study>``); returns the
    files written. A cell whose metrics.json disagrees with its predictions, or cannot be read,
    raises ``integrity.DamagedCell`` before it is copied."""
    import shutil

    from apps.calm_llm.open_qa.score import PREDICTIONS as OPEN_QA_RECORDS

    written = []
    for c in cells(study):
        src = root / c.name
        if not done(src, c):
            continue
        cross_check(src, read_results(src) or {})  # a damaged cell is named, never published
        names = [*PUBLISHED, *sorted(p.name for p in src.glob("history_*.jsonl"))]
        for name in names:
            if (src / name).is_file():
                (dest / c.name).mkdir(parents=True, exist_ok=True)
                written.append(Path(shutil.copy2(src / name, dest / c.name / name)))
        if (src / OPEN_QA_RECORDS).is_file():  # every sampled answer: ~1 MB a cell, ~0.2 MB as xz
            out = dest / c.name / f"{OPEN_QA_RECORDS}.xz"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(lzma.compress((src / OPEN_QA_RECORDS).read_bytes(), preset=9))
            written.append(out)
    for name in ("study.json", "study.md", "cells.jsonl"):
        if (root / name).is_file():
            dest.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy2(root / name, dest / name)))
    return written

