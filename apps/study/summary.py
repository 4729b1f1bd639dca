"""A study's summary: finished cells collected into ``study.json`` and ``study.md``.

Per variant and row: the mean ± standard deviation over seeds of each metric; the pooled 95 %
interval of the calibration error (conf-ECE, or Semantic-ECE in open QA) and each row minus its
baselines on the same questions, from the hierarchical bootstrap of ``apps.study.stats``
(seeds, then questions, paired through shared resamples; percentile intervals); and the
study's primary comparisons, decided as one Holm family. Every interval outside the primary
family is exploratory.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from apps.study.answers import answer_metrics
from apps.study.design import Comparison, Study
from apps.study.dynamics import dynamics
from apps.study.integrity import (
    RERUN,
    DamagedCell,
    cross_check,
    finished_in_log,
    read_results,
    reading,
)
from apps.study.questions import load as load_questions
from apps.study.report import markdown
from apps.study.runner import Cell, cells, done
from apps.study.stats import DatasetDraws, against_chance, decide, paired_difference
from calibration import metrics as cal_metrics
from calibration.stats import percentile_interval

CALIB = ("calib_nll", "calib_conf_ece", "calib_accuracy")
# open QA (metrics.json "task": "open_qa"): the modal answer's accuracy, the greedy answer's, and
# the semantic-cluster confidence's Semantic-ECE, Brier, AUROC, and the mean number of answer
# clusters per question (20 samples in 20 clusters: a confidence of 1/20 whatever the model
# knows); every confidence kind's Semantic-ECE is kept as "semantic_ece/<kind>"
OPEN_QA_METRICS = ("accuracy", "greedy_accuracy", "semantic_ece", "brier", "auroc",
                   "mean_confidence", "mean_clusters")
# how study.json's intervals were computed. A summary without it was made by the earlier
# bootstrap that resampled questions with the seeds fixed: numbers carried from it are marked.
PROCEDURE = "hierarchical bootstrap (seeds, then questions), paired, percentile; Holm on the primary family"


def _carry_forward(rows: dict[str, dict[str, Any]], previous: dict[str, Any]) -> None:
    """Keep the question-level numbers (pooled interval, paired differences) of an earlier
    ``study.json`` for the rows whose predictions are no longer on disk, when the rows (and the
    baseline they were paired with) still hold the same seeds; each is listed in ``carried``,
    and also in ``carried_questions_only`` when it was computed by the earlier bootstrap that
    resampled questions with the seeds fixed (too narrow by the seed term)."""
    procedure = previous.get("procedure")
    if procedure not in (None, PROCEDURE):  # made some other way we cannot label: carry nothing
        return
    questions_only = procedure is None
    old = previous.get("rows", {})
    for key, entry in rows.items():
        before = old.get(key)
        if before is None or before.get("seeds") != entry["seeds"]:
            continue
        for ds, d in entry["datasets"].items():
            b = before.get("datasets", {}).get(ds, {})
            narrow = set(b.get("carried_questions_only", ()))

            def carry(name: str, d: dict[str, Any] = d, narrow: set[str] = narrow) -> None:
                d.setdefault("carried", []).append(name)
                if questions_only or name in narrow:
                    d.setdefault("carried_questions_only", []).append(name)

            for ci in ("conf_ece_pooled_ci", "semantic_ece_pooled_ci"):
                if ci not in d and ci in b:
                    d[ci] = b[ci]
                    carry(ci)
            for base, value in b.get("vs", {}).items():
                same_base = old.get(base, {}).get("seeds") == rows.get(base, {}).get("seeds")
                if base not in d["vs"] and same_base:
                    d["vs"][base] = value
                    carry(f"vs {base}")


def _add_cell(rows: dict[str, dict[str, Any]], c: Cell, run_dir: Path) -> bool:
    """One finished cell's rows into ``rows``: each metric's per-seed value, the question-level
    predictions (option probabilities or open-QA answers, when kept) and the training dynamics,
    by ``variant/row`` and dataset. The metrics are first checked against the predictions
    (``integrity.cross_check``); returns whether there were predictions to check them with."""
    results = read_results(run_dir) or {}  # a finished cell: not None
    checked = cross_check(run_dir, results)
    with reading(run_dir):
        questions = load_questions(run_dir)
        answers = answer_metrics(run_dir)  # open QA: the modal answers scored beside --match
    for row, per_ds in results.items():
        key = f"{c.variant.name}/{row}"
        entry = rows.setdefault(key, {"variant": c.variant.name, "row": row, "seeds": [],
                                      "datasets": {}})
        entry["seeds"].append(c.seed)
        history = run_dir / f"history_{row}.jsonl"
        if history.is_file():  # averaged over seeds below
            entry.setdefault("_dynamics", []).append(dynamics(history))
        for ds, r in per_ds.items():
            d = entry["datasets"].setdefault(ds, {"domain": r["domain"], "values": {},
                                                  "_questions": []})
            base = results.get(row.split(":", 1)[0], {}).get(ds, {})
            # runs before the fix copied the α row's calibration numbers into :no_alpha
            copied = row.endswith(":no_alpha") and r.get("calib_nll") == base.get("calib_nll")
            # a run's headline metrics are calibration.metrics.SUMMARY's, read at each call (a
            # metric added there reaches the study summaries with no edit here)
            headline = (m.name for m in cal_metrics.SUMMARY)
            for m in dict.fromkeys((*headline, *OPEN_QA_METRICS, *(() if copied else CALIB))):
                if isinstance(r.get(m), (int, float)):
                    d["values"].setdefault(m, []).append(float(r[m]))
            for kind, conf in r.get("confidences", {}).items():  # open QA
                if "semantic_ece" in conf:
                    d["values"].setdefault(f"semantic_ece/{kind}", []).append(
                        float(conf["semantic_ece"]))
                if kind == "semantic" and "mean_confidence" in conf:
                    d["values"].setdefault("mean_confidence", []).append(
                        float(conf["mean_confidence"]))
            for m, v in answers.get((row, ds), {}).items():
                d["values"].setdefault(m, []).append(v)
            q = questions.get((row, ds))
            if q is not None:
                d["_questions"].append(q)
    return checked > 0


@contextlib.contextmanager
def _naming(what: str) -> Iterator[None]:
    """Re-raise a ValueError of the question-level numbers with the row and dataset it is about."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e


def _seed_statistics(rows: dict[str, dict[str, Any]], study: Study) -> None:
    """Mean and standard deviation over seeds of every metric, the first seed against chance
    (``chance_table``); a row whose seeds did not all keep predictions drops its questions."""
    for entry in rows.values():
        for d in entry["datasets"].values():
            if len(d["_questions"]) != len(entry["seeds"]):  # question-level numbers need every seed
                d["_questions"] = []
            d["mean"] = {m: float(np.mean(v)) for m, v in d["values"].items()}
            d["std"] = {m: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
                        for m, v in d["values"].items()}
            qs = d["_questions"]
            if qs and study.chance_table and qs[0].kind == "options":  # the first seed's prediction
                d["vs_chance"] = against_chance(qs[0].x, qs[0].y)


class _Pairs:
    """Every row's question-level numbers from one set of bootstrap draws per dataset."""

    def __init__(self, rows: dict[str, dict[str, Any]], n_boot: int) -> None:
        self.rows, self.n_boot = rows, n_boot
        self._draws: dict[tuple[str, int], DatasetDraws] = {}

    def _questions(self, key: str, ds: str) -> list[Any]:
        return self.rows.get(key, {}).get("datasets", {}).get(ds, {}).get("_questions", [])

    def draws(self, ds: str, n: int) -> DatasetDraws:
        if (ds, n) not in self._draws:
            self._draws[(ds, n)] = DatasetDraws(n, n_boot=self.n_boot)
        return self._draws[(ds, n)]

    def pooled(self, key: str, ds: str) -> list[float]:
        qs = self._questions(key, ds)
        with _naming(f"{key} on {ds}"):
            draws = self.draws(ds, qs[0].n)
            return list(percentile_interval(draws.values(key, qs, self.rows[key]["seeds"])["error"]))

    def paired(self, key: str, base: str, ds: str) -> dict[str, Any] | None:
        """``paired_difference`` of two rows on ``ds``, or None when either kept no predictions."""
        a, b = self._questions(key, ds), self._questions(base, ds)
        if not a or not b:
            return None
        with _naming(f"{key} against {base} on {ds}"):
            return paired_difference(a, b, draws=self.draws(ds, a[0].n), keys=(key, base),
                                     labels=(self.rows[key]["seeds"], self.rows[base]["seeds"]))

    def comparison(self, c: Comparison) -> dict[str, Any] | None:
        """The entry of one primary comparison's metric."""
        out = self.paired(c.row, c.baseline, c.dataset)
        if out is None:
            return None
        return out["accuracy" if c.metric == "accuracy" else next(k for k in out if k != "accuracy")]


def _question_statistics(rows: dict[str, dict[str, Any]], study: Study, pairs: _Pairs) -> None:
    """Each row's pooled interval and its paired differences against the study's baselines."""
    for key, entry in rows.items():
        for ds, d in entry["datasets"].items():
            qs = d["_questions"]
            if qs:
                d[f"{qs[0].error_name}_pooled_ci"] = pairs.pooled(key, ds)
            d["vs"] = {}
            for template in study.baselines:
                base = template.format(variant=entry["variant"])
                if base != key:
                    v = pairs.paired(key, base, ds)
                    if v is not None:
                        d["vs"][base] = v


def _fingerprints(study: Study, root: Path) -> dict[str, dict[str, str]]:
    """cell -> {split name: fingerprint} of every cell whose run directory has its splits.json
    (``data.splits.split_fingerprints``, checked against the question digests it lists)."""
    from apps.calm_llm.data.splits import split_fingerprints

    return {c.name: split_fingerprints(root / c.name) for c in cells(study)
            if (root / c.name / "splits.json").is_file()}


def summarize(study: Study, root: Path, *, n_boot: int = 1000) -> dict[str, Any]:
    """Collect finished cells into ``study.json`` and ``study.md`` under ``root``.

    Cells kept without their question-level predictions (``predictions.safetensors``, or an
    open-QA run's answers; published before they were kept) contribute their metrics; their
    pooled intervals and paired differences come from the ``study.json`` already in ``root``
    where its seeds match (marked ``carried``), else they are left out. Cost: per dataset, each
    row's metrics on ``n_boot`` resamples of its distinct drawn seeds (≈ S·n_boot·2 metric calls).
    """
    previous_file = root / "study.json"
    try:
        previous = json.loads(previous_file.read_text()) if previous_file.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCell(f"{previous_file} is unreadable ({e}); restore it (git checkout, for a "
                          f"published study) or delete it: the numbers it carries for cells "
                          f"published without predictions are then left out") from e
    rows: dict[str, dict[str, Any]] = {}
    unchecked, unfinished = [], []
    logged = finished_in_log(root)
    for c in cells(study):
        run_dir = root / c.name
        if done(run_dir, c):
            if not _add_cell(rows, c, run_dir):
                unchecked.append(c.name)
        elif c.name in logged:  # finished once: a file lost since, never a seed dropped silently
            raise DamagedCell(
                f"{run_dir / 'metrics.json'} is missing or lacks a row of {list(c.variant.methods)}, "
                f"but {root / 'cells.jsonl'} records cell {c.name} as finished; {RERUN}")
        elif run_dir.exists():
            unfinished.append(c.name)
    _seed_statistics(rows, study)
    pairs = _Pairs(rows, n_boot)
    _question_statistics(rows, study, pairs)
    primary = decide(study.primary, pairs.comparison)
    _carry_forward(rows, previous)
    for entry in rows.values():
        for d in entry["datasets"].values():
            del d["_questions"]
        per_seed = entry.pop("_dynamics", [])
        if per_seed:
            entry["dynamics"] = {k: float(np.mean([p[k] for p in per_seed])) for k in per_seed[0]}
    out = {"study": study.name, "description": study.description, "procedure": PROCEDURE,
           "n_boot": n_boot, "rows": rows, "primary": primary,
           "variants": {v.name: {"methods": list(v.methods), "args": list(v.args), "note": v.note}
                        for v in study.variants},
           "common": list(study.common), "baselines": list(study.baselines),
           "chance_table": study.chance_table,
           # which questions each cell used, as its run recorded them (splits.json: a cell kept
           # without it, a published one, has none), and the role of each kind of split
           # (apps.study.discipline)
           "roles": dict(study.roles), "split_fingerprints": _fingerprints(study, root),
           # cells whose metrics.json had no predictions to be checked against (published
           # before they were kept), and cells begun but not finished (left out)
           "unchecked_cells": unchecked, "unfinished_cells": unfinished}
    (root / "study.json").write_text(json.dumps(out, indent=1))
    (root / "study.md").write_text(markdown(out))
    return out
