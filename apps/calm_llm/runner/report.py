"""Stage 5 of a run, for any task: what a run has produced so far and when it is written
(the task's ``write_results``: ``metrics.json``, ``results.md``, the per-question outputs) and
which rows a resume keeps; the end of a row (its export and its one-line summary); the final
table (the task's ``render_table``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import distributed, export
from ..config import Config
from ..io import read_json
from ..logs import log
from ..methods.base import Context, Method
from .prepare import RESULTS_FIX, base_method

if TYPE_CHECKING:
    from ..tasks.base import Task


@dataclass
class RunState:
    """What the stages of one run share. ``results`` (row → dataset → metrics) and ``outputs``
    (row → dataset → what the metrics are computed from: ``(probs, labels)`` for multiple
    choice, the question records for open QA) grow as rows finish; ``extra`` is metrics.json's
    run-level record (hash, split fingerprints, zero-shot, selection). ``task`` is the run's
    `tasks.base.Task`: what writes the files and renders the table."""

    cfg: Config
    dist: distributed.Dist
    run_dir: Path
    config_hash: str
    task: Task
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        """metrics.json, results.md, the outputs and the reliability PNGs of every row so far."""
        if self.dist.main:
            self.task.write_results(self.run_dir, self.results, self.outputs,
                                    n_bins=self.cfg.n_bins, extra=self.extra)


# -- resume: the rows already evaluated ----------------------------------------------------------
def restore_rows(state: RunState, read_outputs: Callable[[Path], dict[str, Any]]) -> dict[str, Any] | None:
    """On resume, keep the rows of ``metrics.json`` that belong to a method still asked for
    (rows derived from a method, ``calm@eta=0.1`` or ``calm:no_alpha``, are kept with it) and
    whose outputs ``read_outputs(run_dir)`` holds. Returns the saved ``metrics.json`` (None when
    this is not a resume of a run with results); the caller checks what was kept."""
    path = state.run_dir / "metrics.json"
    if not (state.cfg.resume and path.is_file()):
        return None
    saved = read_json(path, RESULTS_FIX)
    outputs = read_outputs(state.run_dir)
    for row, per_ds in saved.get("results", {}).items():
        if base_method(row) in state.cfg.methods and row in outputs:
            state.results[row], state.outputs[row] = per_ds, outputs[row]
            log(f"[{row}] already evaluated in {state.run_dir}; kept", state.dist)
    return saved


# -- the end of a row and of the run -------------------------------------------------------------
def finish_row(state: RunState, ctx: Context, method: Method, row: str, t0: float) -> None:
    """Export the row (every method but `none`; ``ts`` exports its T), log its accuracy and
    calibration error (the task's ``ece_name``) per dataset, and wait for every rank."""
    if state.dist.main:
        export.export_method(state.run_dir / "export" / row, ctx.lm, method, run_dir=state.run_dir)
    ece, label = state.task.info.ece_name, state.task.info.ece_label
    accs = ", ".join(f"{ds} acc {r['accuracy']:.3f} {label} {r[ece]:.3f}"
                     for ds, r in state.results[row].items())
    log(f"[{row}] done in {time.time() - t0:.0f}s: {accs}", state.dist)
    state.dist.barrier()


def finish_run(state: RunState) -> dict[str, Any]:
    """Print the task's table of every row; the run's return value
    ``{"results", "run_dir", "table"}``."""
    table = state.task.render_table(state.results)
    if state.dist.main:
        print(table, flush=True)
    return {"results": state.results, "run_dir": str(state.run_dir), "table": table}
