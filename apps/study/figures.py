"""Figures of a study, pooled over seeds: reliability diagrams and training curves.

    python -m apps.study laptop --root /work/study/laptop --figures docs/img/laptop

Reliability diagrams pool every seed's predictions of a row (seeds × questions points, so each
question counts once per seed); the ECE in the legend is that of the pooled points, which is
close to, but not the same number as, the mean over seeds that ``study.md`` reports. Training
curves show each trained row's training loss, the mean over seeds of a centred moving average,
with the band from the lowest to the highest seed; the legend names the quantity, since the
methods descend different losses (RCFT's total is (1 − w)·CE + w·s·R, label smoothing's CE has a
higher floor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from apps.study.questions import load as load_questions
from apps.study.runner import cells, done

# the CE a method descends on its training batch where it records one apart from its total (the
# bilevel methods' lower level, RCFT's SFT term), else its own training loss
LOSS_KEYS = ("lower_loss", "sft_loss", "loss")


def _pooled(study: Any, root: Path, key: str) -> dict[str, tuple[np.ndarray, np.ndarray, int, str]]:
    """dataset -> (x, y, S, kind) of row ``variant/row`` over its S finished seeds that kept
    question-level predictions, seeds concatenated in order: option probabilities (S·N, K) and
    labels (S·N,) for multiple choice (kind ``options``), the semantic-cluster confidence and
    modal correctness (S·N,) for open QA (kind ``binary``)."""
    variant, row = key.split("/", 1)
    per_ds: dict[str, list[Any]] = {}
    for c in cells(study):
        if c.variant.name != variant or not done(root / c.name, c):
            continue
        for (r, ds), q in load_questions(root / c.name).items():
            if r == row:
                per_ds.setdefault(ds, []).append(q)
    return {ds: (np.concatenate([q.x for q in qs]), np.concatenate([q.y for q in qs]), len(qs),
                 qs[0].kind) for ds, qs in per_ds.items()}


def reliability(study: Any, root: Path, dest: Path, rows: tuple[str, ...]) -> list[Path]:
    """``reliability_<dataset>.png`` under ``dest``: the pooled diagram of each row in ``rows``
    that has predictions (a row without any is left out, not drawn empty); open QA's rows are
    drawn by their semantic-cluster confidence."""
    import torch

    from calibration.plots import reliability_diagram

    curves: dict[str, dict[str, tuple[Any, Any]]] = {}
    kinds: dict[str, str] = {}
    for key in rows:
        for ds, (x, y, n_seeds, kind) in _pooled(study, root, key).items():
            curves.setdefault(ds, {})[f"{key} ({n_seeds} seeds)"] = (torch.from_numpy(x),
                                                                     torch.from_numpy(y))
            kinds[ds] = kind
    return [reliability_diagram(c, dest / f"reliability_{ds}.png",
                                mode="binary" if kinds[ds] == "binary" else "top",
                                title=f"{study.name}: {ds}, pooled over seeds "
                                      "(ECE of the pooled points)")
            for ds, c in curves.items()]


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average (odd ``window``) of the finite points; the ends average the points
    they have, a stretch with no finite point stays NaN. Same length as ``y``."""
    kernel = np.ones(max(1, window))
    start = (len(kernel) - 1) // 2  # the full convolution's centred slice (any length of y)
    finite = np.isfinite(y)
    total = np.convolve(np.where(finite, y, 0.0), kernel, "full")[start:start + len(y)]
    count = np.convolve(finite.astype(float), kernel, "full")[start:start + len(y)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


def training_curves(study: Any, root: Path, dest: Path, *, window: int = 5) -> Path:
    """``training_loss.png``: one line per trained row (mean over seeds of the smoothed loss)
    with a band from the lowest to the highest seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from apps.calm_llm.history import read_history

    losses: dict[str, list[np.ndarray]] = {}
    for c in cells(study):
        if not done(root / c.name, c):
            continue
        for h in sorted((root / c.name).glob("history_*.jsonl")):
            steps = read_history(h)
            key = next((k for k in LOSS_KEYS if steps and k in steps[0]), None)
            if key is not None:
                y = np.array([s.get(key) if s.get(key) is not None else np.nan for s in steps])
                row = f"{c.variant.name}/{h.stem[len('history_'):]}"
                losses.setdefault(f"{row}: {key}", []).append(_smooth(y, window))
    if not losses:
        raise ValueError(f"{root}: no finished cell has a training history")
    fig = Figure(figsize=(8, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, ys in losses.items():
        n = min(len(y) for y in ys)
        stack = np.stack([y[:n] for y in ys])
        steps = np.arange(1, n + 1)
        with np.errstate(all="ignore"):  # a step NaN in every seed stays a gap
            mean, lo, hi = np.nanmean(stack, 0), np.nanmin(stack, 0), np.nanmax(stack, 0)
        (line,) = ax.plot(steps, mean, lw=1.4, label=f"{key} ({len(ys)} seeds)")
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set(xlabel="optimizer step", ylabel=f"training loss ({window}-step moving average)",
           title=f"{study.name}: each row's training loss (legend: row: recorded key)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    out = dest / "training_loss.png"
    dest.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    tmp.replace(out)
    return out
