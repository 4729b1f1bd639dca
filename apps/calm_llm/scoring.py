"""From vocabulary logits to answer scores and losses, for letter, cloze and instruction batches.

``logits`` are the model's (already α-adjusted) next-token logits, shape (S, L', V), where
L' = L (every position) or a suffix of the positions (``logits_to_keep=k`` keeps the last k
columns; letter batches are left-padded so ``k = 1`` keeps the answer position). Targets are
aligned to logits by taking the last L' columns of ``batch.target_ids``.

A packed shared-prefix batch gives its logits at the target positions only, shape (M, V):
row m is the m-th True entry, in row-major order, of ``batch.logit_rows`` (S, L) — by default
``target_ids != -100`` — so that the output projection, α and the log-softmax never touch a
padded position. `gold_only` keeps ``logit_rows`` when it drops targets.

Answer distributions (N questions, K = max option slots):
  letter:  s[n, j] = z[n, last, id_j]                      (softmax over the option letters)
  cloze:   s[n, j] = Σ_t log softmax(z[s, t])[y_t]          over the continuation tokens of
           the sequence s = (n, j); "mean" divides by its token count, "char" by its
           character count (lm-eval-harness acc / acc_norm conventions).
softmax(s, dim=-1) is the predictive distribution; absent options score -inf.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .data.collate import IGNORE
from .data.schema import Batch

CLOZE_NORMS = ("sum", "mean", "char")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits -> float32 before log-softmax; float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def aligned_targets(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The (S, L') slice of ``batch.target_ids`` that lines up with ``logits`` (S, L', V)."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be (S, L, V), got shape {tuple(logits.shape)}")
    S, L = batch.target_ids.shape
    if logits.shape[0] != S:
        raise ValueError(f"logits hold {logits.shape[0]} sequences, the batch {S}")
    k = logits.shape[1]
    if k > L:
        raise ValueError(f"logits have {k} positions, the batch only {L}")
    if k < L and (batch.target_ids[:, : L - k] != IGNORE).any():
        raise ValueError(
            f"logits keep only the last {k} of {L} positions but the batch has targets before them "
            "(logits_to_keep=1 only works for letter batches)"
        )
    return batch.target_ids[:, L - k :]


def at_targets(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z, y, seq)``: the (M, V) logits at the M target positions, their (M,) target ids and
    (M,) sequence indices, in row-major (sequence, position) order; for (S, L', V) logits and
    for the (M0, V) logits of a packed batch (module docstring)."""
    if logits.dim() == 2:
        rows = batch.logit_positions
        if logits.shape[0] != int(rows.sum()):
            raise ValueError(
                f"logits hold {logits.shape[0]} positions, the batch's logit_rows {int(rows.sum())}"
            )
        tgt = batch.target_ids[rows]
        keep = tgt != IGNORE
        seq = rows.nonzero()[:, 0]
        if bool(keep.all()):
            return logits, tgt, seq
        return logits[keep], tgt[keep], seq[keep]
    tgt = aligned_targets(logits, batch)
    mask = tgt != IGNORE
    return logits[mask], tgt[mask], mask.nonzero()[:, 0]


def answer_logits(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(M, V) logits at the M target positions, in row-major (sequence, position) order."""
    return at_targets(logits, batch)[0]


def answer_targets(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(M,) target token ids matching ``answer_logits``."""
    return at_targets(logits, batch)[1]


def lm_loss(logits: torch.Tensor, batch: Batch, *, label_smoothing: float = 0.0) -> torch.Tensor:
    """Completion-only cross-entropy over the full vocabulary, mean over target tokens.

    L = -(1/M) Σ_m [(1-ε) log p_m(y_m) + (ε/V) Σ_v log p_m(v)]   with ε = ``label_smoothing``.
    Letter batches: the answer-letter token; cloze: the continuation tokens; instruction: the
    response tokens.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    z, y, _ = at_targets(logits, batch)
    if z.shape[0] == 0:
        raise ValueError("the batch has no target tokens")
    return F.cross_entropy(_upcast(z), y, label_smoothing=label_smoothing)


def _n_slots(batch: Batch) -> int:
    if batch.max_options is not None:
        return int(batch.max_options)
    return int(batch.n_options.max())


def option_logits(
    logits: torch.Tensor,
    batch: Batch,
    *,
    cloze_norm: str = "sum",
    option_token_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, K) option scores; ``softmax(·, -1)`` is the answer distribution, -inf where absent.

    Args:
        logits: (S, L', V) vocabulary logits, or (M, V) at a packed batch's target positions.
        batch: the `Batch` they were computed on ("letter" or "cloze" mode).
        cloze_norm: "sum" | "mean" | "char" normalization of cloze log-likelihoods.
        option_token_ids: (K,) letter ids (letter mode); defaults to ``batch.option_token_ids``.
    """
    if batch.mode == "letter":
        ids = option_token_ids if option_token_ids is not None else batch.option_token_ids
        if ids is None:
            raise ValueError("letter scoring needs option_token_ids (from the Collator)")
        ids = ids.to(logits.device)
        tgt = aligned_targets(logits, batch)
        if (tgt[:, -1] == IGNORE).any():
            raise ValueError("letter batch: the last column must be the answer position")
        scores = _upcast(logits[:, -1, :].index_select(-1, ids))  # (N, K)
        K = ids.shape[0]
    elif batch.mode == "cloze":
        if cloze_norm not in CLOZE_NORMS:
            raise ValueError(f"cloze_norm must be one of {CLOZE_NORMS}, got {cloze_norm!r}")
        z, y, seq_of = at_targets(logits, batch)
        # log p(y) = z_y − logsumexp(z), only at target positions: (M, V) read, (M,) written
        z = _upcast(z)
        lp = z.gather(-1, y[:, None])[:, 0] - z.logsumexp(-1)  # (M,)
        S = batch.target_ids.shape[0]
        per_seq = torch.zeros(S, dtype=lp.dtype, device=lp.device).index_add(0, seq_of, lp)
        if cloze_norm == "mean":
            per_seq = per_seq / torch.bincount(seq_of, minlength=S).clamp(min=1).to(per_seq.dtype)
        elif cloze_norm == "char":
            per_seq = per_seq / batch.cont_chars.to(per_seq.device).clamp(min=1).to(per_seq.dtype)
        K = _n_slots(batch)
        N = batch.n_questions
        flat = batch.seq_question.to(logits.device) * K + batch.seq_option.to(logits.device)
        scores = torch.full((N * K,), float("-inf"), dtype=per_seq.dtype, device=per_seq.device)
        scores = scores.index_put((flat,), per_seq).view(N, K)
        return scores
    else:
        raise ValueError(f"option scores need a letter or cloze batch, got mode {batch.mode!r}")
    absent = torch.arange(K, device=scores.device)[None, :] >= batch.n_options.to(scores.device)[:, None]
    return scores.masked_fill(absent, float("-inf"))
