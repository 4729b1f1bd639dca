"""Does temperature scaling fail under a shift? A screen of candidate shifts from saved
predictions, before any method is compared on them (issue 28; the CALM paper's premise is that
a temperature fitted in domain fails out of domain).

Every row of a finished cell but TS's is a model screened (``none``: the model as given in
``ts-shift-screen``; ``sft``: fine-tuned in ``ts-shift-trained``). Its T_fit is fitted in domain:
for the untrained row, the TS row's ``temperature`` (fitted on the in-domain calibration split);
for a trained row, which has no TS row of its own, the NLL-optimal temperature of the row on the
in-domain test set (questions it did not train on; never applied to that set itself). For every
other test set of that cell, and of each cell whose options differ only in the prompt format
(the format shift: T fitted under one prompt, applied to the same model's answers under
another), the screen reports, from the row's saved probabilities p (N, K):

- T_opt, the temperature that minimizes NLL on the test set itself
  (``calibration.posthoc.fit_temperature`` on log p; the scaled probabilities are
  softmax(log p / T), which is softmax(z / T) of the logits z the run scored);
- NLL at T_fit and at T_opt (TS's own objective: T_opt is its minimum);
- conf-ECE at T = 1, at T_fit and at T_opt (in-sample: optimistic, T_opt saw the labels);
- conf-ECE of a two-fold cross-fit of T_opt (each half scaled by the T fitted on the other),
  the honest "best temperature" reference; and a percentile bootstrap interval (questions
  resampled, 1,000 draws, the temperatures held fixed) of ECE(T_fit) − ECE(cross-fit);
- the same against the temperature that is best by conf-ECE itself (a grid, `ECE_GRID`), in
  sample and cross-fitted: the NLL-optimal T_opt over-softens these answers for ECE's bins, so
  "T_fit is no worse than the cross-fitted T_opt" says less than it seems, and the ECE-optimal
  reference says how much ECE a temperature could still have gained (point estimates).

TS "fails" on a shift when that interval lies above 0 (T_fit is measurably worse than a
temperature learned on half of the shifted set), and "transfers" otherwise. The same is reported
in TS's own objective, NLL (the NLL at T_fit minus the cross-fit's, paired bootstrap interval,
``nll_verdict``): the NLL-optimal temperature is not the ECE-optimal one, and after fine-tuning
the two verdicts can differ. Guo et al. (2017),
"On calibration of modern neural networks" (TS); Ovadia et al. (2019), "Can you trust your
model's uncertainty?" (TS degrading under shift). Cost: per (fit, test) pair three temperature
fits on N questions and 2,000 conf-ECE evaluations of N questions.

    python -m apps.study.shift --root docs/results/ts-shift-screen   # writes shift.json/shift.md
    python -m apps.study.shift --study ts-shift-trained --root runs/study-ts-shift-trained
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from apps.lock import locked
from apps.study.catalogue import STUDIES
from apps.study.design import Study
from apps.study.integrity import cross_check, read_results
from apps.study.runner import Cell, cells, done
from calibration.metrics import accuracy, conf_ece, nll
from calibration.posthoc import fit_temperature

# log 0 of a padded option slot: finite for the fit, still no mass after any T ≤ e^5
PAD_LOGIT = -1e4


def _logits(probs: torch.Tensor) -> torch.Tensor:
    z = torch.log(probs.double())
    return torch.where(torch.isfinite(z), z, torch.full_like(z, PAD_LOGIT))


def scaled(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(log p / T): the option probabilities at temperature T (padded slots stay 0)."""
    return torch.softmax(_logits(probs) / temperature, dim=-1)


def optimal_temperature(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """The NLL-optimal temperature of ``probs`` on their own labels (T_opt)."""
    import warnings

    with warnings.catch_warnings():  # at chance the optimum is T -> inf: reported as the bound
        warnings.simplefilter("ignore", UserWarning)
        return fit_temperature(_logits(probs), labels).temperature


# the ECE-optimal reference searches a log grid: conf-ECE is piecewise constant in T and not
# unimodal, so a 1-D optimizer would stop anywhere; neighbours 3 % apart from T = 0.5 to 20
ECE_GRID = tuple(float(t) for t in np.geomspace(0.5, 20.0, 126))


def ece_optimal_temperature(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 10) -> float:
    """The temperature of `ECE_GRID` with the lowest conf-ECE of ``probs`` (N, K) on their own
    labels (the first of ties): the best a temperature can do by the claim's metric."""
    eces = [conf_ece(scaled(probs, t), labels, n_bins=n_bins) for t in ECE_GRID]
    return ECE_GRID[int(np.argmin(eces))]


def cross_fitted(probs: torch.Tensor, labels: torch.Tensor,
                 fit: Callable[[torch.Tensor, torch.Tensor], float] = optimal_temperature,
                 ) -> tuple[torch.Tensor, list[float]]:
    """Each half of the questions (even / odd positions: the split is already random) scaled by
    the temperature ``fit`` (default T_opt, NLL-optimal) chooses on the other half; returns the
    scaled (N, K) and the two temperatures."""
    out = torch.empty_like(probs, dtype=torch.float64)
    halves = (torch.arange(0, len(labels), 2), torch.arange(1, len(labels), 2))
    temps = []
    for a, b in (halves, halves[::-1]):
        t = fit(probs[b], labels[b])
        out[a] = scaled(probs[a], t)
        temps.append(t)
    return out, temps


def _difference_interval(p_fit: torch.Tensor, p_ref: torch.Tensor, y: torch.Tensor, n_bins: int,
                         n_boot: int = 1000, seed: int = 0) -> list[float]:
    """Percentile 95 % interval of conf-ECE(p_fit) − conf-ECE(p_ref) over paired question draws."""
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(n_boot):
        idx = torch.from_numpy(rng.integers(0, len(y), len(y)))
        diffs.append(conf_ece(p_fit[idx], y[idx], n_bins=n_bins) - conf_ece(p_ref[idx], y[idx], n_bins=n_bins))
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return [float(lo), float(hi)]


def _nll_difference(p_fit: torch.Tensor, p_ref: torch.Tensor, y: torch.Tensor,
                    n_boot: int = 1000, seed: int = 0) -> tuple[float, list[float]]:
    """NLL(p_fit) − NLL(p_ref) and its percentile 95 % interval over paired question draws
    (NLL is a mean over questions, so each draw is the mean of the drawn per-question
    differences: O(N) per draw)."""
    idx = y.long().unsqueeze(1)
    d = (torch.log(p_ref.double().gather(1, idx)) - torch.log(p_fit.double().gather(1, idx))).squeeze(1).numpy()
    rng = np.random.default_rng(seed)
    draws = d[rng.integers(0, len(d), (n_boot, len(d)))].mean(axis=1)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(d.mean()), [float(lo), float(hi)]


def _entry(fit: dict[str, Any], test: dict[str, Any], row: str, ds: str, n_bins: int) -> dict[str, Any]:
    """One row of the screen: the temperature ``fit["t"]`` (fitted on ``fit["on"]`` under the
    prompt ``fit["style"]``) applied to the predictions of ``row`` in cell ``test`` on ``ds``."""
    probs, y = test["predictions"][row][ds]
    t_fit = fit["t"]
    t_opt = optimal_temperature(probs, y)
    p_cf, halves = cross_fitted(probs, y)
    p_fit = scaled(probs, t_fit)
    ece_fit, ece_cf = conf_ece(p_fit, y, n_bins=n_bins), conf_ece(p_cf, y, n_bins=n_bins)
    gap = _difference_interval(p_fit, p_cf, y, n_bins)
    nll_gap = _nll_difference(p_fit, p_cf, y)
    shifts = [f"domain {fit['set']}→{ds}"] if fit["set"] != ds else []
    if fit["style"] != test["style"]:
        shifts.append(f"format {fit['style']}→{test['style']}")
    return {
        "model": row, "variant": test["variant"], "seed": test["seed"],
        "fit_on": fit["on"], "fit_style": fit["style"], "test_set": ds, "test_style": test["style"],
        "shift": ", ".join(shifts) or "none", "n": int(len(y)), "accuracy": accuracy(probs, y),
        "t_fit": t_fit, "t_opt": t_opt, "t_opt_halves": halves,
        "ece_t1": conf_ece(probs, y, n_bins=n_bins), "ece_t_fit": ece_fit,
        "ece_t_opt": conf_ece(scaled(probs, t_opt), y, n_bins=n_bins), "ece_cross_fit": ece_cf,
        # TS's own objective: NLL at T_fit against its minimum (at T_opt, in-sample)
        "nll_t_fit": nll(p_fit, y), "nll_t_opt": nll(scaled(probs, t_opt), y),
        "gap": ece_fit - ece_cf, "gap_ci": gap,
        "verdict": "TS fails" if gap[0] > 0 else "TS transfers",
        # the same question in TS's own objective: NLL at T_fit against the cross-fitted T_opt
        "nll_cross_fit": nll(p_cf, y), "nll_gap": nll_gap[0], "nll_gap_ci": nll_gap[1],
        "nll_verdict": "TS fails" if nll_gap[1][0] > 0 else "TS transfers",
        **_ece_optimal(probs, y, ece_fit, n_bins),
    }


def _ece_optimal(probs: torch.Tensor, y: torch.Tensor, ece_fit: float, n_bins: int) -> dict[str, Any]:
    """T_fit against the temperature that is best by conf-ECE itself (the NLL-optimal T_opt is
    not, and its ECE can be worse than T_fit's): the ECE-optimal T in-sample, and cross-fitted
    the same way as T_opt (each half at the ECE-optimal T of the other)."""
    t = ece_optimal_temperature(probs, y, n_bins)
    p_cf, _ = cross_fitted(probs, y, lambda p, q: ece_optimal_temperature(p, q, n_bins))
    ece_cf = conf_ece(p_cf, y, n_bins=n_bins)
    return {"t_ece_opt": t, "ece_t_ece_opt": conf_ece(scaled(probs, t), y, n_bins=n_bins),
            "ece_cross_fit_ece_opt": ece_cf, "gap_ece_opt": ece_fit - ece_cf,
            "gap_ece_opt_in_sample": ece_fit - conf_ece(scaled(probs, t), y, n_bins=n_bins)}


def _fits(cell: dict[str, Any], row: str) -> list[dict[str, Any]]:
    """The temperatures a cell offers for ``row``. In domain (``domain``: applied to every other
    set, and to the same model under the other prompt format): for the untrained row TS's own T,
    fitted on the in-domain calibration split; for a trained row, which has no TS row, the
    NLL-optimal T of the row on its in-domain test set (questions it did not train on). Out of
    domain: each out-of-domain set's own T_opt (applied to another set: the domain shift the
    other way)."""
    out = []
    domain = "+".join(cell["in_domain"])
    if row == "none" and cell["temperature"] is not None:
        out.append({"domain": True, "t": cell["temperature"], "set": domain, "style": cell["style"],
                    "on": f"{domain} calibration split", "own": None})
    for ds, (probs, y) in cell["predictions"][row].items():
        inside = ds in cell["in_domain"]
        if inside and out and out[0]["domain"]:
            continue  # the untrained row's in-domain T is TS's
        out.append({"domain": inside, "t": optimal_temperature(probs, y), "set": ds,
                    "style": cell["style"], "on": f"{ds} test (its T_opt)", "own": ds})
    return out


def _read(study: Study, root: Path, c: Cell) -> dict[str, Any]:
    """A finished cell's training seed, prompt style, in-domain sets, TS's T_fit (None without a TS row) and
    the predictions of every row but TS's (row -> dataset -> (probs, labels))."""
    from safetensors.torch import load_file

    run_dir = root / c.name
    results = read_results(run_dir) or {}
    cross_check(run_dir, results)  # the metrics and predictions read here agree
    cfg = c.config(study)
    t = load_file(str(run_dir / "predictions.safetensors"))
    temps = {r["temperature"] for r in results.get("ts", {}).values()}
    if len(temps) > 1:
        raise ValueError(f"{run_dir / 'metrics.json'}: TS rows disagree on the temperature {temps}")
    argv = c.argv(study)
    if "--prompt-style" in argv:  # the model's key: its cell's options less the prompt format
        i = argv.index("--prompt-style")
        argv = argv[:i] + argv[i + 2:]
    return {"variant": c.variant.name, "seed": c.seed, "style": cfg.data.prompt_style, "model": tuple(argv),
            "in_domain": list(cfg.data.in_domain), "temperature": temps.pop() if temps else None,
            "predictions": {row: {ds: (t[f"{row}/{ds}/probs"].double(), t[f"{row}/{ds}/labels"])
                                  for ds in per}
                            for row, per in results.items() if row != "ts"}}


def screen(study: Study, root: Path, *, n_bins: int = 10) -> list[dict[str, Any]]:
    """Every row of the screen, per model (each row but TS's of every finished cell): its
    in-domain T on each other test set of its cell (the domain shift; TS's T also on the
    in-domain test set) and on the same model's predictions under the other prompt format (a
    cell whose options differ only in ``--prompt-style``: the format shift); and each
    out-of-domain set's T_opt on the other sets (the domain shift the other way)."""
    read = [_read(study, root, c) for c in cells(study) if done(root / c.name, c)]
    if not read:
        raise ValueError(f"no finished cell of study {study.name} under {root}; run "
                         f"`python -m apps.study {study.name} --root {root}` first")
    rows = []
    for cell in read:
        for row in cell["predictions"]:
            for fit in _fits(cell, row):
                rows += [_entry(fit, cell, row, ds, n_bins) for ds in cell["predictions"][row]
                         if ds != fit["own"] and (fit["domain"] or ds != fit["set"])]
                if fit["domain"]:  # the format shift: the same model under another prompt format
                    rows += [_entry(fit, other, row, ds, n_bins) for other in read
                             if other is not cell and other["model"] == cell["model"]
                             and other["style"] != cell["style"] and row in other["predictions"]
                             for ds in other["predictions"][row]]
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The screen as a table (one row per fit/test pair)."""
    head = ("| model | T fitted on | test set | shift | N | acc | T_fit | T_opt | NLL T_fit | NLL T_opt | "
            "ECE T=1 | ECE T_fit | ECE T_opt (in-sample) | ECE T_opt (cross-fit) | "
            "ECE T_fit − cross-fit [95 %] | NLL T_fit − cross-fit [95 %] (verdict) | verdict | "
            "T_ece-opt | ECE T_fit − ECE-opt (in-sample / cross-fit) |")
    lines = [head, "|" + "---|" * 19]
    for r in rows:
        lo, hi = r["gap_ci"]
        nlo, nhi = r["nll_gap_ci"]
        lines.append(
            f"| {r['model']} ({r['variant']}, seed {r['seed']}) | {r['fit_on']}, {r['fit_style']} | {r['test_set']} ({r['test_style']}) | {r['shift']} "
            f"| {r['n']} | {r['accuracy']:.3f} | {r['t_fit']:.2f} | {r['t_opt']:.2f} | "
            f"{r['nll_t_fit']:.3f} | {r['nll_t_opt']:.3f} | "
            f"{r['ece_t1']:.3f} | {r['ece_t_fit']:.3f} | {r['ece_t_opt']:.3f} | "
            f"{r['ece_cross_fit']:.3f} | {r['gap']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
            f"{r['nll_gap']:+.3f} [{nlo:+.3f}, {nhi:+.3f}] ({r['nll_verdict']}) | {r['verdict']} | "
            f"{r['t_ece_opt']:.2f} | {r['gap_ece_opt_in_sample']:+.3f} / {r['gap_ece_opt']:+.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m apps.study.shift [--study NAME] --root DIR``: shift.json and shift.md in DIR."""
    ap = argparse.ArgumentParser(prog="python -m apps.study.shift", description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", default="ts-shift-screen", choices=sorted(STUDIES))
    ap.add_argument("--root", required=True, help="folder of the study's cells")
    a = ap.parse_args(argv)
    root = Path(a.root)
    if not root.is_dir():
        print(f"python -m apps.study.shift: no study at {root} (not a folder)", file=sys.stderr)
        return 2
    try:
        with locked(root, what="study root"):  # LockedError: a ValueError naming the holder
            rows = screen(STUDIES[a.study], root)
            (root / "shift.json").write_text(json.dumps(rows, indent=1))
            (root / "shift.md").write_text(markdown(rows))
    except ValueError as e:  # DamagedCell included: one line naming the file
        print(f"python -m apps.study.shift: {e}", file=sys.stderr)
        return 2
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
