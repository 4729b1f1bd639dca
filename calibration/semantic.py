"""Calibration of free-form answers: normalization, semantic clusters, Semantic-ECE, baselines.

The protocol (sampling-based confidence for open-ended QA, as in the CALM paper's generative
experiment and Kuhn et al. 2023's semantic clusters): sample n answers to a question, partition
them into clusters of equivalent answers, and take

- confidence  = |largest cluster| / n                          (`cluster_confidence`)
- split-half  = mean over S random splits of the n samples into halves A, B of the share of B
  that falls in A's largest cluster                           (`split_half_confidence`)
- correctness = the modal answer (a representative of the largest cluster) matches a gold
  alias after normalization                                    (`modal_answer`, `matches`);
  ``matches(..., question=q)`` leaves out the aliases the question itself contains (no credit
  for repeating the question), and `token_f1` is the SQuAD/TriviaQA token F1 reported beside it
- Semantic-ECE = Σ_k (|B_k|/N) |acc(B_k) − conf(B_k)| over N questions, 10 equal-width bins
  of the confidence (`semantic_ece`; the bins of `calibration.binning`)

Equivalence backends (`ClusterBackend`: ``cluster(answers, question=None) -> ids``): `ExactMatch`
on normalized text (the default, needs nothing), `EmbeddingSimilarity` (cosine similarity of
sentence embeddings against each cluster's first member, e.g. all-MiniLM-L6-v2 through
`apps.calm_llm.semantic_models.sentence_embedder`), `BidirectionalEntailment` (Kuhn et al.'s
test: A entails B and B entails A, from any entailment function, e.g. an NLI model through
`apps.calm_llm.semantic_models.nli_entailment`). This module loads no model: it takes functions.

The pieces live in their own modules, all re-exported here: `calibration.answers`
(normalization, matching, token F1), `calibration.clusters` (the backends and the confidences
read from cluster ids), `calibration.confidence_baselines` (the baselines); this module holds
the metrics over (confidence, correctness) pairs.

Baselines beside it: length-normalized sequence probability, mean and min token probability of
one answer's tokens (`sequence_probability`, `mean_token_probability`, `min_token_probability`)
and a verbalized 0–100 confidence read from text (`parse_verbalized_confidence`). See
docs/open_qa.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from calibration._checks import as_float64, check_n_bins
from calibration.answers import matches, normalize_answer, token_f1
from calibration.binning import bin_stats, ece_from_bins, width_edges
from calibration.clusters import (
    BidirectionalEntailment,
    ClusterBackend,
    EmbeddingSimilarity,
    Entailment,
    ExactMatch,
    cluster_confidence,
    cluster_sizes,
    modal_answer,
    modal_cluster,
    split_half_confidence,
)
from calibration.confidence_baselines import (
    mean_token_probability,
    min_token_probability,
    parse_verbalized_confidence,
    sequence_probability,
)
from calibration.metrics import Interval, ReliabilityData, percentile_bootstrap

__all__ = [
    "BidirectionalEntailment",
    "ClusterBackend",
    "EmbeddingSimilarity",
    "Entailment",
    "ExactMatch",
    "auroc",
    "binary_reliability_data",
    "bootstrap_binary",
    "brier_binary",
    "cluster_confidence",
    "cluster_sizes",
    "matches",
    "mean_token_probability",
    "min_token_probability",
    "modal_answer",
    "modal_cluster",
    "normalize_answer",
    "parse_verbalized_confidence",
    "semantic_ece",
    "semantic_summary",
    "sequence_probability",
    "split_half_confidence",
    "token_f1",
]


# ---- metrics over (confidence, correctness) pairs -------------------------------------------
def _check_pairs(confidence: Any, correct: Any) -> tuple[torch.Tensor, torch.Tensor]:
    conf = as_float64(confidence, "confidence")
    corr = as_float64(correct, "correct")
    if conf.ndim != 1 or corr.ndim != 1:
        raise ValueError(
            f"confidence and correct must be 1-D, got shapes {tuple(conf.shape)} and {tuple(corr.shape)}"
        )
    if conf.shape != corr.shape:
        raise ValueError(f"{conf.shape[0]} confidences but {corr.shape[0]} correctness values")
    if conf.shape[0] == 0:
        raise ValueError("no questions: the metrics need at least one (confidence, correct) pair")
    if not torch.isfinite(conf).all() or (conf < 0).any() or (conf > 1).any():
        raise ValueError("confidence must be finite and lie in [0, 1]")
    if not ((corr == 0) | (corr == 1)).all():
        raise ValueError("correct must hold 0/1 or booleans")
    return conf, corr


def semantic_ece(confidence: Any, correct: Any, n_bins: int = 10) -> float:
    """Semantic-ECE: Σ_k (|B_k|/N) |acc(B_k) − conf(B_k)| over equal-width bins of the
    per-question confidence (``calibration.binning``: [k/n, (k+1)/n), last bin closed), with
    acc the mean correctness. confidence (N,) in [0, 1]; correct (N,) 0/1 or bool."""
    conf, corr = _check_pairs(confidence, correct)
    return ece_from_bins(*bin_stats(conf, corr, check_n_bins(n_bins)))


def brier_binary(confidence: Any, correct: Any) -> float:
    """(1/N) Σ_i (conf_i − correct_i)², in [0, 1]."""
    conf, corr = _check_pairs(confidence, correct)
    return float(((conf - corr) ** 2).mean())


def auroc(confidence: Any, correct: Any) -> float:
    """Area under the ROC curve of the confidence as a score for right (1) vs wrong (0):
    P(conf of a random right answer > conf of a random wrong one) + ½ P(equal).

    Computed from average ranks (the Mann–Whitney U statistic): (R₊ − n₊(n₊+1)/2) / (n₊ n₋),
    R₊ the rank sum of the right answers, ties given their mean rank. NaN when every answer is
    right or every answer is wrong (the curve is undefined)."""
    conf, corr = _check_pairs(confidence, correct)
    c, y = conf.numpy(), corr.numpy().astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(c, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)  # the 1-based rank of each distinct value's last occurrence
    mean_rank = upper - (counts - 1) / 2.0
    rank_sum = float(mean_rank[inverse][y].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def semantic_summary(confidence: Any, correct: Any, n_bins: int = 10) -> dict[str, float]:
    """semantic_ece, accuracy, brier, auroc and mean_confidence of (confidence, correct) pairs."""
    conf, corr = _check_pairs(confidence, correct)
    return {
        "semantic_ece": semantic_ece(conf, corr, n_bins),
        "accuracy": float(corr.mean()),
        "brier": brier_binary(conf, corr),
        "auroc": auroc(conf, corr),
        "mean_confidence": float(conf.mean()),
    }


def bootstrap_binary(
    metric: Callable[[torch.Tensor, torch.Tensor], float],
    confidence: Any,
    correct: Any,
    n: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> Interval:
    """Percentile bootstrap interval of ``metric(confidence, correct)`` over questions, drawn
    as ``calibration.metrics.bootstrap`` draws (numpy Generator seeded by ``seed``). Resamples
    where the metric is NaN (AUROC of a one-class resample) are left out of the quantiles."""
    conf, corr = _check_pairs(confidence, correct)
    return percentile_bootstrap(metric, conf, corr, n=n, seed=seed, level=level, skip_nan=True)


def binary_reliability_data(confidence: Any, correct: Any, n_bins: int = 10) -> ReliabilityData:
    """Per-bin mean confidence, accuracy and count of (confidence, correct) pairs, for
    ``calibration.plots.reliability_diagram``; the bins of `semantic_ece`."""
    conf, corr = _check_pairs(confidence, correct)
    n_bins = check_n_bins(n_bins)
    count, mean_conf, mean_out = bin_stats(conf, corr, n_bins)
    return ReliabilityData.from_bins(width_edges(n_bins), count, mean_conf, mean_out)

