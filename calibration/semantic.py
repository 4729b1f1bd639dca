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

Baselines beside it: length-normalized sequence probability, mean and min token probability of
one answer's tokens (`sequence_probability`, `mean_token_probability`, `min_token_probability`)
and a verbalized 0–100 confidence read from text (`parse_verbalized_confidence`). See
docs/open_qa.md.
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import numpy as np
import torch

from calibration._checks import as_float64, check_n_bins
from calibration.binning import width_edges
from calibration.metrics import (
    Interval,
    ReliabilityData,
    _binned,
    _ece_from_bins,
    percentile_bootstrap,
)

__all__ = [
    "BidirectionalEntailment",
    "ClusterBackend",
    "EmbeddingSimilarity",
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

# ---- normalization --------------------------------------------------------------------------
# TriviaQA's official evaluation adds these to string.punctuation (quotes and accents that are
# not ASCII); every Unicode punctuation character (category P*) is treated alike as well.
_EXTRA_PUNCTUATION = frozenset(string.punctuation) | {"‘", "’", "´", "`"}
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _is_punctuation(ch: str) -> bool:
    return ch in _EXTRA_PUNCTUATION or unicodedata.category(ch).startswith("P")


def _strip_accents(text: str) -> str:
    """Drop combining marks after canonical decomposition: "é" (NFD: e + U+0301) -> "e"."""
    decomposed = unicodedata.normalize("NFD", text)
    kept = "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn")
    return unicodedata.normalize("NFC", kept)


def normalize_answer(
    text: str,
    *,
    punctuation: Literal["space", "delete"] = "space",
    strip_accents: bool = True,
) -> str:
    """SQuAD/TriviaQA answer normalization, made explicit about Unicode.

    Steps, in order: Unicode NFKC (compatibility forms: full-width "Ｐａｒｉｓ" -> "Paris", the
    ligature "ﬁ" -> "fi", a no-break space -> a space); case folding (``str.casefold``:
    "Straße" -> "strasse"); with ``strip_accents``, combining marks dropped after NFD
    ("Beyoncé" -> "beyonce"; neither official script does this, see docs/open_qa.md); "_" -> " ";
    punctuation (ASCII ``string.punctuation``, ‘ ’ ´ and every Unicode category-P character)
    replaced by a space (``"space"``, TriviaQA's script: "Campbell-Bannerman" -> "campbell
    bannerman") or deleted (``"delete"``, SQuAD's script: -> "campbellbannerman"); the whole
    words a / an / the removed anywhere; runs of whitespace collapsed to one space, ends stripped.
    """
    if punctuation not in ("space", "delete"):
        raise ValueError(f"punctuation must be 'space' or 'delete', got {punctuation!r}")
    out = unicodedata.normalize("NFKC", text).casefold()
    if strip_accents:
        out = _strip_accents(out)
    out = out.replace("_", " ")
    filler = " " if punctuation == "space" else ""
    out = "".join(filler if _is_punctuation(ch) else ch for ch in out)
    out = _ARTICLES.sub(" ", out)
    return " ".join(out.split())


def _occurs(phrase: str, text: str) -> bool:
    """Whether the normalized ``phrase`` occurs in the normalized ``text`` as whole words."""
    return f" {phrase} " in f" {text} "


def matches(
    answer: str,
    aliases: Sequence[str],
    *,
    mode: Literal["exact", "contains"] = "exact",
    question: str | None = None,
    **normalize: Any,
) -> bool:
    """Whether ``answer`` matches one of the gold ``aliases`` after `normalize_answer`.

    ``mode="exact"``: the normalized answer equals a normalized alias (TriviaQA's exact match).
    ``mode="contains"``: a normalized alias occurs in the normalized answer as whole words
    ("it was paris in 1900" contains "paris"), for models that answer in a sentence.
    ``question``: aliases that occur (whole words, normalized) in the question do not count, so
    an answer is not credited for repeating the question ("Which Cuban city is Havana's rival?"
    answered "the Cuban city of Havana" does not contain the alias "Havana"); a question whose
    every alias occurs in it can then match nothing. An answer that normalizes to "" ("The.")
    matches nothing, even an alias that also normalizes to "" (the band "The The").
    ``normalize`` is passed to `normalize_answer`.
    """
    if isinstance(aliases, str):
        raise TypeError("aliases must be a sequence of strings, not one string")
    norm = normalize_answer(answer, **normalize)
    if not norm:
        return False
    golds = {normalize_answer(a, **normalize) for a in aliases} - {""}
    if question is not None:
        asked = normalize_answer(question, **normalize)
        golds = {g for g in golds if not _occurs(g, asked)}
    if mode == "exact":
        return norm in golds
    if mode == "contains":
        return any(_occurs(g, norm) for g in golds)
    raise ValueError(f"mode must be 'exact' or 'contains', got {mode!r}")


def token_f1(answer: str, aliases: Sequence[str], **normalize: Any) -> float:
    """The SQuAD / TriviaQA token F1 of ``answer`` against its best gold alias.

    With P and G the multisets of whitespace tokens of the normalized answer and of a normalized
    alias, c = |P ∩ G| (multiset intersection): precision c/|P|, recall c/|G|,
    F1 = 2·precision·recall/(precision + recall), 0 when c = 0; the maximum over the aliases
    (Rajpurkar et al. 2016, SQuAD v1.1's evaluation script; TriviaQA's, Joshi et al. 2017, is the
    same with punctuation replaced by spaces, this function's default). An empty normalized
    answer scores 0, and so does an alias that normalizes to "". Cost O(Σ |alias| + |answer|).
    ``normalize`` is passed to `normalize_answer`.
    """
    if isinstance(aliases, str):
        raise TypeError("aliases must be a sequence of strings, not one string")
    predicted = Counter(normalize_answer(answer, **normalize).split())
    best = 0.0
    for alias in aliases:
        gold = Counter(normalize_answer(alias, **normalize).split())
        common = sum((predicted & gold).values())
        if common:
            precision, recall = common / sum(predicted.values()), common / sum(gold.values())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ---- clustering ----------------------------------------------------------------------------
class ClusterBackend(Protocol):
    """Partitions a question's sampled answers into classes of equivalent answers.

    ``cluster(answers, question=None)`` returns one cluster id per answer, numbered 0, 1, 2, ...
    in order of first appearance (so equal partitions give equal lists). ``question`` is context
    that some backends use (entailment) and others ignore.
    """

    def cluster(self, answers: Sequence[str], question: str | None = None) -> list[int]: ...


def _canonical(ids: Sequence[int]) -> list[int]:
    """Relabel cluster ids 0, 1, 2, ... in order of first appearance."""
    first: dict[int, int] = {}
    return [first.setdefault(i, len(first)) for i in ids]


class ExactMatch:
    """Answers are equivalent when their `normalize_answer` forms are equal (all empty
    normalized answers form one cluster: a model that keeps answering nothing is consistent)."""

    def __init__(self, **normalize: Any) -> None:
        self.normalize = normalize
        normalize_answer("", **normalize)  # refuse bad options now, not at the first question

    def cluster(self, answers: Sequence[str], question: str | None = None) -> list[int]:
        keys = [normalize_answer(a, **self.normalize) for a in answers]
        first: dict[str, int] = {}
        return [first.setdefault(k, len(first)) for k in keys]


def _greedy(n_unique: int, joins: Callable[[int, list[int]], int | None]) -> list[int]:
    """Greedy clustering: item j joins ``joins(j, representatives)`` (an index into the list of
    cluster representatives, or None for a new cluster); a new cluster's representative is its
    first item. Returns the cluster of each item."""
    reps: list[int] = []
    out = []
    for j in range(n_unique):
        c = joins(j, reps) if reps else None
        if c is None:
            c = len(reps)
            reps.append(j)
        out.append(c)
    return out


class EmbeddingSimilarity:
    """Answers are equivalent when the cosine similarity of their embeddings reaches
    ``threshold``, by greedy clustering against each cluster's first member.

    Answers with the same normalized form always share a cluster and are embedded once (the
    first raw form is embedded). Then, in order of first appearance, each distinct answer joins
    the cluster whose representative is most similar if that similarity is >= ``threshold``,
    else starts a cluster. ``embed(texts) -> (len(texts), d)`` tensor; rows need not be unit
    length (they are normalized here). The result depends on answer order only through which
    member represents a cluster, as in Kuhn et al.'s greedy procedure. The default threshold
    0.75 is a choice, not a published value: docs/open_qa.md gives the similarities it rests on.
    """

    def __init__(
        self, embed: Callable[[list[str]], Any], threshold: float = 0.75, **normalize: Any
    ) -> None:
        if not callable(embed):
            raise TypeError(f"embed must be callable, got {embed!r}")
        if not -1.0 <= float(threshold) <= 1.0:
            raise ValueError(f"threshold is a cosine similarity in [-1, 1], got {threshold!r}")
        self.embed, self.threshold, self.normalize = embed, float(threshold), normalize

    def cluster(self, answers: Sequence[str], question: str | None = None) -> list[int]:
        if not answers:
            return []
        keys = ExactMatch(**self.normalize).cluster(answers)
        firsts = {k: i for i, k in reversed(list(enumerate(keys)))}
        unique = [answers[firsts[k]] for k in range(len(firsts))]
        emb = as_float64(self.embed(unique), "embeddings")
        if emb.ndim != 2 or emb.shape[0] != len(unique):
            raise ValueError(f"embed returned shape {tuple(emb.shape)} for {len(unique)} texts")
        emb = torch.nn.functional.normalize(emb, dim=1)

        def joins(j: int, reps: list[int]) -> int | None:
            sims = emb[reps] @ emb[j]
            best = int(sims.argmax())
            return best if float(sims[best]) >= self.threshold else None

        of_unique = _greedy(len(unique), joins)
        return _canonical([of_unique[k] for k in keys])


Entailment = Callable[[Sequence[tuple[str, str]]], Sequence[bool]]


class BidirectionalEntailment:
    """Kuhn et al. (2023)'s semantic equivalence: A ~ B when A entails B and B entails A.

    ``entails(pairs) -> [bool]`` decides a batch of (premise, hypothesis) pairs (e.g.
    `nli_entailment`). With a question, each side is "question answer" (Kuhn et al. condition on
    the question). Distinct normalized answers are clustered greedily in order of first
    appearance against each cluster's first member (both directions of every comparison go in
    one call per answer); equal normalized answers always share a cluster.
    """

    def __init__(self, entails: Entailment, **normalize: Any) -> None:
        if not callable(entails):
            raise TypeError(f"entails must be callable, got {entails!r}")
        self.entails, self.normalize = entails, normalize

    def cluster(self, answers: Sequence[str], question: str | None = None) -> list[int]:
        keys = ExactMatch(**self.normalize).cluster(answers)
        firsts = {k: i for i, k in reversed(list(enumerate(keys)))}
        prefix = f"{question} " if question else ""
        texts = [prefix + answers[firsts[k]] for k in range(len(firsts))]

        def joins(j: int, reps: list[int]) -> int | None:
            pairs = [(texts[r], texts[j]) for r in reps] + [(texts[j], texts[r]) for r in reps]
            verdict = list(self.entails(pairs))
            if len(verdict) != len(pairs):
                raise ValueError(f"entails returned {len(verdict)} verdicts for {len(pairs)} pairs")
            both = [bool(a) and bool(b) for a, b in zip(verdict[: len(reps)], verdict[len(reps) :])]
            return both.index(True) if any(both) else None

        of_unique = _greedy(len(texts), joins)
        return _canonical([of_unique[k] for k in keys])


# ---- confidence and correctness from clusters ---------------------------------------------
def _check_ids(ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("no samples: a confidence needs at least one sampled answer")
    return ids


def cluster_sizes(ids: Sequence[int]) -> Counter[int]:
    """How many samples each cluster holds."""
    return Counter(_check_ids(ids))


def modal_cluster(ids: Sequence[int]) -> int:
    """The largest cluster; among equally large ones, the one whose first sample comes first."""
    ids = _check_ids(ids)
    sizes = Counter(ids)
    top = max(sizes.values())
    return next(i for i in ids if sizes[i] == top)


def cluster_confidence(ids: Sequence[int]) -> float:
    """|largest cluster| / n over the n sampled answers' cluster ids."""
    ids = _check_ids(ids)
    return max(Counter(ids).values()) / len(ids)


def modal_answer(answers: Sequence[str], ids: Sequence[int], **normalize: Any) -> str:
    """The answer that represents the largest cluster: its most frequent normalized form
    (ties: the form seen first), given as the first raw answer with that form. With
    `ExactMatch` clusters every member has one form, so this is the cluster's first answer."""
    if len(answers) != len(ids):
        raise ValueError(f"{len(answers)} answers but {len(ids)} cluster ids")
    c = modal_cluster(ids)
    members = [a for a, i in zip(answers, ids) if int(i) == c]
    forms = [normalize_answer(a, **normalize) for a in members]
    counts = Counter(forms)
    top = max(counts.values())
    return next(a for a, f in zip(members, forms) if counts[f] == top)


def split_half_confidence(
    ids: Sequence[int],
    n_splits: int = 10,
    seed: int = 0,
    *,
    permutations: Sequence[Sequence[int]] | None = None,
) -> float:
    """Split-half confidence: the modal cluster is chosen on one half of the samples and its
    frequency measured on the other, averaged over ``n_splits`` random splits.

    For each split, a permutation π of the n samples gives the sets A = π[: n // 2] and
    B = π[n // 2 :] (B is the larger half when n is odd); c_A = the largest cluster among A's
    samples (ties: the cluster holding A's lowest-numbered sample, so c_A depends on the set A
    only, not on the order π lists it in); the split scores |{i ∈ B : id_i = c_A}| / |B|.
    The result is the mean over splits. Choosing and measuring the
    mode on disjoint samples removes the optimism of the in-sample share of the largest cluster.
    ``permutations`` fixes the splits (each a permutation of range(n)); otherwise they are drawn
    with ``numpy.random.default_rng(seed)``. Needs n >= 2.
    """
    ids_arr = np.asarray(_check_ids(ids))
    n = len(ids_arr)
    if n < 2:
        raise ValueError(f"split-half confidence needs at least 2 samples, got {n}")
    if permutations is None:
        if not isinstance(n_splits, int) or n_splits < 1:
            raise ValueError(f"n_splits must be a positive integer, got {n_splits!r}")
        rng = np.random.default_rng(seed)
        permutations = [rng.permutation(n).tolist() for _ in range(n_splits)]
    scores = []
    for split in permutations:
        perm = np.asarray(split)
        if sorted(perm.tolist()) != list(range(n)):
            raise ValueError(f"a split must be a permutation of range({n}), got {perm.tolist()}")
        half_a, half_b = ids_arr[np.sort(perm[: n // 2])], ids_arr[perm[n // 2 :]]
        mode_a = modal_cluster(half_a.tolist())
        scores.append(float((half_b == mode_a).mean()))
    return float(np.mean(scores))


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
    return _ece_from_bins(*_binned(conf, corr, check_n_bins(n_bins)))


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
    count, mean_conf, mean_out = _binned(conf, corr, n_bins)
    return ReliabilityData.from_bins(width_edges(n_bins), count, mean_conf, mean_out)


# ---- baselines from token log-probabilities ------------------------------------------------
def _masked_logprobs(logprobs: Any, mask: Any | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) float64 log-probs and a (B, L) bool mask; a 1-D input is one answer (B = 1)."""
    lp = as_float64(logprobs, "logprobs")
    if lp.ndim == 1:
        lp = lp.unsqueeze(0)
    if lp.ndim != 2:
        raise ValueError(f"logprobs must be (L,) or (B, L), got shape {tuple(lp.shape)}")
    m = torch.ones_like(lp, dtype=torch.bool) if mask is None else torch.as_tensor(mask).to(torch.bool)
    m = m.reshape(lp.shape) if m.numel() == lp.numel() else m
    if m.shape != lp.shape:
        raise ValueError(f"mask shape {tuple(m.shape)} differs from logprobs {tuple(lp.shape)}")
    empty = (~m.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"answer(s) {empty} have no tokens; count the end-of-answer token")
    if (lp[m] > 1e-6).any() or torch.isnan(lp[m]).any():
        raise ValueError("logprobs must be log-probabilities (<= 0, not NaN)")
    return lp.clamp_max(0.0), m


def _squeeze(out: torch.Tensor, logprobs: Any) -> torch.Tensor:
    return out[0] if np.ndim(logprobs) == 1 else out


def sequence_probability(logprobs: Any, mask: Any | None = None) -> torch.Tensor:
    """Length-normalized sequence probability exp((1/L) Σ_t log p_t) (the geometric mean of
    the token probabilities). logprobs (L,) or (B, L) with ``mask`` (B, L) marking answer
    tokens; returns a scalar or (B,) float64 tensor."""
    lp, m = _masked_logprobs(logprobs, mask)
    mean = (lp * m).sum(1) / m.sum(1)
    return _squeeze(mean.exp(), logprobs)


def mean_token_probability(logprobs: Any, mask: Any | None = None) -> torch.Tensor:
    """(1/L) Σ_t p_t over the answer tokens. Shapes as in `sequence_probability`."""
    lp, m = _masked_logprobs(logprobs, mask)
    return _squeeze((lp.exp() * m).sum(1) / m.sum(1), logprobs)


def min_token_probability(logprobs: Any, mask: Any | None = None) -> torch.Tensor:
    """min_t p_t over the answer tokens. Shapes as in `sequence_probability`."""
    lp, m = _masked_logprobs(logprobs, mask)
    return _squeeze(lp.masked_fill(~m, 0.0).min(1).values.exp(), logprobs)


# ---- verbalized confidence -----------------------------------------------------------------
_NUMBER = r"(\d+(?:\.\d+)?)"
_SCALE = re.compile(_NUMBER + r"\s*(%|/\s*" + _NUMBER + r"|out of\s+" + _NUMBER + r")?", re.I)
_KEYWORD = re.compile(r"confiden\w*|certain\w*|sure", re.I)


def parse_verbalized_confidence(text: str) -> float | None:
    """A 0–100 confidence stated in ``text``, as a probability in [0, 1]; None if there is none.

    The number read is the first one after a word "confidence" / "certain(ty)" / "sure" when
    the text has one, else the first number in the text. "85", "85%", "Confidence: 85",
    "85/100" and "85 out of 100" give 0.85; "4/5" or "8 out of 10" give the fraction. A
    number above its scale (above 100 without a denominator), a zero denominator, a negative
    sign or no number at all give None: the caller counts these as parse failures. A bare
    "0.85" reads as 0.85 on the 0–100 scale asked for, i.e. 0.0085.
    """
    if not isinstance(text, str):
        return None
    keyword = _KEYWORD.search(text)
    match = _SCALE.search(text, keyword.end() if keyword else 0) or (
        _SCALE.search(text) if keyword else None
    )
    if match is None:
        return None
    if match.start() > 0 and text[match.start() - 1] == "-":
        return None
    value = float(match.group(1))
    denominator = match.group(3) or match.group(4)
    scale = float(denominator) if denominator else 100.0
    if scale <= 0 or value > scale:
        return None
    return value / scale
