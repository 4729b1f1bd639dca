"""Every training step on record: ``history_<method>.jsonl``, ``training_<method>.png`` and,
with ``--report-to tensorboard``, TensorBoard scalars.

One JSON object per optimizer step (``{"step": k, "loss": ..., "lambda": ..., ...}``; the keys a
method reports, see docs/calm.md "What each step records"). The file is rewritten from the
checkpoint's history when a run resumes, then appended to step by step, so it never holds a gap
or a step twice: the steps after the last checkpoint are recomputed identically on resume.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import DataError
from .io import atomic_write_text

# panels of the training figure: (title, keys drawn); a panel is drawn when a key is present
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("losses", ("lower_loss", "upper_loss", "lower_loss_solution", "loss")),
    ("BOME λ and φ-control", ("lambda", "cos", "cos_outer", "cos_inner")),
    ("calibration batch", ("calib_entropy", "calib_confidence", "calib_accuracy")),
    ("α: τ range", ("alpha_tau_min", "alpha_tau_median", "alpha_tau_max")),
    ("α: shift range", ("alpha_l_min", "alpha_l_median", "alpha_l_max")),
)


def history_path(run_dir: str | Path, method: str) -> Path:
    return Path(run_dir) / f"history_{method}.jsonl"


class HistoryWriter:
    """Appends one line per step; ``start(history)`` rewrites the file from a restored history."""

    def __init__(self, run_dir: str | Path, method: str, *, enabled: bool = True,
                 tensorboard: bool = False) -> None:
        self.path = history_path(run_dir, method)
        self.enabled = enabled
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard" / method))

    def start(self, history: Sequence[dict[str, float]]) -> None:
        """The file holds exactly ``history`` (the steps a resumed run keeps)."""
        if not self.enabled:
            return
        atomic_write_text(self.path, "".join(_line(h) for h in history))

    def append(self, record: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(_line(record))
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _line(record: dict[str, Any]) -> str:
    # NaN/inf are not JSON: write them as null (a diverged step stays visible as a gap)
    clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
             for k, v in record.items()}
    return json.dumps(clean, sort_keys=False) + "\n"


def read_history(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``history_<method>.jsonl`` file."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {n} is not JSON ({e.msg}); the file is damaged. Restore it "
                    "from a copy, or delete it (the same steps are kept in the method's final "
                    "checkpoint, checkpoints/<method>/state.json, under 'history')") from e
    return out


def plot_training(history: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """``training_<method>.png``: one panel per group of `PANELS` the history has, against the
    optimizer step. Written to a temporary file and renamed (never a half-written PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not history:
        raise ValueError("plot_training: the history is empty")
    keys = set().union(*(h.keys() for h in history))
    panels = [(t, [k for k in ks if k in keys]) for t, ks in PANELS]
    panels = [(t, ks) for t, ks in panels if ks]
    if "lower_loss" in keys:  # "loss" repeats the lower loss for the bilevel methods
        panels = [(t, [k for k in ks if k != "loss"]) for t, ks in panels]
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.6 * cols, 3.3 * rows))
    FigureCanvasAgg(fig)
    steps = [h["step"] for h in history]
    for i, (name, ks) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for k in ks:
            ys = [h.get(k) for h in history]
            ax.plot(steps, [math.nan if y is None else y for y in ys], label=k, lw=1.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    tmp.replace(out)
    return out
