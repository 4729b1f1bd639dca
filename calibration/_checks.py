"""Input conversion and validation shared by the metrics.

Every metric accepts torch tensors or numpy arrays (or anything ``numpy.asarray`` accepts) and
works internally on detached float64 CPU tensors: the metrics are reported numbers, not
training losses, so precision matters more than speed and no autograd graph is needed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Rows of `probs` must sum to 1 within this absolute tolerance. Loose enough for float32
# softmax outputs renormalized over a few option tokens (errors ~1e-6), tight enough to catch
# logits or unnormalized scores passed by mistake. Probabilities stored in a coarser dtype get
# a tolerance scaled to it (`row_sum_tolerance`).
ROW_SUM_ATOL = 1e-3


def row_sum_tolerance(dtype: Any) -> float:
    """How far from 1 a row of probabilities stored in ``dtype`` may sum: ``ROW_SUM_ATOL``, or
    2·eps of the dtype where that is larger (bfloat16: 0.0156; float16: 0.00195).

    Rounding each entry of a normalized row to a dtype of machine epsilon eps moves the sum by
    at most eps/2 (each entry by at most eps/2 of itself); a bfloat16 softmax row summing to
    1.0024 is exactly normalized probabilities, rounded. 2·eps leaves room for one more
    rounding step (a renormalization in that dtype)."""
    try:
        eps = float(torch.finfo(dtype).eps) if isinstance(dtype, torch.dtype) else float(np.finfo(dtype).eps)
    except (TypeError, ValueError):  # an integer or other non-float dtype: nothing to scale
        return ROW_SUM_ATOL
    return max(ROW_SUM_ATOL, 2.0 * eps)


def as_float64(x: Any, name: str) -> torch.Tensor:
    """Detached float64 CPU tensor from a tensor, numpy array or nested sequence."""
    if isinstance(x, torch.Tensor):
        t = x.detach().to(device="cpu", dtype=torch.float64)
    else:
        arr = np.asarray(x)
        if arr.dtype == object:
            raise TypeError(f"{name} must be numeric, got an object array")
        t = torch.from_numpy(arr.astype(np.float64, copy=True))
    return t


def as_labels(x: Any, name: str = "labels") -> torch.Tensor:
    """Detached int64 CPU tensor; refuses float or bool dtypes (a common mix-up with probs)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
        return x.detach().to(device="cpu", dtype=torch.int64)
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must have an integer dtype, got {arr.dtype}")
    return torch.from_numpy(arr.astype(np.int64, copy=True))


def check_probs(probs: Any, *, from_logits: bool = False) -> torch.Tensor:
    """Validate an (N, K) probability matrix; return it as float64.

    With ``from_logits=True`` the input is (N, K) logits (−inf allowed for absent classes, as
    long as each row has a finite entry) and is turned into probabilities by a float64 softmax
    first. Raises ValueError naming the problem: wrong rank, empty, fewer than 2 classes,
    NaN/inf, entries outside [0, 1], or rows not summing to 1 within ``ROW_SUM_ATOL`` (scaled
    up for probabilities stored in a coarser dtype such as bfloat16: `row_sum_tolerance`).
    """
    # the tolerance is set by the dtype the probabilities were stored in, before the float64 copy
    given = probs.dtype if isinstance(probs, torch.Tensor) else getattr(probs, "dtype", None)
    atol = ROW_SUM_ATOL if from_logits or given is None else row_sum_tolerance(given)
    p = as_float64(probs, "logits" if from_logits else "probs")
    if from_logits:
        if p.ndim != 2:
            raise ValueError(f"logits must have shape (N, K), got shape {tuple(p.shape)}")
        if torch.isnan(p).any() or (p == float("inf")).any():
            raise ValueError("logits contain NaN or +inf")
        if p.shape[0] and p.shape[1] and not torch.isfinite(p).any(dim=1).all():
            raise ValueError("a row of logits is entirely -inf: no class has any probability")
        p = torch.softmax(p, dim=1)
    if p.ndim != 2:
        raise ValueError(f"probs must have shape (N, K), got shape {tuple(p.shape)}")
    n, k = p.shape
    if n == 0:
        raise ValueError("probs is empty (N = 0): metrics need at least one sample")
    if k < 2:
        raise ValueError(f"probs must have at least 2 classes (K >= 2), got K = {k}")
    if not torch.isfinite(p).all():
        raise ValueError("probs contains NaN or infinite values")
    if (p < 0).any() or (p > 1).any():
        raise ValueError(
            f"probs must lie in [0, 1]; got min {p.min().item():.4g}, max {p.max().item():.4g}"
            " (did you pass logits? apply softmax first)"
        )
    err = (p.sum(dim=1) - 1).abs()
    if (err > atol).any():
        i = int(err.argmax())
        raise ValueError(
            f"rows of probs must sum to 1 (tolerance {atol:.3g}); row {i} sums to "
            f"{p[i].sum().item():.6g}"
        )
    return p


def check_probs_labels(
    probs: Any, labels: Any, *, from_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``probs`` (N, K) (or logits, see ``check_probs``) and integer ``labels`` (N,) in
    [0, K); return float64 probabilities and int64 labels."""
    p = check_probs(probs, from_logits=from_logits)
    y = as_labels(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must have shape (N,), got shape {tuple(y.shape)}")
    if y.shape[0] != p.shape[0]:
        raise ValueError(
            f"probs and labels disagree on N: probs has {p.shape[0]} rows, labels has {y.shape[0]}"
        )
    k = p.shape[1]
    if (y < 0).any() or (y >= k).any():
        raise ValueError(
            f"labels must lie in [0, K) = [0, {k}); got min {int(y.min())}, max {int(y.max())}"
        )
    return p, y


MAX_N_BINS = 10**6  # far above any useful binning (10-20 in the literature), far below memory


def check_n_bins(n_bins: int) -> int:
    """``n_bins`` as an int in [1, MAX_N_BINS]: the per-bin sums are allocated up front (n_bins
    floats, n_bins · K for classwise ECE), so a huge count fails by name, not in the allocator."""
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    if n_bins > MAX_N_BINS:
        raise ValueError(f"n_bins={n_bins} is above the bound of {MAX_N_BINS:,} bins (each bin "
                         "is allocated; ECE is reported with 10 or 15)")
    return int(n_bins)
