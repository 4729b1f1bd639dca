"""Stage 1 of a run, for any task: claim the run directory and check a resume.

A new run never writes over another's results (`make_run_dir`), but takes over a folder whose
run failed before training (`NOT_STARTED`); a resume is refused when its
options (`check_resume_config`) or its data's splits (`check_resume_splits`) differ from the
run's record in a way that changes results. `claim_run_dir` does all of it, then records
``config.json`` and ``splits.json``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import RunRefused
from ...lock import locked
from .. import distributed
from ..config import Config, differences
from ..data.splits import manifest_changes
from ..io import atomic_write_text, read_json
from ..logs import log

if TYPE_CHECKING:
    from ..tasks.base import Task

# what a run directory holds once a run has started in it (a new run never writes over these)
RUN_FILES = ("config.json", "splits.json", "metrics.json", "predictions.safetensors",
             "checkpoints", "export")
# written with config.json by a new run and removed when its first method starts training (a
# method that does not train writes metrics.json first): a folder that holds it and no results
# is a run that failed before training (model load, say), which a rerun into it takes over
NOT_STARTED = ".not-started"
# what such a run leaves, all of it rewritten by the run that takes the folder over
BEFORE_TRAINING = {"config.json", "splits.json"}


@contextlib.contextmanager
def run_lock(cfg: Config) -> Iterator[None]:
    """Hold the exclusive lock of the run directory that ``--out`` or ``--resume`` names for
    the whole run (`apps.lock`): a second run or resume into it is refused at once, naming the
    holder's pid and start time, instead of mixing its files with this one's; a lock left by a
    killed run is taken over. Taken before the folder is inspected, so a rerun cannot take over
    a folder whose run is still loading its model. Rank 0 holds it for every rank
    (``RANK``: the other ranks of one run write under rank 0's claim); a fresh
    ``runs/<timestamp>`` needs none (its exclusive mkdir is the claim), and a ``--resume`` of
    a folder that does not exist is refused by `claim_run_dir`, not created here."""
    folder = cfg.resume or cfg.out
    if not folder or os.environ.get("RANK", "0") != "0" or (cfg.resume and not Path(folder).is_dir()):
        yield
        return
    with locked(folder, what="run directory") as held:
        if held.stale:
            log(f"{folder}: took over the lock of a run that was killed (pid "
                f"{held.stale.get('pid')})")
        yield


def make_run_dir(cfg: Config, dist: distributed.Dist | None = None) -> Path:
    """The run's folder: ``--resume DIR``, ``--out DIR`` when it holds no other run, or a fresh
    ``runs/<timestamp>`` claimed with an exclusive mkdir (a ``-2``, ``-3``... suffix when two
    runs start in the same second), so two runs never share a folder."""
    if cfg.resume:
        return Path(cfg.resume)
    if cfg.out:
        out = Path(cfg.out)
        held = [f for f in RUN_FILES if (out / f).exists()]
        if held and set(held) <= BEFORE_TRAINING and (out / NOT_STARTED).is_file():
            log(f"--out {out}: the run there failed before training (nothing trained or "
                "evaluated); this run takes the folder over", dist)
            return out
        if held:
            raise RunRefused(
                f"--out {out} already holds a run ({', '.join(held)}); a new run does not write "
                f"over another's results: continue that one with --resume {out}, or give a new --out"
            )
        return out
    name = None
    if dist is None or dist.main:
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
        while True:
            cand = Path("runs") / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                cand.mkdir(parents=True, exist_ok=False)
                name = str(cand)
                break
            except FileExistsError:
                n += 1
    if dist is not None and dist.world > 1:  # every rank writes under rank 0's claim
        import torch.distributed as tdist

        box = [name]
        tdist.broadcast_object_list(box, src=0)
        name = box[0]
    return Path(name)


def check_resume_config(cfg: Config, run_dir: Path) -> None:
    """Refuse a resume whose options differ from the run's config.json in a way that changes
    results, naming each such option with both values."""
    from ..config import ConfigError, from_dict

    fix = "Restore it from a copy, or start a new run with --out."
    try:
        saved = from_dict(read_json(run_dir / "config.json", fix))
    except ConfigError as e:
        raise RunRefused(f"{run_dir / 'config.json'}: {e}") from e
    if cfg.out and cfg.out != saved.out and Path(cfg.out).resolve() != run_dir.resolve():
        raise RunRefused(
            f"--resume {run_dir} --out {cfg.out}: a resumed run continues in its own folder "
            f"({run_dir}) and its config.json is never rewritten; drop --out, or start a new run "
            f"with --out {cfg.out} alone"
        )
    diff = differences(saved, cfg)
    if diff:
        raise RunRefused(
            f"--resume {run_dir}: options differ from that run's config.json in a way that changes "
            f"results: {'; '.join(diff)}. Resume with the run's values (output, checkpoint and "
            "evaluation options --n-bins/--n-boot may change), or start a new run with --out"
        )


def check_resume_splits(cfg: Config, run_dir: Path, manifest: dict[str, Any], d: distributed.Dist) -> None:
    """Refuse a resume whose data give other splits than the run's splits.json (the methods
    evaluated before would be scored on other questions or labels than those evaluated after),
    unless ``--force-resume``; then the old record is kept as ``splits.before-resume.json``."""
    path = run_dir / "splits.json"
    if not path.is_file():  # killed before the splits were recorded: nothing was evaluated
        return
    saved = read_json(path, "Delete it to record the current data's splits, but only if the "
                            "data files are still those the run started with.")
    changes = manifest_changes(saved, manifest)
    if not changes:
        return
    msg = (f"--resume {run_dir}: the data no longer give the splits recorded in {path}: "
           f"{'; '.join(changes)}")
    if not cfg.force_resume:
        raise RunRefused(f"{msg}. Restore the data files the run started with, or pass "
                         "--force-resume to continue on the new data (the methods evaluated "
                         "before and after would then mix the two)")
    log(f"warning: {msg}; continuing (--force-resume), the old record kept as "
        "splits.before-resume.json", d)
    if d.main:
        os.replace(path, run_dir / "splits.before-resume.json")


def claim_run_dir(cfg: Config, dist: distributed.Dist, task: Task) -> tuple[Path, Any]:
    """The run directory and the task's splits (``task.load_splits(cfg)``), after the resume
    checks (the same options, the same splits), with config.json and splits.json recorded."""
    run_dir = make_run_dir(cfg, dist)
    dist.barrier()  # every rank has checked the folder before rank 0 writes into it
    if cfg.resume and not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no config.json there (not a run directory)")
    if cfg.resume:
        check_resume_config(cfg, run_dir)
    # the data are read and checked against the run's record before anything is written
    splits = task.load_splits(cfg)
    manifest = splits.manifest()
    if cfg.resume:
        check_resume_splits(cfg, run_dir, manifest, dist)
    if dist.main:
        record_run(cfg, run_dir, manifest)
    log(f"run directory: {run_dir}", dist)
    return run_dir, splits


def record_run(cfg: Config, run_dir: Path, manifest: dict[str, Any]) -> None:
    """Write config.json and splits.json of a new run, marked `NOT_STARTED` until
    `mark_started`. A resume never rewrites config.json (it is the run's record: ``--out``, a
    changed --n-bins or --n-boot would otherwise replace what the run was started with), and
    rewrites splits.json only when it is missing (killed before it) or was moved aside by
    --force-resume."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.resume:
        atomic_write_text(run_dir / NOT_STARTED, "")
        cfg.save(run_dir)
    if not cfg.resume or not (run_dir / "splits.json").is_file():  # a takeover rewrites it
        atomic_write_text(run_dir / "splits.json", json.dumps(manifest, indent=1))


def mark_started(run_dir: Path, dist: distributed.Dist) -> None:
    """Training has started: from now on the folder is a run (a rerun needs --resume)."""
    if dist.main:
        (run_dir / NOT_STARTED).unlink(missing_ok=True)


def base_method(row: str) -> str:
    """The method a results row belongs to: ``calm@eta=0.1:no_alpha`` -> ``calm``."""
    return row.split("@", 1)[0].split(":", 1)[0]


# a results file cut short (full disk, kill) is recomputed from the checkpoints, not guessed at
RESULTS_FIX = ("Delete metrics.json and predictions.safetensors in that folder and resume again: "
               "every method is evaluated again (from its final checkpoint where it has one)")


def refuse_changed(saved: dict[str, Any], now: dict[str, Any], where: str, source: str) -> None:
    """Raise `RunRefused` naming the first number of ``now`` (recomputed from ``source``) that
    its kept value in ``saved`` does not equal; nested dicts (open QA's confidence kinds) are
    compared too, the bootstrap's own settings are not. Relative tolerance 1e-9: the
    recomputation repeats the original one, up to summation order."""
    for key, value in now.items():
        old = saved.get(key)
        if key == "n_boot":  # recomputed without the bootstrap
            continue
        if isinstance(value, dict) and isinstance(old, dict):
            refuse_changed(old, value, f"{where} {key}", source)
            continue
        if not isinstance(value, int | float) or not isinstance(old, int | float):
            continue
        if not (math.isclose(old, value, rel_tol=1e-9, abs_tol=1e-12)
                or (math.isnan(old) and math.isnan(value))):
            raise RunRefused(
                f"{where} {key} is {old!r} there, but {source} give {value!r}; the file was "
                f"edited, or the two files come from different runs. {RESULTS_FIX}")
