"""Predictions -> metrics (via `calibration.metrics`) -> metrics.json, results.md, PNGs.

``predictions[method][dataset] = (probs, labels)`` with probs (N, K) option probabilities
(softmax of `scoring.option_logits`; absent options have probability 0) and labels (N,).
``metrics.json`` has the issue's shape::

    {"results": {METHOD: {DATASET: {"domain": "id"|"ood", "n", "accuracy", "conf_ece",
     "cw_ece", "brier", "nll", "mean_confidence", "mce", "smooth_ece",
     "conf_ece_ci": [low, high], "cw_ece_ci": [low, high], ...}}}, ...}

``results.md`` renders it as the papers' tables: rows = methods, columns = datasets ×
{Acc, conf-ECE [95% bootstrap interval], cw-ECE}, one table per domain, best value in bold.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from calibration import metrics

from .tables import fmt, safe_name

DOMAINS = ("id", "ood")
DOMAIN_TITLES = {"id": "In-domain", "ood": "Out-of-domain"}


def trim_absent_tail(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Drop trailing option slots that no question has (zero mass, never a label): a batch is
    K = max_options wide, and an all-zero 5th column of a 4-option set would dilute cw-ECE's
    average over classes. Slots absent only for some questions stay (ARC mixes 3-5 options)."""
    k = probs.shape[1]
    while k > 2 and bool((probs[:, k - 1] == 0).all()) and not bool((labels == k - 1).any()):
        k -= 1
    return probs[:, :k].contiguous()


def dataset_metrics(
    probs: Any,
    labels: Any,
    *,
    domain: str,
    n_bins: int = 10,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, Any]:
    """Every headline metric of one (method, dataset) pair, with bootstrap intervals on ECE.

    Args:
        probs: (N, K) option probabilities. labels: (N,) gold option indices.
        domain: "id" (in-domain) or "ood".
        n_bins: equal-width bins for conf-ECE / cw-ECE (10 in the papers).
        n_boot: bootstrap resamples for the 95% intervals (0 = no intervals).
    Returns:
        A JSON-able dict: domain, n, n_options, accuracy, conf_ece, cw_ece, mce, brier, nll,
        mean_confidence, smooth_ece, conf_ece_ci, cw_ece_ci, n_bins, n_boot.
    """
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    p = torch.as_tensor(probs).detach().to("cpu", torch.float64)
    y = torch.as_tensor(labels).detach().to("cpu", torch.int64)
    if p.ndim != 2 or y.ndim != 1 or p.shape[0] != y.shape[0]:
        raise ValueError(f"probs must be (N, K) and labels (N,), got {tuple(p.shape)} and {tuple(y.shape)}")
    p = trim_absent_tail(p, y)
    out: dict[str, Any] = {"domain": domain, "n": int(p.shape[0]), "n_options": int(p.shape[1])}
    out.update(metrics.summary(p, y, n_bins=n_bins))
    for name, fn in (("conf_ece", metrics.conf_ece), ("cw_ece", metrics.cw_ece)):
        if n_boot > 0:
            iv = metrics.bootstrap(functools.partial(fn, n_bins=n_bins), p, y, n=n_boot, seed=seed)
            out[f"{name}_ci"] = [iv.low, iv.high]
        else:
            out[f"{name}_ci"] = None
    out["n_bins"] = n_bins
    out["n_boot"] = n_boot
    return out


def evaluate_predictions(
    predictions: Mapping[str, Mapping[str, tuple[Any, Any]]],
    domains: Mapping[str, str],
    *,
    n_bins: int = 10,
    n_boot: int = 1000,
    seed: int = 0,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{method: {dataset: dataset_metrics(...)}}``; ``domains[dataset]`` is "id" or "ood"."""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for method, per_ds in predictions.items():
        results[method] = {}
        for ds, (p, y) in per_ds.items():
            if ds not in domains:
                raise ValueError(f"dataset {ds!r} has no domain (give 'id' or 'ood' in domains)")
            results[method][ds] = dataset_metrics(p, y, domain=domains[ds], n_bins=n_bins, n_boot=n_boot, seed=seed)
    return results


def _datasets_by_domain(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, list[str]]:
    order: dict[str, list[str]] = {d: [] for d in DOMAINS}
    for per_ds in results.values():
        for ds, m in per_ds.items():
            dom = m.get("domain", "id")
            if ds not in order.setdefault(dom, []):
                order[dom].append(ds)
    return {d: v for d, v in order.items() if v}


def render_table(results: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """Markdown tables as in the papers: one per domain, rows = methods, columns = datasets ×
    {Acc ↑, conf-ECE ↓ [95% CI], cw-ECE ↓}; the best value of each column in bold."""
    if not results:
        raise ValueError("no results to render")
    methods = list(results)
    blocks = []
    for dom, datasets in _datasets_by_domain(results).items():
        header = ["Method"]
        for ds in datasets:
            n = next((results[m][ds]["n"] for m in methods if ds in results[m]), "?")
            header += [f"{ds} (n={n}) Acc ↑", f"{ds} conf-ECE ↓ [95% CI]", f"{ds} cw-ECE ↓"]
        best: dict[tuple[str, str], float] = {}
        for ds in datasets:
            for key, better in (("accuracy", max), ("conf_ece", min), ("cw_ece", min)):
                vals = [results[m][ds][key] for m in methods if ds in results[m]]
                vals = [v for v in vals if v is not None and not math.isnan(v)]
                if len(vals) > 1:
                    best[(ds, key)] = better(vals)
        rows = []
        for m in methods:
            row = [m]
            for ds in datasets:
                r = results[m].get(ds)
                if r is None:
                    row += ["–", "–", "–"]
                    continue
                cells = []
                for key in ("accuracy", "conf_ece", "cw_ece"):
                    s = fmt(r.get(key))
                    if best.get((ds, key)) is not None and r.get(key) == best[(ds, key)]:
                        s = f"**{s}**"
                    if key == "conf_ece" and r.get("conf_ece_ci"):
                        lo, hi = r["conf_ece_ci"]
                        s += f" [{fmt(lo)}, {fmt(hi)}]"
                    cells.append(s)
                row += cells
            rows.append(row)
        lines = [f"### {DOMAIN_TITLES.get(dom, dom)}", "", "| " + " | ".join(header) + " |",
                 "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        blocks.append("\n".join(lines))
        blocks.append(_every_metric(results, methods, datasets, dom))
    return "\n\n".join(blocks) + "\n"


def _every_metric(results: Mapping[str, Mapping[str, Mapping[str, Any]]], methods: list[str],
                  datasets: list[str], title: str) -> str:
    """Every metric of ``calibration.metrics.SUMMARY`` (its columns, labels and directions
    read from that table, so a metric added there appears here with no edit), one row per
    method and dataset; the best of each (dataset, metric) with a direction in bold."""
    cols = metrics.SUMMARY
    lines = [f"#### Every metric ({title})", "",
             "| Method | Dataset | " + " | ".join(
                 f"{m.label} {'↑' if m.better == 'max' else '↓' if m.better == 'min' else ''}".rstrip()
                 for m in cols) + " |",
             "|---|---|" + ":---:|" * len(cols)]
    for ds in datasets:
        best = {}
        for m in cols:
            vals = [results[r][ds].get(m.name) for r in methods if ds in results[r]]
            vals = [v for v in vals if isinstance(v, (int, float)) and not math.isnan(v)]
            if m.better is not None and len(vals) > 1:
                best[m.name] = max(vals) if m.better == "max" else min(vals)
        for r in methods:
            if ds not in results[r]:
                continue
            cells = []
            for m in cols:
                v = results[r][ds].get(m.name)
                text = fmt(v)
                cells.append(f"**{text}**" if m.name in best and v == best[m.name] else text)
            lines.append(f"| {r} | {ds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    run_dir: str | Path,
    results: Mapping[str, Mapping[str, Mapping[str, Any]]],
    predictions: Mapping[str, Mapping[str, tuple[Any, Any]]],
    *,
    n_bins: int = 10,
    extra: Mapping[str, Any] | None = None,
    plots: bool = True,
) -> None:
    """Write ``metrics.json``, ``results.md``, ``predictions.safetensors`` and one reliability
    diagram per dataset with every method overlaid (``reliability_<dataset>.png``).

    ``extra`` adds top-level keys to metrics.json (e.g. the zero-shot accuracy, timings).
    Predictions are stored as safetensors (no pickle): ``{method}/{dataset}/probs`` and
    ``.../labels``, so any table can be recomputed without rerunning a model.
    Each file is written whole or not at all (`io.atomic_write_bytes`), so a full disk keeps the
    previous results rather than leaving a cut metrics.json.
    """
    from .io import atomic_save_tensors, atomic_write_text

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"results": results}
    if extra:
        clash = set(extra) & {"results"}
        if clash:
            raise ValueError(f"extra keys clash with metrics.json keys: {sorted(clash)}")
        payload.update(extra)
    atomic_write_text(run / "metrics.json", json.dumps(payload, indent=2, sort_keys=False) + "\n")
    title = "# Results\n\nAccuracy, confidence ECE with a 95% bootstrap interval, and classwise ECE "
    title += f"({n_bins} equal-width bins). Best value per column in bold.\n\n"
    atomic_write_text(run / "results.md", title + render_table(results))

    tensors: dict[str, torch.Tensor] = {}
    for method, per_ds in predictions.items():
        for ds, (p, y) in per_ds.items():
            tensors[f"{method}/{ds}/probs"] = torch.as_tensor(p).detach().to("cpu", torch.float32).contiguous()
            tensors[f"{method}/{ds}/labels"] = torch.as_tensor(y).detach().to("cpu", torch.int64).contiguous()
    if tensors:
        atomic_save_tensors(run / "predictions.safetensors", tensors)

    if plots:
        from calibration import plots as cplots

        datasets: list[str] = []
        for per_ds in predictions.values():
            datasets += [d for d in per_ds if d not in datasets]
        for ds in datasets:
            curves = {m: (predictions[m][ds][0], predictions[m][ds][1]) for m in predictions if ds in predictions[m]}
            cplots.reliability_diagram(
                curves, run / f"reliability_{safe_name(ds)}.png", n_bins=n_bins, mode="top", title=ds
            )
