"""``python -m apps.study NAME [--dry-run | --summarize | --publish DEST | --figures DEST]
[--restore PUBLISHED] [--publish-each DEST]``."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import apps.study as package
from apps.lock import LockedError, locked
from apps.study import figures
from apps.study.catalogue import STUDIES
from apps.study.design import Study
from apps.study.discipline import DisciplineError, check
from apps.study.integrity import DamagedCell
from apps.study.publish import publish, publish_cell, restore
from apps.study.runner import Cell, run
from apps.study.summary import summarize


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
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
    ap.add_argument("--restore", default="", metavar="PUBLISHED",
                    help="first copy the finished cells of a published folder (e.g. "
                         "docs/results/NAME) that the root lacks, so the study resumes after them")
    ap.add_argument("--publish-each", default="", metavar="DEST",
                    help="while running, publish each cell to DEST as soon as it finishes (and "
                         "the summary at the end), so a run cut off mid-study loses no finished cell")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="cells run at once, each on its own 1/N of the CPUs (OMP_NUM_THREADS and "
                         "core pinning set for it); default 1 leaves the environment as it is")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    ap = _parser()
    a = ap.parse_args(argv)
    study = STUDIES[a.name]
    root = Path(a.root or f"runs/study-{study.name}")
    if root.exists() and not root.is_dir():
        ap.error(f"--root {root}: a file is there, not a folder of cells; give a folder "
                 f"(default runs/study-{study.name})")
    if not 2 <= a.n_boot <= 1_000_000:  # an interval needs two resamples; more is only slower
        ap.error(f"--n-boot: between 2 and 1,000,000 resamples, got {a.n_boot:,}")
    reads_only = a.summarize or a.publish or a.figures
    if reads_only and not root.is_dir():
        print(f"python -m apps.study: no study at {root} (not a folder); run `python -m apps.study "
              f"{study.name}` first, or pass the folder of its cells with --root", file=sys.stderr)
        return 2
    if reads_only and (a.restore or a.publish_each):
        ap.error("--restore and --publish-each go with running the study, not with "
                 "--summarize, --publish or --figures")
    if a.jobs < 1:
        ap.error(f"--jobs: at least 1 cell at a time, got {a.jobs}")
    if a.restore and not Path(a.restore).is_dir():
        ap.error(f"--restore {a.restore}: no such folder of published cells")
    for dest in (a.publish, a.figures, a.publish_each):
        if dest and Path(dest).resolve() == root.resolve():
            print(f"python -m apps.study: the destination {dest} is the study root itself; name "
                  f"another folder (e.g. docs/results/{study.name})", file=sys.stderr)
            return 2
    try:
        if a.dry_run:  # reads only
            _check(study, root)
            return run(study, root, dry_run=True)
        # one process writes into a study root (and a publish destination) at a time: a second
        # study, summary or publish is refused naming the holder instead of mixing the files
        with contextlib.ExitStack() as held:
            held.enter_context(locked(root, what="study root"))
            for dest in (a.publish, a.figures, a.publish_each):
                if dest:
                    held.enter_context(locked(dest, what=f"destination of study {study.name}"))
            return _act(a, study, root)
    except (LockedError, DamagedCell, DisciplineError) as e:  # one line naming the folder or file and the fix
        print(f"python -m apps.study: {e}", file=sys.stderr)
        return 2


def _check(study: Study, root: Path) -> None:
    """The split discipline against the whole catalogue (``discipline.check``): a
    ``DisciplineError`` names both studies, the splits, the shared count and the fix."""
    n = check(study, root, STUDIES)
    print(f"study {study.name}: split roles {study.roles}; questions checked against {n} "
          f"(study, role) registries of the catalogue: no test question was used for development")


def _act(a: argparse.Namespace, study: Study, root: Path) -> int:
    """What the parsed command line asks of ``study`` under ``root``, with the locks held."""
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
    if a.restore:
        restored = restore(study, Path(a.restore), root)
        print(f"study {study.name}: {len(restored)} finished cells restored from {a.restore}"
              + (f" ({', '.join(restored)})" if restored else ""))
    _check(study, root)  # before any cell runs

    def publish_now(cell: Cell) -> None:
        written = publish_cell(root, Path(a.publish_each), cell.name)
        print(f"{cell.name}: {len(written)} files published to {a.publish_each}", flush=True)

    rc = run(study, root, after_cell=publish_now if a.publish_each else None, jobs=a.jobs)
    summarize(study, root, n_boot=a.n_boot)
    if a.publish_each:
        publish(study, root, Path(a.publish_each))  # the summary and the log beside the cells
    return rc

if __name__ == "__main__":
    raise SystemExit(main())
