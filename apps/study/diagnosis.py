"""The ``calm-diagnosis`` study's decision rule, applied once to its finished cells.

    python -m apps.study.diagnosis [--root docs/results/calm-diagnosis] [--n-boot 1000]

writes ``verdict.json`` and ``verdict.md`` into the root. The rule was fixed before any cell
ran (docs/results.md, "Why CALM loses"); this module is that rule, word for word, and the
numbers each clause reads:

- a *difference* is row A minus row B on ARC-Easy conf-ECE, paired within each split seed (the
  same questions, the same training-seed draws) and pooled over the split seeds: with split
  seeds s = 1..S, Δ = (1/S) Σ_s Δ_s, where Δ_s is the mean over training seeds of
  ECE(A) − ECE(B) on split s's questions. Its 95 % interval is the percentile interval of the
  same average over independent hierarchical bootstraps of the splits (training seeds, then
  questions: ``apps.study.stats.DatasetDraws``, one per split). A split enters only where both
  rows have cells, with the training seeds both have.
- A *beats* B when the interval of A − B lies below 0; A is *within 0.02* of B when the point
  difference A − B is at most 0.02 (the rule names no interval for it; the interval is shown).
- the *calibration-minus-test accuracy gap* of a row is its accuracy on the calibration split
  (``--eval-calib``) minus its accuracy on the in-domain SciQ test split, the same distribution,
  averaged over the row's cells.

Outcomes: (c) scale or setting, (b) this implementation's per-token α, (a) the method's
formulation, or undecided, in that order of precedence (each later one requires "not" the
earlier ones, as declared); then whether any CALM variant earned a confirmatory test.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from apps.study.questions import Questions, aligned, load
from apps.study.stats import DatasetDraws
from calibration.stats import percentile_interval

OOD, IN_DOMAIN = "arc_easy", "sciq"
WITHIN = 0.02  # "within 0.02 of its TS"
GAP_SHARE = 0.5  # calib400's gap "at most half of calm's"
# each variant's CALM row: the row the rule means by "<variant>'s CALM"
CALM_ROW = {"calm": "calm", "calib400": "calm", "option_temperature": "calm",
            "vocab_temperature": "calm_scalar", "value_gap": "calm"}
CELL = re.compile(r"^(?P<variant>.+)_split(?P<split>\d+)-seed(?P<seed>\d+)$")


@dataclass
class CellData:
    """What the rule reads of one finished cell."""

    results: dict[str, dict[str, dict[str, Any]]]  # metrics.json's results: row -> dataset -> metrics
    questions: dict[tuple[str, str], Questions]  # (row, dataset) -> predictions
    last: dict[str, dict[str, float]] = field(default_factory=dict)  # method -> last history line
    lam: dict[str, list[float]] = field(default_factory=dict)  # method -> λ per step


Cells = dict[tuple[str, int, int], CellData]  # (variant, split seed, training seed)


def load_cells(root: Path) -> Cells:
    """Every finished cell under ``root`` (a ``metrics.json`` and its predictions)."""
    cells: Cells = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        m = CELL.match(d.name)
        if m is None or not (d / "metrics.json").is_file():
            continue
        data = CellData(json.loads((d / "metrics.json").read_text())["results"], load(d))
        for h in d.glob("history_*.jsonl"):
            lines = [json.loads(x) for x in h.read_text().splitlines() if x.strip()]
            method = h.stem.removeprefix("history_")
            if lines and method != "sft":
                data.last[method] = lines[-1]
                data.lam[method] = [float(x["lambda"]) for x in lines if "lambda" in x]
        cells[(m["variant"], int(m["split"]), int(m["seed"]))] = data
    return cells


def add_sft_ts(cells: Cells) -> None:
    """An exploratory row ``sft+ts`` in every cell: SFT's option probabilities at the one
    temperature T fitted by NLL on SFT's own SciQ test predictions (``shift.optimal_temperature``,
    applied by ``shift.scaled``, as the shift screens do), on both sets. Post-hoc TS on the
    trained model, which the study has no row for; fitted on SciQ test because the cells keep
    no calibration-split probabilities (SciQ test is development data here, and the row is not
    part of the declared rule)."""
    import torch

    from apps.study.shift import optimal_temperature, scaled

    for c in cells.values():
        if ("sft", IN_DOMAIN) not in c.questions:
            continue
        sciq = c.questions[("sft", IN_DOMAIN)]
        t = optimal_temperature(torch.from_numpy(sciq.x), torch.from_numpy(sciq.y).long())
        for ds in (OOD, IN_DOMAIN):
            q = c.questions[("sft", ds)]
            c.questions[("sft+ts", ds)] = Questions.options(
                scaled(torch.from_numpy(q.x), t).numpy(), q.y, n_bins=q.n_bins)
        c.last["sft+ts"] = {"temperature": t}


def _splits(cells: Cells, *variants: str) -> dict[int, list[int]]:
    """split seed -> the training seeds every one of ``variants`` has a cell for."""
    out: dict[int, list[int]] = {}
    for split in sorted({s for (_, s, _) in cells}):
        seeds = sorted(set.intersection(*({k for (v, s, k) in cells if v == var and s == split}
                                          for var in variants)))
        if seeds:
            out[split] = seeds
    return out


def difference(cells: Cells, a: tuple[str, str], b: tuple[str, str] | None, ds: str = OOD, *,
               n_boot: int = 1000, seed: int = 0,
               shared: dict[tuple[int, str], DatasetDraws] | None = None) -> dict[str, Any]:
    """Row ``a`` = (variant, row) minus row ``b`` on ``ds``'s conf-ECE, pooled over split seeds
    (module docstring); ``b`` None: row a's own ECE. ``{"diff", "ci", "splits", "n_cells"}``.
    ``shared`` keeps each (split, dataset)'s resamples and resampled rows between calls (the
    same numbers, each row computed once)."""
    shared = {} if shared is None else shared
    splits = _splits(cells, *{a[0], *(b[:1] if b else ())})
    if not splits:
        raise ValueError(f"no split seed has cells of both {a} and {b}")
    full, boot = [], []
    for split, seeds in splits.items():
        rows = [[cells[(v, split, k)].questions[(r, ds)] for k in seeds] for v, r in (a, *([b] if b else []))]
        aligned(*rows)  # the same questions within a split
        draws = shared.setdefault((split, ds), DatasetDraws(rows[0][0].n, n_boot=n_boot,
                                                            seed=seed + split))
        every = np.arange(rows[0][0].n)
        vals = [draws.values((v, r, tuple(seeds)), qs, seeds)["error"] for (v, r), qs in zip((a, *([b] if b else [])), rows, strict=True)]
        means = [float(np.mean([q.error(every) for q in qs])) for qs in rows]
        full.append(means[0] - (means[1] if b else 0.0))
        boot.append(vals[0] - (vals[1] if b else 0.0))
    pooled = np.mean(boot, axis=0)
    return {"diff": float(np.mean(full)), "ci": list(percentile_interval(pooled)),
            "splits": sorted(splits), "n_cells": sum(len(s) for s in splits.values())}


def beats(d: dict[str, Any]) -> bool:
    """The difference's 95 % interval lies below 0."""
    return bool(d["ci"][1] < 0)


def loses(d: dict[str, Any]) -> bool:
    """The difference's 95 % interval lies above 0."""
    return bool(d["ci"][0] > 0)


def row_summary(cells: Cells, variant: str, row: str) -> dict[str, Any]:
    """A row's numbers averaged over its cells: ECE, accuracy and mean entropy on both test
    sets, calibration-split accuracy and the gap, and, for a trained α, its last step's τ
    (median, min, max) and λ (mean over steps, last)."""
    mine = [c for (v, _, _), c in sorted(cells.items()) if v == variant and row in c.results]
    out: dict[str, Any] = {"n_cells": len(mine)}
    for ds in (OOD, IN_DOMAIN):
        out[ds] = {k: float(np.mean([c.results[row][ds][k] for c in mine]))
                   for k in ("conf_ece", "accuracy", "mean_confidence")}
        out[ds]["entropy"] = float(np.mean([_entropy(c.questions[(row, ds)]) for c in mine]))
    out["calib_accuracy"] = float(np.mean([c.results[row][IN_DOMAIN]["calib_accuracy"] for c in mine]))
    out["gap"] = out["calib_accuracy"] - out[IN_DOMAIN]["accuracy"]
    method = row  # a "method:variant" row (calm:no_alpha) is evaluated without the α it trained
    if all(method in c.last for c in mine):
        out["alpha_tau"] = {k: float(np.mean([c.last[method][f"alpha_tau_{k}"] for c in mine]))
                            for k in ("median", "min", "max")}
        out["lambda"] = {"mean": float(np.mean([np.mean(c.lam[method]) for c in mine])),
                         "last": float(np.mean([c.lam[method][-1] for c in mine]))}
    return out


def _entropy(q: Questions) -> float:
    """Mean over questions of the option distribution's entropy (zero-padded options, at
    log 0 = −inf, are classes of probability 0 to ``calibration.objectives.entropy``)."""
    import torch

    from calibration.objectives import entropy

    return float(entropy(torch.log(torch.from_numpy(q.x))))


def comparisons(cells: Cells, *, n_boot: int = 1000) -> dict[str, dict[str, Any]]:
    """Every difference the rule reads, by name ("<variant>: <row> − <row>")."""
    out: dict[str, dict[str, Any]] = {}
    shared: dict[tuple[int, str], DatasetDraws] = {}
    pairs = [(f"{v}: {r} − {base}", (v, r), (v, base)) for v, r in CALM_ROW.items()
             if any(x == v for (x, _, _) in cells) for base in ("sft", "ts")]
    pairs += [("calib400 calm − calm calm", ("calib400", "calm"), ("calm", "calm")),
              ("calm: calm:no_alpha − calm", ("calm", "calm:no_alpha"), ("calm", "calm"))]
    for name, a, b in pairs:
        out[name] = difference(cells, a, b, n_boot=n_boot, shared=shared)
    return out


def decide(diffs: dict[str, dict[str, Any]], gaps: dict[str, float]) -> dict[str, Any]:
    """The declared rule on the differences (``comparisons``) and the CALM rows' accuracy gaps
    (``{"calm": ..., "calib400": ...}``): each clause with its truth value, the outcome, and
    which variants earned a confirmatory test."""

    def good(variant: str) -> bool:  # beats its SFT, or within 0.02 of its TS
        row = CALM_ROW[variant]
        return beats(diffs[f"{variant}: {row} − sft"]) or diffs[f"{variant}: {row} − ts"]["diff"] <= WITHIN

    clauses = {
        "calib400 CALM beats calm CALM on ARC-Easy ECE": beats(diffs["calib400 calm − calm calm"]),
        "calib400 CALM's gap is at most half of calm CALM's": gaps["calib400"] <= GAP_SHARE * gaps["calm"],
        "option_temperature CALM beats its SFT or is within 0.02 of its TS": good("option_temperature"),
        "calm CALM beats its SFT or is within 0.02 of its TS": good("calm"),
        "calm:no_alpha is no better calibrated than calm CALM": not beats(diffs["calm: calm:no_alpha − calm"]),
        "vocab_temperature's calm_scalar loses to its SFT": loses(diffs["vocab_temperature: calm_scalar − sft"]),
        "calm CALM loses to its SFT": loses(diffs["calm: calm − sft"]),
    }
    names = list(clauses)
    c = clauses[names[0]] and clauses[names[1]]
    b = not c and clauses[names[2]] and not clauses[names[3]]
    a = not (b or c) and clauses[names[4]] and clauses[names[5]] and clauses[names[6]]  # "as calm does"
    outcome = "c" if c else "b" if b else "a" if a else "undecided"
    earned = [v for v, row in CALM_ROW.items() if f"{v}: {row} − sft" in diffs
              and beats(diffs[f"{v}: {row} − sft"]) and diffs[f"{v}: {row} − ts"]["diff"] <= WITHIN]
    return {"clauses": clauses, "outcome": outcome, "confirmatory": earned}


OUTCOMES = {"c": "(c) scale or setting: the 100-question calibration set is too small",
            "b": "(b) this implementation's choice: per-token α on raw, uncentred logits",
            "a": "(a) the method's formulation: θ absorbs α, the bilevel optimum is degenerate",
            "undecided": "undecided: no clause of the rule holds in full"}


def verdict(root: Path, *, n_boot: int = 1000) -> dict[str, Any]:
    """The rule applied to the cells under ``root``: rows, differences, clauses, outcome."""
    cells = load_cells(root)
    rows = {f"{v}/{r}": row_summary(cells, v, r)
            for v in CALM_ROW if any(x == v for (x, _, _) in cells)
            for r in ("none", "ts", "sft", CALM_ROW[v], *(["calm:no_alpha"] if v == "calm" else []))}
    diffs = comparisons(cells, n_boot=n_boot)
    gaps = {v: rows[f"{v}/calm"]["gap"] for v in ("calm", "calib400")}
    add_sft_ts(cells)  # after the rule's numbers: nothing the rule reads changes
    exploratory = {}
    for v, row in CALM_ROW.items():
        mine = [c for (x, _, _), c in cells.items() if x == v and ("sft+ts", OOD) in c.questions]
        if mine:
            q = [c.questions[("sft+ts", OOD)] for c in mine]
            exploratory[v] = {
                "sft+ts ARC-Easy ECE": float(np.mean([x.error(np.arange(x.n)) for x in q])),
                "T (fitted on SciQ test)": float(np.mean([c.last["sft+ts"]["temperature"] for c in mine])),
                f"{row} − sft+ts": difference(cells, (v, row), (v, "sft+ts"), n_boot=n_boot)}
    notes = []
    if gaps["calm"] <= 0:  # the rule is applied as declared; say what it then means
        notes.append(f"calm CALM's gap is {gaps['calm']:+.3f} (calibration-split accuracy not "
                     "above test accuracy): there is no calibration-set overfitting for calib400 "
                     "to halve, and the gap clause is applied literally")
    return {"n_cells": len(cells), "n_boot": n_boot, "rows": rows, "differences": diffs,
            **decide(diffs, gaps), "notes": notes, "exploratory": exploratory}


def markdown(v: dict[str, Any]) -> str:
    """verdict.md: the rows, the differences, each clause and the outcome."""
    def f(x: float) -> str:
        return f"{x:.3f}"

    out = ["# calm-diagnosis: the decision rule applied", "",
           f"{v['n_cells']} cells; differences on ARC-Easy conf-ECE paired within each split seed "
           f"and pooled over them, 95 % hierarchical bootstrap intervals ({v['n_boot']} resamples "
           "per split).", "",
           "| row | cells | ARC-Easy ECE | ARC-Easy acc | ARC-Easy entropy | SciQ ECE | SciQ acc | "
           "SciQ entropy | calib acc | gap | τ median [min, max] | λ mean (last) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in v["rows"].items():
        tau = r.get("alpha_tau")
        lam = r.get("lambda")
        out.append(f"| {name} | {r['n_cells']} | {f(r[OOD]['conf_ece'])} | {f(r[OOD]['accuracy'])} | "
                   f"{f(r[OOD]['entropy'])} | {f(r[IN_DOMAIN]['conf_ece'])} | "
                   f"{f(r[IN_DOMAIN]['accuracy'])} | {f(r[IN_DOMAIN]['entropy'])} | "
                   f"{f(r['calib_accuracy'])} | {r['gap']:+.3f} | "
                   + (f"{tau['median']:.2f} [{tau['min']:.2f}, {tau['max']:.2f}]" if tau else "–")
                   + " | " + (f"{lam['mean']:.2f} ({lam['last']:.2f})" if lam else "–") + " |")
    out += ["", "gap = calibration-split accuracy − SciQ test accuracy. τ: the learned α's "
            "temperatures at the last step (one for a scalar α).", "",
            "| difference (ARC-Easy conf-ECE) | Δ | 95 % interval | split seeds | cells |",
            "|---|---|---|---|---|"]
    for name, d in v["differences"].items():
        out.append(f"| {name} | {d['diff']:+.3f} | [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] | "
                   f"{', '.join(map(str, d['splits']))} | {d['n_cells']} |")
    out += ["", "| clause | holds |", "|---|---|"]
    out += [f"| {k} | {'yes' if ok else 'no'} |" for k, ok in v["clauses"].items()]
    out += [""] + [f"Note: {n}." for n in v.get("notes", [])]
    if v.get("exploratory"):
        out += ["", "Exploratory, not in the rule: SFT with post-hoc TS (T fitted by NLL on SFT's "
                "SciQ test predictions; the cells keep no calibration-split probabilities).", "",
                "| variant | T | sft+ts ARC-Easy ECE | CALM row − sft+ts | 95 % interval |",
                "|---|---|---|---|---|"]
        for name, e in v["exploratory"].items():
            d = next(x for k, x in e.items() if k.endswith("− sft+ts"))
            out.append(f"| {name} | {e['T (fitted on SciQ test)']:.2f} | "
                       f"{e['sft+ts ARC-Easy ECE']:.3f} | {d['diff']:+.3f} | "
                       f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}] |")
    earned = ", ".join(v["confirmatory"]) or "none"
    out += ["", f"**Outcome: {OUTCOMES[v['outcome']]}.**", "",
            f"Variants that beat their SFT and come within {WITHIN} of their TS on ARC-Easy ECE "
            f"(a confirmatory test each): {earned}.", ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m apps.study.diagnosis",
                                 description="apply calm-diagnosis's declared decision rule")
    ap.add_argument("--root", type=Path, default=Path("docs/results/calm-diagnosis"))
    ap.add_argument("--n-boot", type=int, default=1000)
    a = ap.parse_args(argv)
    v = verdict(a.root, n_boot=a.n_boot)
    (a.root / "verdict.json").write_text(json.dumps(v, indent=1) + "\n")
    (a.root / "verdict.md").write_text(markdown(v))
    print(markdown(v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
