"""Confidence baselines of one free-form answer, beside the cluster confidence: the
length-normalized sequence probability, the mean and the min token probability of its tokens
(from their log-probabilities), and a verbalized 0–100 confidence read from text.
`calibration.semantic` re-exports all four.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from calibration._checks import as_float64

__all__ = [
    "mean_token_probability",
    "min_token_probability",
    "parse_verbalized_confidence",
    "sequence_probability",
]

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

