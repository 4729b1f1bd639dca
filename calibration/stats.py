"""Bootstrap statistics over training seeds and test questions, and Holm's correction.

A study scores the same N test questions under S training seeds, so a row's number (say the
mean over seeds of conf-ECE) varies with both the seeds drawn and the questions drawn. The
hierarchical bootstrap (Davison & Hinkley 1997, §3.8; Saravanan et al. 2020, "Application of
the hierarchical bootstrap to multi-level data in neuroscience") resamples both levels:

1. the S seeds with replacement (S* = indices into the row's seeds, shape (S,));
2. then the N questions with replacement (Q* = indices into the questions, shape (N,)), and
   every resampled seed is scored on the same Q*: the seeds answered the same questions
   (seeds and questions are *crossed*, not nested), so a question drawn k times contributes k
   times to every seed, as it did in the data. Independent question draws per seed would treat
   the one shared question sample as S independent ones and shrink its variance by 1/S; drawing
   both factors independently and crossing them is Owen's (2007) "pigeonhole" bootstrap for
   crossed random effects, which is at worst slightly conservative.

The statistic is recomputed on (S*, Q*) ``n`` times, and the percentile interval is the
((1 − level)/2, (1 + level)/2) quantiles of those values. Rows are *paired* when they share
the resamples: every row of a dataset gets the same question draws, and rows run with the same
seeds the same seed draws, so a row minus a baseline is recomputed on identical (S*, Q*) and
question difficulty (and a shared seed's batch order and initialization) cancel in it.

With one seed the seed level draws nothing, and the question draws are exactly those of a
single run's bootstrap (``calibration.metrics.bootstrap``): the question stream comes from
``numpy.random.default_rng(seed)``, one ``integers(0, N, N)`` per resample, and the seed draws
from a second stream, so a one-seed row's interval equals the per-run interval.

Cost: ``n`` evaluations of the statistic; memory (n, N) + (n, S) integers.

Multiple comparisons: ``holm`` adjusts the p-values of a declared family of primary comparisons
(Holm 1979, "A simple sequentially rejective multiple test procedure"), controlling the
probability of any false rejection in the family at ``alpha`` whatever their dependence. The
p-values come from the same bootstrap (``p_value``, two-sided); Holm's step-down is defined on
p-values, and the confidence intervals compatible with it are not the plain percentile ones
(Strassburger & Bretz 2008), so intervals stay at their nominal level and the family-wise
decision is made on the adjusted p-values.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence

import numpy as np

__all__ = ["Resampler", "check_level", "holm", "p_value", "percentile_interval", "reject"]


def _check_count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class Resampler:
    """The hierarchical bootstrap draws of one dataset: ``n`` resamples of ``n_questions``.

    ``questions()`` is (n, N): row k is the k-th ``integers(0, N, N)`` of
    ``numpy.random.default_rng(seed)`` (the draws of a one-run bootstrap). ``seeds(labels)`` is
    (n, S) for a row run with the S training seeds ``labels``: zeros when S = 1 (nothing to
    draw), else drawn from a stream keyed by (seed, labels), so two rows with the same seeds
    get the same seed draws (paired) and rows with different seeds independent ones.
    """

    def __init__(self, n_questions: int, n: int = 1000, seed: int = 0) -> None:
        self.n_questions = _check_count(n_questions, "n_questions (questions per seed)")
        self.n = _check_count(n, "n (number of resamples)")
        self.seed = int(seed)
        self._questions: np.ndarray | None = None
        self._seeds: dict[tuple[Hashable, ...], np.ndarray] = {}

    def questions(self) -> np.ndarray:
        """(n, N) int64 question indices, shared by every row of the dataset."""
        if self._questions is None:
            rng = np.random.default_rng(self.seed)
            # one call per resample, as the one-run bootstrap draws them (a single (n, N) call
            # is not guaranteed to give the same stream)
            self._questions = np.stack([rng.integers(0, self.n_questions, self.n_questions)
                                        for _ in range(self.n)])
        return self._questions

    def seeds(self, labels: Sequence[Hashable]) -> np.ndarray:
        """(n, S) int64 indices into the row's S seeds ``labels``; the same array for the same
        labels."""
        key = tuple(labels)
        if not key:
            raise ValueError("labels (the row's training seeds) is empty: a row needs one seed")
        if key not in self._seeds:
            s = len(key)
            if s == 1:
                self._seeds[key] = np.zeros((self.n, 1), dtype=np.int64)
            else:
                # the seed stream is independent of the question stream and of other seed sets
                rng = np.random.default_rng([self.seed, zlib.crc32(repr(key).encode())])
                self._seeds[key] = rng.integers(0, s, size=(self.n, s))
        return self._seeds[key]

    def values(self, statistic: Callable[[np.ndarray, np.ndarray], float],
               labels: Sequence[Hashable] = (0,)) -> np.ndarray:
        """(n,) float64: ``statistic(seed_idx (S,), question_idx (N,))`` on every resample of a
        row run with seeds ``labels``."""
        seeds, questions = self.seeds(labels), self.questions()
        return np.array([statistic(seeds[k], questions[k]) for k in range(self.n)], dtype=np.float64)


def check_level(level: float) -> float:
    """``level`` if it is a confidence level in (0, 1), else a ValueError naming it."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}; 0.95 gives a 95 % interval")
    return level


def percentile_interval(values: np.ndarray, level: float = 0.95, *,
                        skip_nan: bool = False) -> tuple[float, float]:
    """The ((1 − level)/2, (1 + level)/2) quantiles of the resampled ``values`` (n,) (numpy's
    linear interpolation). ``skip_nan`` leaves NaN resamples out (NaN bounds when all are);
    without it a NaN resample gives NaN bounds."""
    check_level(level)
    v = np.asarray(values, dtype=np.float64)
    if skip_nan:
        v = v[~np.isnan(v)]
    if v.size == 0:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(v, [tail, 1.0 - tail])
    return float(low), float(high)


def p_value(values: np.ndarray, null: float = 0.0) -> float:
    """Two-sided bootstrap p-value of H0: statistic = ``null`` from the resampled ``values``
    (Davison & Hinkley 1997, §4.4): 2·min(#{v ≤ null} + 1, #{v ≥ null} + 1) / (n + 1), at most
    1. The +1 keeps it above 0 (the smallest is 2/(n + 1)); it is below 1 − level exactly when
    the percentile interval at ``level`` excludes ``null`` (up to one resample)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or np.isnan(v).any():
        raise ValueError(f"p_value needs finite resampled values, got {v.size} with "
                         f"{int(np.isnan(v).sum())} NaN; drop NaN resamples first")
    below, above = int((v <= null).sum()), int((v >= null).sum())
    return float(min(1.0, 2.0 * min(below + 1, above + 1) / (v.size + 1)))


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values of a family of m comparisons (Holm 1979).

    With p_(1) ≤ … ≤ p_(m) sorted, adj_(i) = max_{j ≤ i} min(1, (m − j + 1)·p_(j)), returned in
    the input order; comparison i is rejected at family-wise level α when adj_i ≤ α. Cost
    O(m log m).
    """
    p = np.asarray(p_values, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"p_values must be a non-empty 1-D sequence, got shape {p.shape}")
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"p_values must lie in [0, 1], got {p.tolist()}")
    order = np.argsort(p, kind="stable")
    m = p.size
    stepped = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.maximum.accumulate(stepped)
    return out


def reject(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Which comparisons of the family Holm rejects at family-wise error rate ``alpha``."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha (family-wise error rate) must lie in (0, 1), got {alpha!r}")
    return [bool(a <= alpha) for a in holm(p_values)]
