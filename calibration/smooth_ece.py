"""Smooth ECE (Błasiok & Nakkiran, "Smooth ECE: Principled Reliability Diagrams via Kernel
Smoothing", ICLR 2024), the bin-free calibration error that the ``relplot`` package reports.

For predictions f_i ∈ [0, 1] and outcomes y_i ∈ [0, 1] (binary, or any value in [0, 1]),
with residuals r_i = y_i − f_i and a reflected Gaussian kernel K_σ on [0, 1],

    smECE_σ = ∫_0^1 | (1/N) Σ_i K_σ(t, f_i) r_i | dt
            = ∫_0^1 |r̂_σ(t)| δ̂_σ(t) dt,

the Nadaraya–Watson smoothed residual r̂_σ weighted by the kernel density δ̂_σ. The
bandwidth is not a tuning knob: σ* is the fixed point smECE_σ* = σ* (smECE_σ decreases in σ,
so the fixed point is unique and found by bisection), and smooth ECE = smECE_σ*.

The reflected kernel K_σ(t, x) = Σ_{m∈Z} [φ_σ(t − x − 2m) + φ_σ(t + x − 2m)] is the density of
a Gaussian started at x and reflected at 0 and 1: it integrates to 1 over t ∈ [0, 1] for
every x, so a constant residual r_i = c gives smECE_σ = |c| for every σ.

Computation: as relplot does, the sample is first spread onto a uniform grid of ``grid_size``
points by linear interpolation (cost O(N)), then each σ costs one (grid × grid) kernel
product, independent of N. The discretized kernel's columns are renormalized to integrate
to exactly 1 under the trapezoid rule, so the constant-residual identity holds on the grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SmoothECE", "smooth_ece_binary"]

# Images m of the reflection kept in the kernel sum: for σ ≤ 1 the first omitted image lies at
# distance ≥ 2·_N_IMAGES − 1 = 7 ≥ 7σ, so its weight is below φ(7)/φ(0) ≈ 2e-11.
_N_IMAGES = 4


@dataclass(frozen=True)
class SmoothECE:
    """Smooth ECE ``value`` and the bandwidth σ* it was computed at (value ≈ σ*)."""

    value: float
    bandwidth: float


class _Grid:
    """Uniform grid on [0, 1] with trapezoid weights and index tables for the kernel."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.h = 1.0 / (size - 1)
        j = torch.arange(size)
        self.diff = j[:, None] - j[None, :]  # (M, M): t_j − t_g in units of h
        self.summ = j[:, None] + j[None, :]  # (M, M): t_j + t_g in units of h
        w = torch.full((size,), self.h, dtype=torch.float64)
        w[0] = w[-1] = self.h / 2
        self.weights = w

    def kernel(self, sigma: float) -> torch.Tensor:
        """(M, M) reflected Gaussian kernel K_σ(t_j, t_g), columns integrating to 1."""
        m = self.size - 1
        # Every argument of φ is an integer multiple d of h, with d in [−m − 2·I·m, 2m + 2·I·m].
        lo = -m - 2 * _N_IMAGES * m
        d = torch.arange(lo, 2 * m + 2 * _N_IMAGES * m + 1, dtype=torch.float64)
        base = torch.exp(-0.5 * (d * self.h / sigma) ** 2)
        # v(d) = Σ_m φ(d·h + 2m), built by shifting the Gaussian by multiples of 2 (= 2m grid steps).
        v = torch.zeros(3 * m + 1, dtype=torch.float64)  # offsets d in [−m, 2m]
        for img in range(-_N_IMAGES, _N_IMAGES + 1):
            start = (-m + 2 * img * m) - lo
            v += base[start : start + 3 * m + 1]
        k = v[self.diff + m] + v[self.summ + m]
        # Normalizing each column absorbs both the Gaussian constant and the discretization error.
        return k / (self.weights @ k)[None, :]


def _spread(f: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """Linear-interpolation mass of ``values`` at positions ``f`` on the grid, shape (size,)."""
    pos = f * (size - 1)
    lo = pos.floor().clamp(0, size - 2).to(torch.int64)
    frac = pos - lo
    out = torch.zeros(size, dtype=torch.float64)
    out.index_add_(0, lo, (1 - frac) * values)
    out.index_add_(0, lo + 1, frac * values)
    return out


def smooth_ece_binary(
    f: torch.Tensor,
    y: torch.Tensor,
    *,
    grid_size: int = 1001,
    tol: float = 1e-6,
) -> SmoothECE:
    """Smooth ECE of predictions ``f`` (N,) in [0, 1] against outcomes ``y`` (N,) in [0, 1].

    Returns ``SmoothECE(value, bandwidth)`` with bandwidth σ* the fixed point of
    σ ↦ smECE_σ on [0, 1], located by bisection to ``tol``. A perfectly calibrated sample
    (r̂_σ ≡ 0) gives σ* = 0 and value 0.
    """
    f = torch.as_tensor(f, dtype=torch.float64).detach().cpu().reshape(-1)
    y = torch.as_tensor(y, dtype=torch.float64).detach().cpu().reshape(-1)
    if f.shape != y.shape or f.numel() == 0:
        raise ValueError(f"f and y must be non-empty and of equal length, got {f.shape}, {y.shape}")
    if not (torch.isfinite(f).all() and torch.isfinite(y).all()):
        raise ValueError("f and y must be finite")
    if (f < 0).any() or (f > 1).any() or (y < 0).any() or (y > 1).any():
        raise ValueError("f and y must lie in [0, 1]")
    if grid_size < 3:
        raise ValueError(f"grid_size must be at least 3, got {grid_size}")
    grid = _Grid(grid_size)
    # Residual mass per grid point, already divided by N: r_g = (1/N) Σ_i w_ig (y_i − f_i).
    r = _spread(f, y - f, grid_size) / f.numel()

    def sm_ece(sigma: float) -> float:
        return float(grid.weights @ (grid.kernel(sigma) @ r).abs())

    lo, hi = 0.0, 1.0
    # g(σ) = smECE_σ − σ is decreasing, g(1) ≤ mean|r| − 1 ≤ 0: bisect the sign change.
    if sm_ece(hi) >= hi:
        return SmoothECE(value=sm_ece(hi), bandwidth=hi)
    n_iter = max(1, math.ceil(math.log2((hi - lo) / tol)))
    for _ in range(n_iter):
        mid = 0.5 * (lo + hi)
        if sm_ece(mid) > mid:
            lo = mid
        else:
            hi = mid
    sigma = 0.5 * (lo + hi)
    return SmoothECE(value=sm_ece(sigma), bandwidth=sigma)
