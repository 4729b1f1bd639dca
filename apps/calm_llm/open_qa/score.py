"""Open QA: per-question records → confidences → metrics, tables and reliability diagrams.

A `QuestionRecord` keeps everything a method produced for one question (the n sampled answers,
their semantic clusters, the greedy answer with its token log-probabilities, the verbalized
reply), so every metric here is recomputed from saved records without a model
(``open_qa_predictions.json``; a resume with other --n-bins/--n-boot re-evaluates from them).

Each confidence kind pairs a confidence with the answer it is a confidence in:

==========================  ==================================================  ==============
kind                        confidence                                          answer judged
==========================  ==================================================  ==============
``semantic``                share of the largest cluster of the n samples       modal answer
``split_half``              modal cluster of one half, frequency in the other   modal answer
``sequence_probability``    exp(mean log p) of the greedy answer's tokens       greedy answer
``mean_token_probability``  mean p over the greedy answer's tokens              greedy answer
``min_token_probability``   min p over the greedy answer's tokens               greedy answer
``verbalized``              the model's stated 0-100 confidence / 100           greedy answer
==========================  ==================================================  ==============

Verbalized replies that do not parse are left out of that kind's metrics and counted
(``parse_failures``).
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from calibration import semantic

from ..tables import fmt, safe_name

NAN = "nan"  # a NaN in open QA's tables (an AUROC undefined on an all-correct set) stays visible

KINDS = ("semantic", "split_half", "sequence_probability", "mean_token_probability",
         "min_token_probability", "verbalized")
SAMPLED = ("semantic", "split_half")  # kinds judged on the modal answer of the samples


@dataclass
class QuestionRecord:
    """One question as one method answered it. ``cluster_ids[i]`` is the cluster of
    ``samples[i]``; ``greedy_logprobs`` the log-probabilities of the greedy answer's tokens
    (its end-of-answer token included)."""

    id: str
    question: str
    answers: list[str]
    samples: list[str]
    cluster_ids: list[int]
    modal_answer: str
    modal_correct: bool
    greedy: str
    greedy_logprobs: list[float]
    greedy_correct: bool
    verbalized_reply: str | None = None  # None: not asked (--no-verbalized)
    verbalized: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuestionRecord:
        return cls(**d)


def confidence_pairs(
    records: Sequence[QuestionRecord], kind: str, *, n_splits: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence (N',), correct (N',)) of one kind over the records that have it.

    split_half draws its splits with the seed 0 for every question, so it is a function of the
    cluster ids alone (reproducible from saved records)."""
    if kind not in KINDS:
        raise ValueError(f"unknown confidence kind {kind!r} (known: {KINDS})")
    conf: list[float] = []
    correct: list[bool] = []
    for r in records:
        if kind == "semantic":
            c = semantic.cluster_confidence(r.cluster_ids)
        elif kind == "split_half":
            c = semantic.split_half_confidence(r.cluster_ids, n_splits=n_splits, seed=0)
        elif kind == "verbalized":
            if r.verbalized is None:
                continue
            c = r.verbalized
        else:
            c = float(_baseline(kind)(torch.tensor(r.greedy_logprobs, dtype=torch.float64)))
        conf.append(float(c))
        correct.append(r.modal_correct if kind in SAMPLED else r.greedy_correct)
    return torch.tensor(conf, dtype=torch.float64), torch.tensor(correct, dtype=torch.bool)


def _baseline(kind: str) -> Any:
    return {"sequence_probability": semantic.sequence_probability,
            "mean_token_probability": semantic.mean_token_probability,
            "min_token_probability": semantic.min_token_probability}[kind]


def kind_metrics(conf: torch.Tensor, correct: torch.Tensor, *, n_bins: int, n_boot: int,
                 seed: int = 0) -> dict[str, Any]:
    """Semantic-ECE, accuracy, Brier, AUROC and mean confidence, plus a percentile bootstrap
    interval of Semantic-ECE over questions (``n_boot`` resamples; none when 0)."""
    if conf.numel() == 0:
        return {"n": 0}
    out: dict[str, Any] = {"n": int(conf.numel()),
                           **semantic.semantic_summary(conf, correct, n_bins=n_bins)}
    if n_boot:
        ci = semantic.bootstrap_binary(
            lambda c, y: semantic.semantic_ece(c, y, n_bins), conf, correct, n=n_boot, seed=seed)
        out["semantic_ece_ci"] = [float(ci.low), float(ci.high)]
    return out


def dataset_metrics(
    records: Sequence[QuestionRecord], *, domain: str, n_bins: int, n_boot: int, n_splits: int = 10
) -> dict[str, Any]:
    """The results entry of one (method, dataset): the headline numbers of the ``semantic``
    kind at the top level (as MCQA rows have accuracy/conf-ECE there) and every kind under
    ``"confidences"``."""
    by_kind = {}
    for kind in KINDS:
        conf, correct = confidence_pairs(records, kind, n_splits=n_splits)
        by_kind[kind] = kind_metrics(conf, correct, n_bins=n_bins, n_boot=n_boot)
    head = by_kind["semantic"]
    n = len(records)
    return {
        "domain": domain,
        "n": n,
        "accuracy": head.get("accuracy", float("nan")),
        "greedy_accuracy": float(sum(r.greedy_correct for r in records) / n) if n else float("nan"),
        "semantic_ece": head.get("semantic_ece", float("nan")),
        "semantic_ece_ci": head.get("semantic_ece_ci"),
        "brier": head.get("brier", float("nan")),
        "auroc": head.get("auroc", float("nan")),
        "mean_clusters": float(sum(len(set(r.cluster_ids)) for r in records) / n) if n else 0.0,
        "parse_failures": sum(r.verbalized_reply is not None and r.verbalized is None
                              for r in records),
        "confidences": by_kind,
        "n_bins": n_bins,
        "n_boot": n_boot,
    }


# -- tables --------------------------------------------------------------------------------------
def render_table(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """Markdown: one table of the headline (semantic-cluster) numbers per dataset, then one of
    Semantic-ECE per confidence kind."""
    datasets: list[str] = []
    for per_ds in results.values():
        datasets += [d for d in per_ds if d not in datasets]
    lines: list[str] = []
    for ds in datasets:
        rows = {m: r[ds] for m, r in results.items() if ds in r}
        domain = next(iter(rows.values()))["domain"]
        lines += [f"### {ds} ({'in-domain' if domain == 'id' else 'out-of-domain'}, "
                  f"n={next(iter(rows.values()))['n']})", "",
                  "| method | accuracy | Semantic-ECE [95% CI] | Brier | AUROC | greedy acc | "
                  "clusters/q |", "|---|---|---|---|---|---|---|"]
        for m, r in rows.items():
            ci = r.get("semantic_ece_ci")
            ci_s = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
            lines.append(f"| {m} | {fmt(r['accuracy'], nan=NAN)} | {fmt(r['semantic_ece'], nan=NAN)}{ci_s} | "
                         f"{fmt(r['brier'], nan=NAN)} | {fmt(r['auroc'], nan=NAN)} | {fmt(r['greedy_accuracy'], nan=NAN)} | "
                         f"{fmt(r['mean_clusters'], 1, nan=NAN)} |")
        lines += ["", "Semantic-ECE (AUROC) by confidence kind:", "",
                  "| method | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
        for m, r in rows.items():
            cells = []
            for kind in KINDS:
                k = r["confidences"][kind]
                cells.append("–" if not k.get("n") else
                             f"{fmt(k['semantic_ece'], nan=NAN)} ({fmt(k['auroc'], 2, nan=NAN)})")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        failures = {m: r["parse_failures"] for m, r in rows.items() if r["parse_failures"]}
        if failures:
            lines += ["", "Verbalized replies that did not parse (left out of that column): "
                      + ", ".join(f"{m} {k}/{rows[m]['n']}" for m, k in failures.items())]
        lines.append("")
    return "\n".join(lines)


# -- files ---------------------------------------------------------------------------------------
PREDICTIONS = "open_qa_predictions.json"


def write_results(
    run_dir: str | Path,
    results: Mapping[str, Mapping[str, Mapping[str, Any]]],
    records: Mapping[str, Mapping[str, Sequence[QuestionRecord]]],
    *,
    n_bins: int,
    extra: Mapping[str, Any] | None = None,
    plots: bool = True,
) -> None:
    """``metrics.json`` (``"task": "open_qa"``), ``results.md``, every record in
    ``open_qa_predictions.json`` and one reliability diagram per dataset
    (``reliability_<dataset>.png``, the semantic-cluster confidence of every method). Each file
    is written whole or not at all."""
    from ..io import atomic_write_text

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    payload = {"task": "open_qa", "results": results, **(extra or {})}
    atomic_write_text(run / "metrics.json", json.dumps(payload, indent=2) + "\n")
    title = ("# Results (open QA)\n\nAccuracy of the modal sampled answer, Semantic-ECE of the "
             f"semantic-cluster confidence with a 95% bootstrap interval ({n_bins} equal-width "
             "bins), Brier, AUROC; then Semantic-ECE of every confidence kind.\n\n")
    atomic_write_text(run / "results.md", title + render_table(results))
    saved = {m: {ds: [asdict(r) for r in recs] for ds, recs in per.items()}
             for m, per in records.items()}
    atomic_write_text(run / PREDICTIONS, json.dumps(saved, ensure_ascii=False) + "\n")
    if not plots:
        return
    from calibration import plots as cplots

    datasets: list[str] = []
    for per in records.values():
        datasets += [d for d in per if d not in datasets]
    for ds in datasets:
        curves = {m: confidence_pairs(per[ds], "semantic") for m, per in records.items() if ds in per}
        cplots.reliability_diagram(curves, run / f"reliability_{safe_name(ds)}.png",
                                   n_bins=n_bins, mode="binary", title=f"{ds}: semantic confidence")


def read_records(run_dir: str | Path) -> dict[str, dict[str, list[QuestionRecord]]]:
    """The saved records of a run directory (empty when there are none), from
    ``open_qa_predictions.json`` or the xz of it that ``apps.study --publish`` keeps."""
    from ..io import CorruptFile, read_json

    path = Path(run_dir) / PREDICTIONS
    packed = path.with_name(PREDICTIONS + ".xz")
    if path.is_file():
        data = read_json(path, "delete metrics.json and open_qa_predictions.json and resume again")
    elif packed.is_file():
        try:
            data = json.loads(lzma.decompress(packed.read_bytes()).decode("utf-8"))
        except (lzma.LZMAError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptFile(f"{packed} is unreadable ({e}); publish the study again") from e
    else:
        return {}
    return {m: {ds: [QuestionRecord.from_dict(r) for r in recs] for ds, recs in per.items()}
            for m, per in data.items()}
