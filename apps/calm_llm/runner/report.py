"""Stage 5 of a run, shared by both tasks: what a run has produced so far and how it is
written (``metrics.json``, ``results.md``, the per-question outputs, reliability diagrams) and
read back on resume; the end of a row (its export and its one-line summary); the final table.

Multiple choice writes with `apps.calm_llm.evaluate.write_results` (option probabilities in
``predictions.safetensors``), open QA with `apps.calm_llm.open_qa.score.write_results` (one
record per question in ``open_qa_predictions.json``); everything else is the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import RunRefused
from .. import distributed, evaluate, export
from ..config import Config
from ..io import CorruptFile, read_json, read_tensors
from ..logs import log
from ..methods.base import Context, Method
from ..open_qa import score
from .prepare import RESULTS_FIX, base_method, check_kept_results, refuse_changed


@dataclass
class RunState:
    """What the stages of one run share. ``results`` (row → dataset → metrics) and ``outputs``
    (row → dataset → what the metrics are computed from: ``(probs, labels)`` for multiple
    choice, the question records for open QA) grow as rows finish; ``extra`` is metrics.json's
    run-level record (hash, split fingerprints, zero-shot, selection). ``writer`` is the task's
    ``write_results(run_dir, results, outputs, *, n_bins, extra)``."""

    cfg: Config
    dist: distributed.Dist
    run_dir: Path
    config_hash: str
    writer: Callable[..., Any] = evaluate.write_results
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        """metrics.json, results.md, the outputs and the reliability PNGs of every row so far."""
        if self.dist.main:
            self.writer(self.run_dir, self.results, self.outputs, n_bins=self.cfg.n_bins,
                        extra=self.extra)


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


def read_predictions(run_dir: Path) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """evaluate.write_results' predictions.safetensors: ``{method}/{dataset}/probs|labels``."""
    path = run_dir / "predictions.safetensors"
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    if not path.is_file():
        return out
    t = read_tensors(path, RESULTS_FIX)
    try:
        for key in t:
            method, ds, kind = key.split("/")
            if kind == "probs":
                out.setdefault(method, {})[ds] = (t[key], t[f"{method}/{ds}/labels"])
    except (ValueError, KeyError) as e:  # readable, but not what write_results writes
        raise CorruptFile(f"{path}: not a predictions file of this project (entry {e}). "
                          f"{RESULTS_FIX}") from e
    return out


def reevaluate(
    results: dict[str, dict[str, Any]],
    predictions: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]],
    *,
    n_bins: int,
    n_boot: int,
) -> bool:
    """Recompute, in place, the metrics of saved results whose --n-bins/--n-boot differ from the
    current ones, from their saved predictions (no model needed); True when any changed.
    Keys the metrics do not produce (a method's extras, e.g. TS's temperature) are kept."""
    changed = False
    for m, per_ds in results.items():
        for ds, r in per_ds.items():
            if r.get("n_bins") == n_bins and r.get("n_boot") == n_boot:
                continue
            probs, y = predictions[m][ds]
            per_ds[ds] = {**r, **evaluate.dataset_metrics(probs, y, domain=r["domain"],
                                                          n_bins=n_bins, n_boot=n_boot)}
            changed = True
    return changed


def restore_mc(state: RunState) -> None:
    """Multiple choice: keep the evaluated rows (a cut results file is named, not guessed at),
    with the zero-shot accuracies and ``--select`` choices, re-evaluated from their saved
    predictions if --n-bins/--n-boot changed."""
    cfg = state.cfg
    saved = restore_rows(state, read_predictions)
    if saved is None:
        return
    state.extra["zero_shot_accuracy"] = saved.get("zero_shot_accuracy", {})
    if "selection" in saved:
        state.extra["selection"] = saved["selection"]
    check_kept_results(state.run_dir, state.results, state.outputs)
    if reevaluate(state.results, state.outputs, n_bins=cfg.n_bins, n_boot=cfg.n_boot) \
            and state.dist.main:
        log(f"re-evaluated the kept methods with --n-bins {cfg.n_bins} --n-boot {cfg.n_boot}",
            state.dist)
        state.write()


def restore_open_qa(state: RunState) -> None:
    """Open QA: keep the evaluated rows, each number checked against what its saved answers
    give, re-evaluated from them if --n-bins/--n-boot changed."""
    cfg, path = state.cfg, state.run_dir / "metrics.json"
    if restore_rows(state, score.read_records) is None:
        return
    changed = False
    for row, per_ds in state.results.items():
        records = state.outputs[row]
        for ds, r in list(per_ds.items()):
            if ds not in records:
                raise RunRefused(f"{path}: row {row!r} has {ds} but the run's saved answers hold "
                                 f"none for it. {RESULTS_FIX}")
            # an edited value (or another run's metrics.json) is refused, not carried on
            refuse_changed(r, score.dataset_metrics(
                records[ds], domain=r["domain"], n_bins=r.get("n_bins", cfg.n_bins),
                n_boot=0, n_splits=cfg.open_qa.split_half_splits),
                f"{path}: {row} on {ds}:", "the saved answers")
            if r.get("n_bins") != cfg.n_bins or r.get("n_boot") != cfg.n_boot:
                per_ds[ds] = {**r, **score.dataset_metrics(records[ds], domain=r["domain"],
                                                           n_bins=cfg.n_bins, n_boot=cfg.n_boot,
                                                           n_splits=cfg.open_qa.split_half_splits)}
                changed = True
    if changed:
        state.write()


# -- the end of a row and of the run -------------------------------------------------------------
def finish_row(state: RunState, ctx: Context, method: Method, row: str, t0: float,
               ece: str = "conf_ece") -> None:
    """Export the row (every method but `none`; ``ts`` exports its T), log its accuracy and
    calibration error (``ece``: the results key) per dataset, and wait for every rank."""
    if state.dist.main:
        export.export_method(state.run_dir / "export" / row, ctx.lm, method, run_dir=state.run_dir)
    label = {"conf_ece": "ece", "semantic_ece": "sem-ECE"}.get(ece, ece)
    accs = ", ".join(f"{ds} acc {r['accuracy']:.3f} {label} {r[ece]:.3f}"
                     for ds, r in state.results[row].items())
    log(f"[{row}] done in {time.time() - t0:.0f}s: {accs}", state.dist)
    state.dist.barrier()


def finish_run(state: RunState, render: Callable[[dict[str, dict[str, Any]]], str]) -> dict[str, Any]:
    """Print the task's table of every row; the run's return value
    ``{"results", "run_dir", "table"}``."""
    table = render(state.results)
    if state.dist.main:
        print(table, flush=True)
    return {"results": state.results, "run_dir": str(state.run_dir), "table": table}
