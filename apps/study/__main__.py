"""``python -m apps.study NAME [--dry-run | --summarize | --publish DEST | --figures DEST]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import apps.study as package
from apps.study import figures
from apps.study.catalogue import STUDIES
from apps.study.publish import publish
from apps.study.runner import run
from apps.study.summary import summarize


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m apps.study",
                                 description=(package.__doc__ or "").split("\n\n")[0])
    ap.add_argument("name", choices=sorted(STUDIES))
    ap.add_argument("--root", default="", help="folder of the cells (default: runs/study-NAME)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells and estimated time")
    ap.add_argument("--summarize", action="store_true",
                    help="only write study.json/study.md from the finished cells")
    ap.add_argument("--n-boot", type=int, default=1000, help="resamples of the hierarchical bootstrap")
    ap.add_argument("--publish", default="", metavar="DEST",
                    help="copy the finished cells' small files and the summary to DEST "
                         "(e.g. docs/results/NAME) and exit")
    ap.add_argument("--figures", default="", metavar="DEST",
                    help="write the pooled reliability diagrams and training curves of the "
                         "finished cells to DEST (e.g. docs/img/NAME) and exit")
    a = ap.parse_args(argv)
    study = STUDIES[a.name]
    root = Path(a.root or f"runs/study-{study.name}")
    if a.figures:
        if not study.figure_rows:
            print(f"study {study.name} names no figure_rows: no reliability diagrams", file=sys.stderr)
        written = figures.reliability(study, root, Path(a.figures), study.figure_rows)
        try:
            written.append(figures.training_curves(study, root, Path(a.figures)))
        except ValueError as e:  # nothing trained, or no finished cell under root
            print(f"no training curves: {e}", file=sys.stderr)
        print("\n".join(str(p) for p in written))
        return 0 if written else 1
    if a.publish:
        written = publish(study, root, Path(a.publish))
        print(f"{len(written)} files copied to {a.publish}")
        return 0
    if a.summarize:
        summarize(study, root, n_boot=a.n_boot)
        print((root / "study.md").read_text())
        return 0
    rc = run(study, root, dry_run=a.dry_run)
    if not a.dry_run:
        summarize(study, root, n_boot=a.n_boot)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
