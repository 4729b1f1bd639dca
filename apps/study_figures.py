"""Figures of a study, pooled over seeds: reliability diagrams and training curves.

    python -m apps.study laptop --root /work/study/laptop --figures docs/img/laptop

Reliability diagrams pool every seed's predictions of a row (seeds × questions points, so each
question counts once per seed): the same points the pooled interval of ``apps.study`` resamples.
Training curves show each trained row's training loss, the mean over seeds of a centred moving
average, with the band from the lowest to the highest seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# the loss a method descends on its training batch: the lower-level CE for the bilevel methods
# (their "loss" repeats it), the method's own training loss for the others
LOSS_KEYS = ("lower_loss", "loss")


def _pooled(study: Any, root: Path, key: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """dataset -> (probs (S·N, K), labels (S·N,)) of row ``variant/row`` over its finished seeds."""
    from apps import study as st

    variant, row = key.split("/", 1)
    per_ds: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for c in st.cells(study):
        if c.variant.name != variant or not st.done(root / c.name, c):
            continue
        preds = st._predictions(root / c.name)
        for name, p in preds.items():
            parts = name.split("/")
            if len(parts) == 3 and parts[0] == row and parts[2] == "probs":
                ps, ls = per_ds.setdefault(parts[1], ([], []))
                ps.append(p.double().numpy())
                ls.append(preds[f"{row}/{parts[1]}/labels"].numpy())
    return {ds: (np.concatenate(ps), np.concatenate(ls)) for ds, (ps, ls) in per_ds.items()}


def reliability(study: Any, root: Path, dest: Path, rows: tuple[str, ...]) -> list[Path]:
    """``reliability_<dataset>.png`` under ``dest``: the pooled diagram of each row in ``rows``
    that has predictions (a row without any is left out, not drawn empty)."""
    import torch

    from calibration.plots import reliability_diagram

    curves: dict[str, dict[str, tuple[Any, Any]]] = {}
    for key in rows:
        for ds, (p, y) in _pooled(study, root, key).items():
            curves.setdefault(ds, {})[key] = (torch.from_numpy(p), torch.from_numpy(y))
    return [reliability_diagram(c, dest / f"reliability_{ds}.png",
                                title=f"{study.name}: {ds}, pooled over seeds")
            for ds, c in curves.items()]


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average; the ends average the points they have."""
    kernel = np.ones(window)
    return np.convolve(y, kernel, "same") / np.convolve(np.ones_like(y), kernel, "same")


def training_curves(study: Any, root: Path, dest: Path, *, window: int = 5) -> Path:
    """``training_loss.png``: one line per trained row (mean over seeds of the smoothed loss)
    with a band from the lowest to the highest seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from apps import study as st
    from apps.calm_llm.history import read_history

    losses: dict[str, list[np.ndarray]] = {}
    for c in st.cells(study):
        if not st.done(root / c.name, c):
            continue
        for h in sorted((root / c.name).glob("history_*.jsonl")):
            steps = read_history(h)
            key = next((k for k in LOSS_KEYS if steps and k in steps[0]), None)
            if key is not None:
                y = np.array([s.get(key) if s.get(key) is not None else np.nan for s in steps])
                losses.setdefault(f"{c.variant.name}/{h.stem[len('history_'):]}", []).append(
                    _smooth(y, window))
    if not losses:
        raise ValueError(f"{root}: no finished cell has a training history")
    fig = Figure(figsize=(8, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key, ys in losses.items():
        n = min(len(y) for y in ys)
        stack = np.stack([y[:n] for y in ys])
        steps = np.arange(1, n + 1)
        (line,) = ax.plot(steps, stack.mean(0), lw=1.4, label=f"{key} ({len(ys)} seeds)")
        ax.fill_between(steps, stack.min(0), stack.max(0), color=line.get_color(), alpha=0.15)
    ax.set(xlabel="optimizer step", ylabel=f"training loss ({window}-step moving average)",
           title=f"{study.name}: training loss (CE for the bilevel methods' lower level)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    out = dest / "training_loss.png"
    dest.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    tmp.replace(out)
    return out
