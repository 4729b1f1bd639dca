"""Semantic clusters of a question's sampled answers, and the confidences read from them.

Equivalence backends (`ClusterBackend`: ``cluster(answers, question=None) -> ids``): `ExactMatch`
on normalized text (the default, needs nothing), `EmbeddingSimilarity` (cosine similarity of
sentence embeddings against each cluster's first member), `BidirectionalEntailment` (Kuhn et
al.'s test: A entails B and B entails A, from any entailment function). This module loads no
model: it takes functions (`apps.calm_llm.semantic_models` builds them).

From the ids: `cluster_sizes`, `modal_cluster`, the confidence |largest cluster| / n
(`cluster_confidence`), the modal answer (`modal_answer`) and the split-half confidence
(`split_half_confidence`). `calibration.semantic` re-exports all of them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from calibration._checks import as_float64
from calibration.answers import normalize_answer

__all__ = [
    "BidirectionalEntailment",
    "ClusterBackend",
    "EmbeddingSimilarity",
    "Entailment",
    "ExactMatch",
    "cluster_confidence",
    "cluster_sizes",
    "modal_answer",
    "modal_cluster",
    "split_half_confidence",
]

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
"""``entails(pairs) -> flags``: for each (premise, hypothesis) pair, whether the premise entails
the hypothesis (what `BidirectionalEntailment` asks in both directions)."""


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

