"""Calibration metrics over predicted probabilities and integer labels.

Shapes: ``probs`` is (N, K) with rows summing to 1 (see ``_checks.ROW_SUM_ATOL``), ``labels`` is
(N,) with integer classes in [0, K). Both may be torch tensors or numpy arrays; every metric
returns a Python float computed in float64. Every metric also takes ``from_logits=True``, in which
case the first argument is (N, K) logits (−inf allowed for absent classes) turned into
probabilities by a float64 softmax. Bins follow ``calibration.binning`` (equal width,
[k/n, (k+1)/n), last bin closed). Formulas, with conf_i = max_j p_ij, pred_i = argmax_j p_ij,
and B_k the samples whose confidence falls in bin k:

- accuracy = (1/N) Σ_i 1[pred_i = y_i]
- conf_ece = Σ_k (|B_k|/N) |acc(B_k) − conf(B_k)|       (Guo et al. 2017; CFT; CALM)
- mce      = max_{k: B_k ≠ ∅} |acc(B_k) − conf(B_k)|
- cw_ece   = (1/K) Σ_j Σ_k (|B_jk|/N) |mean_{B_jk} 1[y=j] − mean_{B_jk} p_j|, each class's
  probability p_j binned on its own (the CFT paper's classwise ECE, any K)
- brier    = (1/N) Σ_i Σ_j (p_ij − 1[y_i = j])²          (multiclass Brier, range [0, 2])
- nll      = −(1/N) Σ_i log max(p_{i,y_i}, eps)
- smooth_ece: kernel smooth ECE of the top-label confidence (``calibration.smooth_ece``)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from calibration._checks import check_n_bins, check_probs, check_probs_labels
from calibration.binning import (
    Binning,
    bin_index,
    bin_stats,
    ece_from_bins,
    mass_edges,
    width_edges,
)
from calibration.smooth_ece import smooth_ece_binary
from calibration.stats import Resampler, check_level, percentile_interval

__all__ = [
    "SUMMARY",
    "Interval",
    "ReliabilityData",
    "SummaryMetric",
    "accuracy",
    "bootstrap",
    "brier",
    "conf_ece",
    "cw_ece",
    "mce",
    "mean_confidence",
    "nll",
    "reliability_data",
    "smooth_ece",
    "summary",
]


def _top_label(p: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence, correctness) of the top-label prediction, both float64 of shape (N,)."""
    conf, pred = p.max(dim=1)
    return conf, (pred == y).to(torch.float64)


def accuracy(probs: Any, labels: Any, *, from_logits: bool = False) -> float:
    """Top-1 accuracy (1/N) Σ_i 1[argmax_j p_ij = y_i]. probs (N, K), labels (N,)."""
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    return float(_top_label(p, y)[1].mean())


def mean_confidence(probs: Any, *, from_logits: bool = False) -> float:
    """Mean top-label confidence (1/N) Σ_i max_j p_ij. probs (N, K)."""
    return float(check_probs(probs, from_logits=from_logits).max(dim=1).values.mean())


def conf_ece(
    probs: Any, labels: Any, n_bins: int = 10, binning: Binning = "width", *, from_logits: bool = False
) -> float:
    """Top-label (confidence) ECE: Σ_k (|B_k|/N) |acc(B_k) − conf(B_k)|.

    Args:
        probs: (N, K) probabilities. labels: (N,) ints in [0, K).
        n_bins: number of bins (10 in the CFT and CALM papers).
        binning: "width" (equal-width bins, the papers' choice) or "mass" (equal-count bins,
            quantile edges; less sensitive to where confidences cluster).
    Returns: ECE in [0, 1].
    """
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    conf, correct = _top_label(p, y)
    return ece_from_bins(*bin_stats(conf, correct, check_n_bins(n_bins), binning))


def mce(
    probs: Any, labels: Any, n_bins: int = 10, binning: Binning = "width", *, from_logits: bool = False
) -> float:
    """Maximum calibration error: max over non-empty bins of |acc(B_k) − conf(B_k)|.

    Same arguments and bins as ``conf_ece``. Returns a value in [0, 1].
    """
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    conf, correct = _top_label(p, y)
    count, mean_conf, mean_out = bin_stats(conf, correct, check_n_bins(n_bins), binning)
    nonempty = count > 0
    return float((mean_out[nonempty] - mean_conf[nonempty]).abs().max())


def cw_ece(probs: Any, labels: Any, n_bins: int = 10, *, from_logits: bool = False) -> float:
    """Classwise ECE as the CFT paper defines it, for any K.

    cw_ece = (1/K) Σ_j Σ_k (|B_jk|/N) |mean_{i∈B_jk} 1[y_i=j] − mean_{i∈B_jk} p_ij|, where
    B_jk are the samples whose probability for class j falls in equal-width bin k (each class's
    column is binned on its own, over all N samples). probs (N, K), labels (N,).
    """
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    n, k = p.shape
    n_bins = check_n_bins(n_bins)
    onehot = torch.nn.functional.one_hot(y, k).to(torch.float64)
    # Bin all K columns at once: flatten (sample, class) pairs into n_bins * K groups.
    idx = bin_index(p, n_bins, "width") + n_bins * torch.arange(k).unsqueeze(0)
    flat = idx.reshape(-1)
    p_sum = torch.zeros(n_bins * k, dtype=torch.float64).index_add_(0, flat, p.reshape(-1))
    y_sum = torch.zeros(n_bins * k, dtype=torch.float64).index_add_(0, flat, onehot.reshape(-1))
    # Σ_k (|B_jk|/N)|ȳ − p̄| = (1/N) Σ_k |Σ_{B_jk} y − Σ_{B_jk} p|: no division by empty counts.
    return float((y_sum - p_sum).abs().sum() / (n * k))


def brier(probs: Any, labels: Any, *, from_logits: bool = False) -> float:
    """Multiclass Brier score (1/N) Σ_i Σ_j (p_ij − 1[y_i=j])², in [0, 2]. probs (N, K)."""
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    onehot = torch.nn.functional.one_hot(y, p.shape[1]).to(torch.float64)
    return float(((p - onehot) ** 2).sum(dim=1).mean())


def nll(probs: Any, labels: Any, eps: float = 1e-12, *, from_logits: bool = False) -> float:
    """Negative log-likelihood −(1/N) Σ_i log max(p_{i,y_i}, eps).

    ``eps`` keeps one zero-probability label from making the mean infinite; it caps each term
    at −log(eps) ≈ 27.6 for the default. probs (N, K), labels (N,).
    """
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    return float(-p.gather(1, y[:, None]).clamp_min(eps).log().mean())


def smooth_ece(probs: Any, labels: Any, *, from_logits: bool = False) -> float:
    """Smooth ECE (Błasiok & Nakkiran 2023) of the top-label confidence vs correctness.

    Bin-free: the residual 1[pred=y] − conf is smoothed with a reflected Gaussian kernel whose
    width σ* is the fixed point smECE_σ* = σ* (see ``calibration.smooth_ece``). probs (N, K).
    """
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    conf, correct = _top_label(p, y)
    return smooth_ece_binary(conf, correct).value


@dataclass(frozen=True)
class Interval:
    """A point estimate with a bootstrap percentile interval [low, high]."""

    estimate: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.estimate:.4f} [{self.low:.4f}, {self.high:.4f}]"


def bootstrap(
    metric: Callable[[Any, Any], float],
    probs: Any,
    labels: Any,
    n: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    *,
    from_logits: bool = False,
) -> Interval:
    """Percentile bootstrap interval for any ``metric(probs, labels) -> float``.

    Draws ``n`` resamples of the N samples with replacement (numpy Generator seeded by
    ``seed``), evaluates the metric on each, and returns the metric on the full data with the
    ((1 − level)/2, (1 + level)/2) quantiles of the resampled values. The metric receives
    validated float64 / int64 CPU torch tensors. Use
    ``functools.partial(conf_ece, n_bins=15)`` to pass metric options.
    """
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    return percentile_bootstrap(metric, p, y, n=n, seed=seed, level=level)


def percentile_bootstrap(
    metric: Callable[[torch.Tensor, torch.Tensor], float],
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    n: int,
    seed: int,
    level: float,
    skip_nan: bool = False,
) -> Interval:
    """The resampling of `bootstrap` on two validated row-aligned tensors (N, ...) and (N, ...):
    the one-seed case of ``calibration.stats.Resampler`` (``n`` draws of N rows with replacement
    from ``numpy.random.default_rng(seed)``) and its ``percentile_interval`` at ``level``;
    ``skip_nan`` leaves NaN resamples out (NaN bounds when every resample is NaN)."""
    check_level(level)  # before the n draws, not after
    draws = Resampler(a.shape[0], n=n, seed=seed)
    values = draws.values(lambda _, idx: metric(a[torch.from_numpy(idx)], b[torch.from_numpy(idx)]))
    low, high = percentile_interval(values, level, skip_nan=skip_nan)
    return Interval(estimate=float(metric(a, b)), low=low, high=high)


@dataclass(frozen=True)
class ReliabilityData:
    """Per-bin statistics for a reliability diagram; arrays of shape (n_bins,).

    ``confidence`` and ``accuracy`` are NaN for empty bins (``count == 0``). In classwise mode
    the "accuracy" is the frequency of the event y = j among (sample, class j) pairs.
    """

    bin_lower: np.ndarray
    bin_upper: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray
    count: np.ndarray

    @classmethod
    def from_bins(
        cls, edges: torch.Tensor, count: torch.Tensor, confidence: torch.Tensor, accuracy: torch.Tensor
    ) -> ReliabilityData:
        """From the (n_bins + 1,) edges and the (n_bins,) tensors `bin_stats` returns."""
        return cls(bin_lower=edges[:-1].numpy(), bin_upper=edges[1:].numpy(),
                   confidence=confidence.numpy(), accuracy=accuracy.numpy(),
                   count=count.numpy().astype(np.int64))


def reliability_data(
    probs: Any,
    labels: Any,
    n_bins: int = 10,
    mode: Literal["top", "classwise"] = "top",
    binning: Binning = "width",
    *,
    from_logits: bool = False,
) -> ReliabilityData:
    """Per-bin mean confidence, accuracy and count for a reliability diagram.

    mode="top": bins the top-label confidence max_j p_ij against correctness (N points).
    mode="classwise": pools all N·K (sample, class) pairs, binning p_ij against 1[y_i = j];
    this is the pooled picture of what ``cw_ece`` averages per class.
    """
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    n_bins = check_n_bins(n_bins)
    if mode == "top":
        conf, outcome = _top_label(p, y)
    elif mode == "classwise":
        conf = p.reshape(-1)
        outcome = torch.nn.functional.one_hot(y, p.shape[1]).to(torch.float64).reshape(-1)
    else:
        raise ValueError(f"mode must be 'top' or 'classwise', got {mode!r}")
    count, mean_conf, mean_out = bin_stats(conf, outcome, n_bins, binning)
    edges = width_edges(n_bins) if binning == "width" else mass_edges(conf, n_bins)
    return ReliabilityData.from_bins(edges, count, mean_conf, mean_out)


@dataclass(frozen=True)
class SummaryMetric:
    """One entry of :data:`SUMMARY`: ``fn(probs (N, K) float64, labels (N,), n_bins) -> float``;
    ``better`` is "max", "min", or None for a descriptive number (mean confidence); ``label``
    is the column heading a report gives it."""

    name: str
    label: str
    better: Literal["max", "min"] | None
    fn: Callable[[torch.Tensor, torch.Tensor, int], float]


# The one table of headline metrics: `summary` computes exactly these, in this order, and every
# report (a run's metrics.json and results table, a study's summary) reads its columns from here,
# so a metric added here reaches all of them with no other edit.
SUMMARY: tuple[SummaryMetric, ...] = (
    SummaryMetric("accuracy", "Acc", "max", lambda p, y, b: accuracy(p, y)),
    SummaryMetric("conf_ece", "conf-ECE", "min", lambda p, y, b: conf_ece(p, y, n_bins=b)),
    SummaryMetric("cw_ece", "cw-ECE", "min", lambda p, y, b: cw_ece(p, y, n_bins=b)),
    SummaryMetric("mce", "MCE", "min", lambda p, y, b: mce(p, y, n_bins=b)),
    SummaryMetric("brier", "Brier", "min", lambda p, y, b: brier(p, y)),
    SummaryMetric("nll", "NLL", "min", lambda p, y, b: nll(p, y)),
    SummaryMetric("mean_confidence", "confidence", None, lambda p, y, b: mean_confidence(p)),
    SummaryMetric("smooth_ece", "smooth ECE", "min", lambda p, y, b: smooth_ece(p, y)),
)
"""The headline metrics, in order: what :func:`summary` computes and every report's columns
(a run's ``metrics.json`` and results table, a study's summary). Adding an entry is the one
edit a new metric needs."""


def summary(probs: Any, labels: Any, n_bins: int = 10, *, from_logits: bool = False) -> dict[str, float]:
    """Every metric of :data:`SUMMARY` at once, ``{name: float}`` in the table's order: accuracy,
    conf_ece, cw_ece, mce, brier, nll, mean_confidence, smooth_ece."""
    p, y = check_probs_labels(probs, labels, from_logits=from_logits)
    return {m.name: float(m.fn(p, y, n_bins)) for m in SUMMARY}
