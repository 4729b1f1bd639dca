"""The study's question-level numbers: pooled intervals, paired differences, the primary
comparisons decided with Holm, and accuracy against chance.

Every number comes from one hierarchical bootstrap per dataset (``calibration.stats``): each
resample draws the row's training seeds with replacement, then the questions with replacement,
one draw scored under every drawn seed (the seeds answered the same questions). The draws of a
dataset are made once and shared by all its rows, and rows run with the same seeds share the
seed draws too, so a row minus a baseline is computed on identical resamples (paired). A row
with one seed (``none``, ``ts``: nothing random) has no seed level, and its interval is the
single-run bootstrap of the same questions.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from apps.study.design import Comparison
from apps.study.questions import Questions, aligned
from calibration.stats import Resampler, holm, p_value, percentile_interval

METRICS: dict[str, Callable[[Questions, np.ndarray], float]] = {
    "error": Questions.error, "accuracy": Questions.accuracy}


class DatasetDraws:
    """The bootstrap of one dataset: ``n_boot`` shared resamples of its N questions, and each
    row's resampled mean-over-seeds error and accuracy, computed once per row."""

    def __init__(self, n_questions: int, *, n_boot: int = 1000, seed: int = 0) -> None:
        self.draws = Resampler(n_questions, n=n_boot, seed=seed)
        self._rows: dict[Hashable, dict[str, np.ndarray]] = {}

    def values(self, key: Hashable, seeds: list[Questions],
               labels: Sequence[Hashable] | None = None) -> dict[str, np.ndarray]:
        """``{"error": (n_boot,), "accuracy": (n_boot,)}`` of the row ``key`` whose seeds
        ``labels`` (default 0..S−1) gave the predictions ``seeds``: on each resample the mean
        over the drawn seeds (with repeats) of the metric on the drawn questions."""
        if key not in self._rows:
            labels = tuple(range(len(seeds))) if labels is None else tuple(labels)
            if len(labels) != len(seeds):
                raise ValueError(f"row {key}: {len(labels)} seed labels for {len(seeds)} seeds")

            def mean_over_seeds(metric: Callable[[Questions, np.ndarray], float]) -> Any:
                def statistic(s: np.ndarray, q: np.ndarray) -> float:
                    drawn, times = np.unique(s, return_counts=True)  # each seed scored once
                    return float(np.dot(times, [metric(seeds[i], q) for i in drawn]) / len(s))
                return statistic

            self._rows[key] = {name: self.draws.values(mean_over_seeds(m), labels)
                               for name, m in METRICS.items()}
        return self._rows[key]


def _full(seeds: list[Questions], metric: str) -> float:
    """The row's number on the data itself: the mean over its seeds on every question."""
    every = np.arange(seeds[0].n)
    return float(np.mean([METRICS[metric](q, every) for q in seeds]))


def pooled_interval(seeds: list[Questions], *, n_boot: int = 1000, seed: int = 0,
                    labels: Sequence[Hashable] | None = None,
                    draws: DatasetDraws | None = None, key: Hashable = "row") -> tuple[float, float]:
    """95 % percentile interval of a row's mean-over-seeds calibration error (conf-ECE or
    Semantic-ECE) from the hierarchical bootstrap (seeds, then questions). ``draws`` shares
    the resamples of a dataset between rows (``key`` names the row in it)."""
    aligned(seeds)
    draws = draws or DatasetDraws(seeds[0].n, n_boot=n_boot, seed=seed)
    return percentile_interval(draws.values(key, seeds, labels)["error"])


def paired_difference(a: list[Questions], b: list[Questions], *, n_boot: int = 1000,
                      seed: int = 0, labels: tuple[Sequence[Hashable], Sequence[Hashable]] | None = None,
                      draws: DatasetDraws | None = None,
                      keys: tuple[Hashable, Hashable] = ("a", "b")) -> dict[str, dict[str, Any]]:
    """Row a minus row b on the same questions, for the calibration error (key ``conf_ece`` or
    ``semantic_ece``) and accuracy, each averaged over the row's seeds: the difference, its 95 %
    interval from the shared hierarchical resamples (paired: the same question draws for both;
    the same seed draws where the rows share their seeds, ``labels`` = (a's, b's), default
    0..S−1 each), ``p_not_better`` (share of resamples where a is not better) and ``p`` (the
    two-sided bootstrap p-value of no difference)."""
    _, error_name = aligned(a, b)
    draws = draws or DatasetDraws(a[0].n, n_boot=n_boot, seed=seed)
    la, lb = labels or (None, None)
    va, vb = draws.values(keys[0], a, la), draws.values(keys[1], b, lb)
    out = {}
    for name, metric, lower_better in ((error_name, "error", True), ("accuracy", "accuracy", False)):
        boot = va[metric] - vb[metric]
        worse = boot >= 0 if lower_better else boot <= 0
        out[name] = {"diff": _full(a, metric) - _full(b, metric),
                     "ci": list(percentile_interval(boot)),
                     "p_not_better": float(worse.mean()), "p": p_value(boot)}
    return out


def decide(primary: Sequence[Comparison], paired: Callable[[Comparison], dict[str, Any] | None],
           *, alpha: float = 0.05) -> list[dict[str, Any]]:
    """The study's primary comparisons as one Holm family at family-wise level ``alpha``.

    ``paired(c)`` gives ``paired_difference``'s entry for comparison c's metric (None when a
    row has no question-level predictions: listed as missing, left out of the family). Each
    entry gets ``p_holm`` and ``verdict``: "row lower" / "row higher" when Holm rejects a zero
    difference, else "cannot tell".
    """
    out = [{"row": c.row, "baseline": c.baseline, "dataset": c.dataset, "metric": c.metric,
            "claim": c.claim, **(paired(c) or {"missing": True})} for c in primary]
    tested = [e for e in out if not e.get("missing")]
    if tested:
        for e, adj in zip(tested, holm([e["p"] for e in tested]), strict=True):
            e["p_holm"] = float(adj)
            e["verdict"] = ("cannot tell" if adj > alpha else
                            "row lower" if e["diff"] < 0 else "row higher")
    return out


def against_chance(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy of one prediction against picking an option uniformly at random.

    ``probs``: (N, K_max) option probabilities, zero-padded past each question's K_i options;
    ``labels``: (N,). Chance accuracy is mean_i 1/K_i; under chance the number right has mean
    Σ 1/K_i and variance Σ (1/K_i)(1 − 1/K_i), and ``z`` is the standardized number right. K_i
    counts the nonzero probabilities, so an option whose probability underflows to 0 in float32
    (≥ 100 nats below the best) is not counted: chance can only be overstated, never understated.
    """
    p = 1.0 / np.maximum((probs > 0).sum(axis=1), 1)
    right = float((probs.argmax(axis=1) == labels).sum())
    sd = float(np.sqrt(np.sum(p * (1 - p))))
    n = labels.shape[0]
    return {"n": n, "accuracy": right / n, "chance": float(p.mean()),
            "z": (right - float(p.sum())) / sd if sd > 0 else 0.0}

