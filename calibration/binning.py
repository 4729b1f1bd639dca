"""Assigning confidences to bins: the one convention every binned metric and objective shares.

Equal-width bins split [0, 1] into ``n_bins`` intervals [b_k, b_{k+1}) with b_k = k / n_bins;
the last bin is closed, [b_{n-1}, 1], so a confidence of exactly 1 lands in the top bin. This is
``torch.bucketize(..., right=True) - 1`` on the edges k / n_bins, torchmetrics' convention,
except at exactly 1.0 (torchmetrics puts it in an extra bin of its own) and at values exactly
on an edge that ``linspace`` rounds up by one ulp (torchmetrics builds its edges with it).

Equal-mass bins use the empirical quantiles of the values as edges, so each bin holds about
N / n_bins samples; ties stay together in one bin, which keeps the result invariant to the
order of the samples.
"""

from __future__ import annotations

from typing import Literal

import torch

Binning = Literal["width", "mass"]
"""The bin edges: ``"width"`` n equal-width bins of [0, 1], ``"mass"`` quantile edges (about
N/n samples per bin)."""


def width_edges(n_bins: int, device: torch.device | None = None) -> torch.Tensor:
    """Equal-width edges, shape (n_bins + 1,), float64: 0, 1/n, ..., 1.

    Computed as k / n (one correctly rounded division per edge), not with ``linspace``,
    whose float64 edges are off by one ulp for some k (linspace(0, 1, 11)[3] is
    0.30000000000000004): a confidence of exactly 0.3 would then fall in [0.2, 0.3).
    """
    return torch.arange(n_bins + 1, dtype=torch.float64, device=device) / n_bins


def mass_edges(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Equal-mass edges, shape (n_bins + 1,): quantiles of ``values`` at k / n_bins."""
    v = values.detach().to(torch.float64).reshape(-1)
    q = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64, device=v.device)
    edges = torch.quantile(v, q)
    # The outer edges span [0, 1] so that every value falls in some bin.
    edges[0] = 0.0
    edges[-1] = 1.0
    return edges


def bin_index(values: torch.Tensor, n_bins: int, binning: Binning = "width") -> torch.Tensor:
    """Bin of each value, int64 in [0, n_bins), same shape as ``values`` (no gradient).

    ``binning="width"``: [k/n, (k+1)/n), last bin closed. ``binning="mass"``: quantile edges.
    """
    if binning == "width":
        edges = width_edges(n_bins, device=values.device)
    elif binning == "mass":
        edges = mass_edges(values, n_bins)
    else:
        raise ValueError(f"binning must be 'width' or 'mass', got {binning!r}")
    v = values.detach().to(torch.float64)
    idx = torch.bucketize(v, edges, right=True) - 1
    return idx.clamp_(0, n_bins - 1)


def bin_stats(
    conf: torch.Tensor, outcome: torch.Tensor, n_bins: int, binning: Binning = "width"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-bin (count, mean confidence, mean outcome), each (n_bins,) float64, of the bins
    `bin_index` assigns ``conf`` (N,) to; ``outcome`` (N,) is 1/0 correctness (or any value
    whose per-bin mean is wanted). Empty bins give NaN means (0/0)."""
    idx = bin_index(conf, n_bins, binning)
    count = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, torch.ones_like(conf))
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, conf)
    out_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, outcome)
    # 0/0 = NaN marks an empty bin; callers weight by count or skip it.
    return count, conf_sum / count, out_sum / count


def ece_from_bins(count: torch.Tensor, mean_conf: torch.Tensor, mean_out: torch.Tensor) -> float:
    """ECE from `bin_stats`' output: Σ_k (|B_k|/N) |mean_out_k − mean_conf_k| over the nonempty
    bins (the NaN means of empty bins never enter)."""
    nonempty = count > 0
    gap = (mean_out[nonempty] - mean_conf[nonempty]).abs()
    return float((count[nonempty] * gap).sum() / count.sum())
