"""Reliability diagrams as PNG files, several methods overlaid on one figure.

matplotlib is imported inside the function (it is an optional dependency) and drawn through
its object API with the Agg canvas, so no global pyplot state or backend is changed.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Literal

import numpy as np

from calibration import metrics
from calibration._checks import check_n_bins

__all__ = ["reliability_diagram"]


def reliability_diagram(
    curves: dict[str, tuple[Any, Any]],
    path: str | Path,
    n_bins: int = 10,
    mode: Literal["top", "classwise", "binary"] = "top",
    title: str | None = None,
) -> Path:
    """Draw the reliability diagram of each ``name -> (probs, labels)`` and save a PNG.

    Top panel: per-bin accuracy against per-bin mean confidence (``metrics.reliability_data``),
    one line per method, the diagonal for perfect calibration; the legend gives each method's
    conf-ECE (mode="top") or cw-ECE (mode="classwise"). Bottom panel: the share of samples in
    each bin. probs (N, K), labels (N,). ``mode="binary"``: each curve is (confidence (N,),
    correct (N,)) — one confidence per question in the answer it gave, as in open QA — binned as
    `calibration.semantic.semantic_ece` bins them (the legend gives that ECE). Returns the path
    written (parents are created).
    The PNG is written whole or not at all: a full disk or a kill while saving leaves the
    previous file (if any) in place, never a cut one.
    """
    if not curves:
        raise ValueError("curves is empty: give at least one name -> (probs, labels)")
    if mode not in ("top", "classwise", "binary"):
        raise ValueError(f"mode must be 'top', 'classwise' or 'binary', got {mode!r}")
    n_bins = check_n_bins(n_bins)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 6.5))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 1, height_ratios=(3, 1), hspace=0.08)
    ax, hist = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect calibration")
    width = 1.0 / n_bins
    n_curves = len(curves)
    for i, (name, (probs, labels)) in enumerate(curves.items()):
        data, err = _curve(probs, labels, n_bins, mode)
        keep = data.count > 0
        ece_name = "cw-ECE" if mode == "classwise" else "ECE"
        (line,) = ax.plot(
            data.confidence[keep], data.accuracy[keep], marker="o", markersize=4,
            label=f"{name} ({ece_name} {err:.3f})",
        )
        # Side-by-side bars per bin, one slot per method.
        offsets = data.bin_lower + width * (i + 0.5) / n_curves
        share = data.count / max(int(data.count.sum()), 1)
        hist.bar(offsets, share, width=width / n_curves, color=line.get_color(), alpha=0.8)
    xlabel = {"top": "confidence (max probability)", "classwise": "predicted probability p_j",
              "binary": "confidence in the answer given"}[mode]
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="frequency of y = j" if mode == "classwise" else "accuracy")
    ax.set_xticklabels([])
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    if title:
        ax.set_title(title)
    hist.set(xlim=(0, 1), xlabel=xlabel, ylabel="share")
    hist.set_xticks(np.linspace(0, 1, 6))
    hist.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _save_atomic(fig, out)
    return out


def _curve(
    a: Any, b: Any, n_bins: int, mode: Literal["top", "classwise", "binary"]
) -> tuple[metrics.ReliabilityData, float]:
    """(per-bin data, the ECE its legend shows) of one curve."""
    if mode == "binary":
        from calibration import semantic

        return semantic.binary_reliability_data(a, b, n_bins), semantic.semantic_ece(a, b, n_bins)
    err = (metrics.conf_ece if mode == "top" else metrics.cw_ece)(a, b, n_bins=n_bins)
    return metrics.reliability_data(a, b, n_bins=n_bins, mode=mode), err


def _save_atomic(fig: Any, out: Path) -> None:
    """``fig.savefig`` to a temporary file in ``out``'s folder, flushed to disk, then renamed
    over ``out`` (os.replace is atomic). The same scheme as the app's results files; written
    out here because calibration does not depend on the app."""
    # os.open with mode 0o666 (not mkstemp's 0o600): the umask applies, so the PNG ends with
    # the permissions a plain savefig would have given it
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png", dpi=120, bbox_inches="tight")
            fh.flush()
            os.fsync(fh.fileno())  # the rename must not reach the disk before the bytes do
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
