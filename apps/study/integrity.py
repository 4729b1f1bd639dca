"""A study's cells read back whole or not at all: a summary never drops a seed silently.

A finished cell's ``metrics.json`` is what the study's means and standard deviations average,
and its question-level predictions are what the intervals resample; ``cross_check`` recomputes
the first from the second with the run's own metric functions (those of
``evaluate.dataset_metrics`` for multiple choice, less the smooth ECE the summary does not read;
``open_qa.score.dataset_metrics`` for open QA with ``n_boot=0``) and refuses any disagreement,
naming the cell, row, dataset, metric and both values. A file that cannot be read (cut
short, garbled, hand-edited into something else) raises
``DamagedCell`` with its path and what to do; so does a cell the study's log (``cells.jsonl``)
records as finished whose ``metrics.json`` is gone.

What can and cannot be checked:

- a full run directory (it has ``splits.json``) must hold the predictions of every row of its
  ``metrics.json``; a published copy (``docs/results/<study>``, no ``splits.json``) may lack
  them (cells published before predictions were kept), and then only its metrics are used, the
  question-level numbers being carried from its earlier summary (marked ``carried``);
- the calibration-split numbers (``calib_*``) are not checked: their predictions are not kept.

The tolerance is ``TOLERANCE`` (relative, and the same absolute): a run computes its metrics in
float64 from the float32 probabilities it saves, and JSON keeps every float64 digit, so a
recomputation agrees to the last bit on the same machine (every published entry does: 139
multiple-choice and 60 open-QA (row, dataset) entries); the tolerance only leaves room for
another BLAS's summation order.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

TOLERANCE = 1e-9
# the metrics.json numbers the summary averages that the saved predictions determine
OPTION_CHECKED = ("n", "accuracy", "conf_ece", "cw_ece", "brier", "nll", "mean_confidence")
OPEN_QA_CHECKED = ("n", "accuracy", "greedy_accuracy", "semantic_ece", "brier", "auroc",
                   "mean_clusters")
RERUN = ("delete the cell's folder and run the study again (python -m apps.study NAME: the cell "
         "is rerun), or restore the file from the published copy in docs/results/")
RESULTS_FIX = ("delete metrics.json and predictions.safetensors in that cell and run the study "
               "again: the cell resumes and evaluates every method again from its checkpoints")

OPEN_QA_FIX = ("delete metrics.json and open_qa_predictions.json in that cell and run the study "
               "again: the cell resumes and answers the questions again")


class DamagedCell(ValueError):
    """A study cell that cannot be read back, or whose files contradict each other; the message
    names the file and what to do."""


def read_results(run_dir: Path) -> dict[str, Any] | None:
    """``metrics.json``'s ``results`` (row -> dataset -> metrics), or None when the cell has no
    ``metrics.json`` yet (not started, or interrupted before its first result)."""
    f = run_dir / "metrics.json"
    if not f.is_file():
        return None
    try:
        payload = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCell(f"{f} is unreadable ({e}); {RESULTS_FIX}") from e
    results = payload.get("results") if isinstance(payload, dict) else None
    if not isinstance(results, dict) or not all(
            isinstance(per, dict) and all(isinstance(r, dict) for r in per.values())
            for per in results.values()):
        raise DamagedCell(f"{f} is not a run's metrics.json (no 'results' mapping rows to datasets "
                          f"to metrics); {RESULTS_FIX}")
    return results


def finished_in_log(root: Path) -> set[str]:
    """The cells whose last line in the study's ``cells.jsonl`` says they exited 0."""
    log = root / "cells.jsonl"
    if not log.is_file():
        return set()
    last: dict[str, int] = {}
    for i, line in enumerate(log.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            last[str(entry["cell"])] = int(entry["rc"])
        except (ValueError, KeyError, TypeError) as e:
            raise DamagedCell(f"{log} line {i} is not a cell record ({e}); delete that line (the "
                              f"cells' own folders say which are finished)") from e
    return {c for c, rc in last.items() if rc == 0}


@contextlib.contextmanager
def reading(run_dir: Path) -> Iterator[None]:
    """Re-raise a cell file that cannot be read as ``DamagedCell`` naming it: the config (its
    ``n_bins``), the predictions or the open-QA records (``CorruptFile`` already names them)."""
    from apps.calm_llm.io import CorruptFile

    try:
        yield
    except CorruptFile as e:
        raise DamagedCell(f"{e}") from e
    except json.JSONDecodeError as e:
        raise DamagedCell(f"{run_dir / 'config.json'} is unreadable ({e}); {RERUN}") from e
    except Exception as e:  # safetensors raises its own SafetensorError (not exported by name)
        if type(e).__name__ != "SafetensorError":
            raise
        raise DamagedCell(f"{run_dir / 'predictions.safetensors'} is unreadable ({e}); "
                          f"{RESULTS_FIX}") from e


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # e.g. AUROC when every answer is wrong
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return False
    return math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


def _recomputed(run_dir: Path, saved: tuple[Mapping[str, Any], Mapping[str, Any]], row: str,
                ds: str, r: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics of one (row, dataset) from the cell's saved predictions, by the run's own
    functions; {} when the cell keeps none (a published copy: see the module's notes).
    ``saved``: the cell's predictions (safetensors) and open-QA records, as read once."""
    tensors, records = saved
    full_run = (run_dir / "splits.json").is_file()
    domain, n_bins = r.get("domain", "id"), int(r.get("n_bins", 10))
    if "semantic_ece" in r:  # open QA
        from apps.calm_llm.open_qa import score

        if not records and not full_run:
            return {}
        recs = records.get(row, {}).get(ds)
        if recs is None:
            raise DamagedCell(f"{run_dir / 'metrics.json'} has {row} on {ds} but "
                              f"{run_dir / score.PREDICTIONS} holds no answers for it; {OPEN_QA_FIX}")
        out = score.dataset_metrics(recs, domain=domain, n_bins=n_bins, n_boot=0)
        return {**{k: out[k] for k in OPEN_QA_CHECKED}, **{
            f"confidences/{kind}/semantic_ece": c["semantic_ece"]
            for kind, c in out["confidences"].items() if "semantic_ece" in c},
            "confidences/semantic/mean_confidence": out["confidences"]["semantic"].get("mean_confidence")}
    f = run_dir / "predictions.safetensors"
    if not tensors:
        if full_run:
            raise DamagedCell(f"{f} is missing although {run_dir / 'metrics.json'} has results "
                              f"(a run writes both); {RESULTS_FIX}")
        return {}
    if f"{row}/{ds}/probs" not in tensors or f"{row}/{ds}/labels" not in tensors:
        raise DamagedCell(f"{f} holds no predictions of {row} on {ds} although "
                          f"{run_dir / 'metrics.json'} has its results; {RESULTS_FIX}")
    return _option_metrics(tensors[f"{row}/{ds}/probs"], tensors[f"{row}/{ds}/labels"], n_bins)


def _option_metrics(probs: Any, labels: Any, n_bins: int) -> dict[str, Any]:
    """``OPTION_CHECKED`` as ``evaluate.dataset_metrics`` computes them (float64, the absent
    option slots trimmed, the same metric functions), without the metrics the summary does not
    read: smooth ECE alone costs ~20x the rest (a kernel over every pair of questions)."""
    import torch

    from apps.calm_llm.evaluate import trim_absent_tail
    from calibration import metrics

    y = torch.as_tensor(labels).to("cpu", torch.int64)
    p = trim_absent_tail(torch.as_tensor(probs).to("cpu", torch.float64), y)
    return {"n": int(p.shape[0]), "accuracy": metrics.accuracy(p, y),
            "conf_ece": metrics.conf_ece(p, y, n_bins=n_bins), "cw_ece": metrics.cw_ece(p, y, n_bins=n_bins),
            "brier": metrics.brier(p, y), "nll": metrics.nll(p, y),
            "mean_confidence": metrics.mean_confidence(p)}


def _saved(r: Mapping[str, Any], key: str) -> Any:
    """A metric of a metrics.json entry by its ``_recomputed`` key (``confidences/<kind>/<m>``)."""
    for part in key.split("/"):
        if not isinstance(r, Mapping) or part not in r:
            return None
        r = r[part]
    return r


def cross_check(run_dir: Path, results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> int:
    """Refuse a cell whose ``metrics.json`` disagrees with its saved predictions; returns the
    number of (row, dataset) entries checked (0 for a published copy without predictions).

    Cost: one evaluation of every saved row's metrics without the bootstrap (N·K per row for
    multiple choice; every confidence kind over the records for open QA).
    """
    from apps.calm_llm.open_qa import score

    checked = 0
    tensors: dict[str, Any] = {}
    with reading(run_dir):
        f = run_dir / "predictions.safetensors"
        if f.is_file():
            from safetensors.torch import load_file

            tensors = load_file(str(f))
        records = score.read_records(run_dir)
        for row, per_ds in results.items():
            for ds, r in per_ds.items():
                again = _recomputed(run_dir, (tensors, records), row, ds, r)
                for key, value in again.items():
                    saved = _saved(r, key)
                    if not _same(saved, value):
                        raise DamagedCell(
                            f"{run_dir / 'metrics.json'}: {key} of {row} on {ds} is {saved!r} but "
                            f"its saved predictions give {value!r} (the file was edited, or belongs "
                            f"to another run); {OPEN_QA_FIX if 'semantic_ece' in r else RESULTS_FIX}")
                checked += bool(again)
    return checked
