"""A cell's question-level predictions, as the study's intervals and paired tests resample
them: one ``Questions`` per (seed, row, dataset), read back from the run directory."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _predictions(run_dir: Path) -> dict[str, Any]:
    """The cell's saved option probabilities, or ``{}`` for a published cell kept without them."""
    from safetensors.torch import load_file

    f = run_dir / "predictions.safetensors"
    return load_file(str(f)) if f.is_file() else {}


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: no elementwise ==, no hash
class Questions:
    """One seed's predictions of one row on a dataset's N questions, as the question-level
    numbers (pooled intervals, paired differences) resample them.

    Multiple choice (``options``): ``x`` the option probabilities (N, K), ``y`` the labels (N,);
    the calibration error is conf-ECE. Open QA (``binary``): ``x`` the semantic-cluster
    confidence (N,), ``y`` whether the modal sampled answer is right (N,); the calibration error
    is Semantic-ECE (the same equal-width binning over a binary outcome). ``ids`` name the
    questions where the run saved them, so rows are only paired on the same questions; ``n_bins``
    is the run's ``--n-bins``, so the intervals bin as its ``metrics.json`` means do.
    """

    kind: str  # "options" | "binary"
    x: np.ndarray
    y: np.ndarray
    ids: tuple[str, ...] | None = None
    n_bins: int = 10

    @classmethod
    def options(cls, probs: np.ndarray, labels: np.ndarray, *, n_bins: int = 10) -> Questions:
        return cls("options", np.asarray(probs, dtype=np.float64), np.asarray(labels), n_bins=n_bins)

    @classmethod
    def binary(cls, confidence: np.ndarray, correct: np.ndarray,
               ids: Sequence[str] | None = None, *, n_bins: int = 10) -> Questions:
        return cls("binary", np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=bool),
                   None if ids is None else tuple(ids), n_bins)

    @property
    def n(self) -> int:
        return int(self.y.shape[0])

    @property
    def error_name(self) -> str:
        """The calibration error's key in ``study.json``: ``conf_ece`` or ``semantic_ece``."""
        return "conf_ece" if self.kind == "options" else "semantic_ece"

    def error(self, idx: np.ndarray) -> float:
        """conf-ECE (options) or Semantic-ECE (binary) of the questions ``idx`` (with repeats)."""
        import torch

        if self.kind == "options":
            from calibration.metrics import conf_ece

            return conf_ece(torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx]),
                            n_bins=self.n_bins)
        from calibration.semantic import semantic_ece

        return semantic_ece(torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx]), self.n_bins)

    def accuracy(self, idx: np.ndarray) -> float:
        """Top-option accuracy (options) or the modal answer's (binary) of the questions ``idx``."""
        if self.kind == "options":
            import torch

            from calibration.metrics import accuracy

            return accuracy(torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx]))
        return float(np.mean(self.y[idx]))


def aligned(*rows: list[Questions]) -> tuple[int, str]:
    """The common number of questions and calibration-error name of rows' seeds; a clear error
    when they are not predictions of the same kind on the same questions."""
    seeds = [q for row in rows for q in row]
    if not seeds:
        raise ValueError("no seeds to resample")
    first = seeds[0]
    for q in seeds[1:]:
        if q.kind != first.kind or q.n != first.n or q.n_bins != first.n_bins:
            raise ValueError(f"seeds disagree on the questions: {q.kind} N={q.n} n_bins={q.n_bins} "
                             f"vs {first.kind} N={first.n} n_bins={first.n_bins}")
        differ = (q.ids != first.ids if q.ids is not None and first.ids is not None else
                  q.kind == "options" and not np.array_equal(q.y, first.y))  # same labels
        if differ:
            raise ValueError("seeds answered different questions (their ids or labels differ); "
                             "run every cell with the same --split-seed")
    return first.n, first.error_name


def load(run_dir: Path) -> dict[tuple[str, str], Questions]:
    """(row, dataset) -> the cell's question-level predictions: the option probabilities of
    ``predictions.safetensors`` (multiple choice; (N, K_max), zero-padded options), or the
    semantic-cluster confidence and modal correctness of the records an open-QA run keeps; empty
    for a published cell kept without them."""
    out: dict[tuple[str, str], Questions] = {}
    config = run_dir / "config.json"
    n_bins = int(json.loads(config.read_text()).get("n_bins", 10)) if config.is_file() else 10
    preds = _predictions(run_dir)
    for name, p in preds.items():
        row, ds, what = name.rsplit("/", 2)
        if what == "probs":
            out[(row, ds)] = Questions.options(p.double().numpy(), preds[f"{row}/{ds}/labels"].numpy(),
                                               n_bins=n_bins)
    from apps.calm_llm.open_qa import score

    for row, per_ds in score.read_records(run_dir).items():
        for ds, records in per_ds.items():
            if not records:
                continue
            # the semantic kind keeps every record (verbalized would drop unparsed ones), so the
            # ids line up with the pairs
            conf, correct = score.confidence_pairs(records, "semantic")
            out[(row, ds)] = Questions.binary(conf.numpy(), correct.numpy(), [r.id for r in records],
                                              n_bins=n_bins)
    return out
