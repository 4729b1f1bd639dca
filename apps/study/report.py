"""``study.md``: a study summary (``summary.summarize``'s dictionary) as markdown tables."""

from __future__ import annotations

from typing import Any

from apps.study.dynamics import DYNAMICS_LAST, DYNAMICS_MEAN
from calibration import metrics as cal_metrics


def _dynamics_table(summary: dict[str, Any]) -> list[str]:
    present = {k for e in summary["rows"].values() for k in e.get("dynamics", {})}
    keys = [k for k in (*(f"mean_{x}" for x in DYNAMICS_MEAN), *(f"last_{x}" for x in DYNAMICS_LAST))
            if k in present]
    if not keys:
        return []
    lines = ["| variant / row | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for key, e in summary["rows"].items():
        d = e.get("dynamics")
        if d:
            lines.append(f"| {key} | " + " | ".join(f"{d[k]:.3g}" if k in d else "–" for k in keys) + " |")
    return lines


def _open_qa_table(summary: dict[str, Any], ds: str) -> list[str]:
    kinds = sorted({m.split("/", 1)[1] for e in summary["rows"].values()
                    for m in e["datasets"].get(ds, {}).get("mean", {}) if m.startswith("semantic_ece/")})
    kinds = [k for k in ("semantic", "split_half") if k in kinds] + \
        [k for k in kinds if k not in ("semantic", "split_half")]
    cols = [("accuracy", "accuracy"), ("accuracy, no question echo", "accuracy_no_echo"),
            ("EM", "exact_match"), ("token F1", "token_f1"), ("greedy accuracy", "greedy_accuracy"),
            *((f"Semantic-ECE ({k})", f"semantic_ece/{k}") for k in kinds if k == "semantic"),
            ("pooled 95% CI of Semantic-ECE (semantic)", "semantic_ece_pooled_ci"),
            *((f"Semantic-ECE ({k})", f"semantic_ece/{k}") for k in kinds if k != "semantic"),
            ("Brier", "brier"), ("AUROC", "auroc"), ("confidence", "mean_confidence"),
            ("clusters / question", "mean_clusters")]
    lines = ["| variant / row | seeds | " + " | ".join(c[0] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for key, e in summary["rows"].items():
        d = e["datasets"].get(ds)
        if d is not None:
            lines.append(f"| {key} | {len(e['seeds'])} | " + " | ".join(
                _pooled_cell(d, m) if m.endswith("_pooled_ci") else
                f"{d['mean'][m]:.3f} ± {d['std'][m]:.3f}" if m in d["mean"] else "–"
                for _, m in cols) + " |")
    return lines


def _mark(d: dict[str, Any], name: str) -> str:
    """† for a number carried from an earlier summary, ‡ when that summary resampled questions
    only (its interval lacks the seed term)."""
    if name in d.get("carried_questions_only", ()):
        return "‡"
    return "†" if name in d.get("carried", ()) else ""


def _pooled_cell(d: dict[str, Any], key: str) -> str:
    ci = d.get(key)
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]{_mark(d, key)}" if ci else "–"


def _metrics_table(summary: dict[str, Any], ds: str) -> list[str]:
    if any("semantic_ece" in e["datasets"].get(ds, {}).get("mean", {}) for e in summary["rows"].values()):
        return _open_qa_table(summary, ds)
    # the columns of calibration.metrics.SUMMARY (accuracy and conf-ECE first, with its pooled
    # interval after it), then the calibration split's
    rest = [m for m in cal_metrics.SUMMARY if m.name not in ("accuracy", "conf_ece")]
    cols = [("accuracy", "accuracy"), ("conf-ECE", "conf_ece"),
            ("pooled 95% CI", "conf_ece_pooled_ci"), *((m.label, m.name) for m in rest),
            ("calib NLL", "calib_nll"), ("calib conf-ECE", "calib_conf_ece")]
    lines = ["| variant / row | seeds | " + " | ".join(c[0] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for key, e in summary["rows"].items():
        d = e["datasets"].get(ds)
        if d is None:
            continue
        lines.append(f"| {key} | {len(e['seeds'])} | " + " | ".join(
            _pooled_cell(d, m) if m.endswith("_pooled_ci") else
            f"{d['mean'][m]:.3f} ± {d['std'][m]:.3f}" if m in d["mean"] else "–"
            for _, m in cols) + " |")
    return lines


def _paired_table(summary: dict[str, Any], ds: str) -> list[str]:
    bases = summary.get("baselines", [])
    if not bases:
        return []
    open_qa = any("semantic_ece" in e["datasets"].get(ds, {}).get("mean", {})
                  for e in summary["rows"].values())
    error, label = ("semantic_ece", "Semantic-ECE") if open_qa else ("conf_ece", "conf-ECE")
    names = [b.format(variant="VARIANT") for b in bases]  # "{variant}/sft": each variant's own
    head = "| variant / row | " + " | ".join(f"Δ {label} vs {b} | Δ accuracy vs {b}" for b in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(bases)]
    for key, e in summary["rows"].items():
        vs = e["datasets"].get(ds, {}).get("vs", {})
        cells = []
        for template in bases:
            b = template.format(variant=e["variant"])
            for m in (error, "accuracy"):
                v = vs.get(b, {}).get(m)
                mark = _mark(e["datasets"].get(ds, {}), f"vs {b}")
                cells.append("–" if v is None else
                             f"{v['diff']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}] "
                             f"p={v['p_not_better']:.2f}{mark}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


PAIRED_NOTE = ("Paired on the same questions (row minus baseline, 95% interval, p = share of "
               "resamples where the row is not better); exploratory, except the comparisons "
               "listed under \"Primary comparisons\":")
CARRIED_NOTE = ("† carried from the previous summary: the cell's predictions were not kept, its "
                "seeds (and the baseline's) are unchanged. ‡ carried likewise from a summary that "
                "resampled questions only, the seeds fixed: narrower than the intervals here by "
                "the seed term.")
PROCEDURE_NOTE = (
    "Intervals: hierarchical bootstrap (each resample draws the seeds with replacement, then "
    "the questions with replacement, one question draw scored under every drawn seed), 95 % "
    "percentile intervals; rows are paired through the same draws (the same questions, and the "
    "same seeds where both rows ran them).")


def _primary_table(summary: dict[str, Any]) -> list[str]:
    """The primary comparisons, one Holm family: Δ, interval, two-sided p, Holm-adjusted p."""
    primary = summary.get("primary", [])
    if not primary:
        return []
    lines = ["## Primary comparisons (one Holm family, family-wise error 5 %)", "",
             "Every other interval in this summary is exploratory: 95 % each, uncorrected for "
             "multiplicity.", "",
             "| claim | row − baseline | dataset | metric | Δ [95% CI] | p | p (Holm) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for e in primary:
        what = f"| {e['claim']} | {e['row']} − {e['baseline']} | {e['dataset']} | {e['metric']} |"
        if e.get("missing"):
            lines.append(what + " no predictions kept | – | – | – |")
            continue
        lines.append(what + f" {e['diff']:+.3f} [{e['ci'][0]:+.3f}, {e['ci'][1]:+.3f}] | "
                     f"{e['p']:.3f} | {e['p_holm']:.3f} | {e['verdict']} |")
    return [*lines, ""]


def _chance_table(summary: dict[str, Any]) -> list[str]:
    if not summary.get("chance_table"):
        return []
    lines = ["## Accuracy against chance", "",
             "z = (right − expected right under chance) / its standard deviation; chance = "
             "mean over questions of 1 / (number of options).", "",
             "| variant / row | dataset | domain | questions | accuracy | chance | z |",
             "|---|---|---|---|---|---|---|"]
    for key, e in summary["rows"].items():
        for ds, d in e["datasets"].items():
            c = d.get("vs_chance")
            if c:
                lines.append(f"| {key} | {ds} | {d['domain']} | {c['n']} | {c['accuracy']:.3f} | "
                             f"{c['chance']:.3f} | {c['z']:+.1f} |")
    return [*lines, ""]


def markdown(summary: dict[str, Any]) -> str:
    """Per dataset: mean ± std over seeds with the pooled 95 % interval of conf-ECE (open QA:
    Semantic-ECE), then each row minus each baseline on the same questions (95 % interval;
    p = share of resamples in which the row is not better); then the primary comparisons with
    their Holm-adjusted p-values."""
    lines = [f"# Study {summary['study']}", "", summary["description"], "", PROCEDURE_NOTE, ""]
    if summary.get("unfinished_cells"):  # begun, not finished: left out of every number below
        lines += [f"Left out, not finished: {', '.join(summary['unfinished_cells'])}.", ""]
    if summary.get("unchecked_cells"):
        lines += [f"Used without a check against saved predictions (none kept): "
                  f"{', '.join(summary['unchecked_cells'])}.", ""]
    datasets: dict[str, str] = {}
    for e in summary["rows"].values():
        for ds, d in e["datasets"].items():
            datasets.setdefault(ds, d["domain"])
    for ds, domain in datasets.items():
        lines += [f"## {ds} ({domain})", "", *_metrics_table(summary, ds), ""]
        paired = _paired_table(summary, ds)
        if paired:
            lines += [PAIRED_NOTE, "", *paired, ""]
    if any(d.get("carried") for e in summary["rows"].values() for d in e["datasets"].values()):
        lines += [CARRIED_NOTE, ""]
    lines += [*_primary_table(summary), *_chance_table(summary)]
    dyn = _dynamics_table(summary)
    if dyn:
        lines += ["## Training dynamics (mean over seeds)", "", *dyn, ""]
    lines += ["## Variants", ""]
    for name, v in summary["variants"].items():
        lines.append(f"- `{name}`: `--methods {' '.join(v['methods'])} {' '.join(v['args'])}` "
                     f"— {v['note']}")
    lines += ["", f"Every cell: `python -m apps.calm_llm {' '.join(summary['common'])} --seed K ...`", ""]
    return "\n".join(lines)
