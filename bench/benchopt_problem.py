"""The torch port of benchopt's bilevel benchmark's ``simulated`` quadratic problem
(github.com/benchopt/benchmark_bilevel, ``datasets/simulated.py``): its objectives on
minibatches and its closed-form metrics. Torch and numpy only (no benchopt, no JAX), so the
port is tested without the benchmark (tests/bench/test_bench_benchopt_problem.py); the
benchmark's own matrices enter through :func:`from_arrays`.

For n samples with symmetric A_i (p×p) and B_i (d×d), C_i (d×p), a_i (p), b_i (d), a
quadratic objective of the inner variable z ∈ R^p and the outer variable x ∈ R^d is, on the
batch i ∈ [s, s + m),

    q(z, x; s, m) = (1/m) Σ_i  ½ zᵀA_i z + ½ xᵀB_i x + xᵀC_i z + a_iᵀz + b_iᵀx

g (inner) and f (outer) are two such objectives on their own matrices. The metrics are
the benchmark's, in closed form from the full-batch means Ā, C̄, ā (of g) and F̄, H̄, K̄,
f̄, h̄ (of f):

    z*(x) = −Ā⁻¹(ā + C̄ᵀx)                      the inner solution
    v     = −Ā⁻¹ ∇_z f(z*, x),   ∇_z f = F̄ z* + K̄ᵀx + f̄
    ∇h(x) = ∇_x f(z*, x) + C̄ v,   ∇_x f = H̄ x + K̄ z* + h̄
    value = ‖∇h(x)‖²,   inner_distance = ‖z*(x) − z‖²
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# The benchmark's names of the five arrays of one objective (the free variables of its
# ``get_function`` closure), in the order of the formula above.
ARRAYS = ("hess_inner", "hess_outer", "cross", "linear_inner", "linear_outer")


@dataclass(frozen=True)
class Quadratic:
    """One finite-sum quadratic q(z, x; s, m) (module docstring).

    Attributes:
        hess_inner: (n, p, p), A_i.
        hess_outer: (n, d, d), B_i.
        cross: (n, d, p), C_i.
        linear_inner: (n, p), a_i.
        linear_outer: (n, d), b_i.
    """

    hess_inner: torch.Tensor
    hess_outer: torch.Tensor
    cross: torch.Tensor
    linear_inner: torch.Tensor
    linear_outer: torch.Tensor

    @property
    def n_samples(self) -> int:
        return int(self.hess_inner.shape[0])

    def __call__(self, inner: torch.Tensor, outer: torch.Tensor, start: int = 0,
                 batch_size: int | None = None) -> torch.Tensor:
        """q(z, x; start, batch_size), a 0-dim tensor (batch_size None: all samples).

        The batch's matrices are averaged first and one quadratic is evaluated (the same
        value as the mean of the per-sample ones, by linearity; m·p² operations, as many as
        the per-sample form), so autograd differentiates through vectors only.
        """
        stop = self.n_samples if batch_size is None else start + batch_size
        if not 0 <= start < stop <= self.n_samples:
            raise IndexError(f"batch [{start}, {stop}) is outside the {self.n_samples} samples")
        means = [t[start:stop].mean(0) for t in (self.hess_inner, self.hess_outer, self.cross,
                                                  self.linear_inner, self.linear_outer)]
        return quadratic(inner, outer, *means)

    def mean(self) -> Quadratic:
        """The full-batch objective as a one-sample Quadratic (the benchmark's ``*_fb``)."""
        return Quadratic(*(t.mean(0, keepdim=True) for t in self._arrays()))

    def to(self, dtype: torch.dtype) -> Quadratic:
        return Quadratic(*(t.to(dtype) for t in self._arrays()))

    def _arrays(self) -> tuple[torch.Tensor, ...]:
        return (self.hess_inner, self.hess_outer, self.cross, self.linear_inner,
                self.linear_outer)


def quadratic(inner: torch.Tensor, outer: torch.Tensor, hess_inner: torch.Tensor,
              hess_outer: torch.Tensor, cross: torch.Tensor, linear_inner: torch.Tensor,
              linear_outer: torch.Tensor) -> torch.Tensor:
    """½ zᵀAz + ½ xᵀBx + xᵀCz + aᵀz + bᵀx for one sample (z: (p,), x: (d,))."""
    return (0.5 * inner @ (hess_inner @ inner) + 0.5 * outer @ (hess_outer @ outer)
            + outer @ (cross @ inner) + linear_inner @ inner + linear_outer @ outer)


def from_arrays(arrays: Mapping[str, Any], dtype: torch.dtype = torch.float64) -> Quadratic:
    """A Quadratic from the benchmark's five arrays (numpy or JAX, keyed by :data:`ARRAYS`),
    copied exactly into ``dtype`` (float32 values are exact in float64)."""
    missing = [k for k in ARRAYS if k not in arrays]
    if missing:
        raise KeyError(f"from_arrays: missing {missing} (expected the keys {ARRAYS})")
    return Quadratic(*(torch.as_tensor(np.asarray(arrays[k])).to(dtype) for k in ARRAYS))


@dataclass(frozen=True)
class SimulatedProblem:
    """The benchmark's bilevel problem: ``inner`` = g, ``outer`` = f, with the metrics in
    float64 from their full-batch means (one Cholesky factor of Ā, kept)."""

    inner: Quadratic
    outer: Quadratic

    def __post_init__(self) -> None:
        g, f = self.inner.mean().to(torch.float64), self.outer.mean().to(torch.float64)
        object.__setattr__(self, "_g", g)
        object.__setattr__(self, "_f", f)
        # Ā is SPD (the benchmark's spectrum is in [mu_inner, L_inner_inner]); a failed
        # factorization is an error here, not a NaN in every metric later
        object.__setattr__(self, "_chol", torch.linalg.cholesky(g.hess_inner[0]))

    def inner_solution(self, outer: torch.Tensor) -> torch.Tensor:
        """z*(x) = −Ā⁻¹(ā + C̄ᵀx), float64 (p,)."""
        g, x = self._g, outer.detach().to(torch.float64)
        rhs = -(g.linear_inner[0] + g.cross[0].T @ x)
        return torch.cholesky_solve(rhs[:, None], self._chol)[:, 0]

    def hypergradient(self, outer: torch.Tensor) -> torch.Tensor:
        """∇h(x) in closed form (module docstring), float64 (d,)."""
        g, f, x = self._g, self._f, outer.detach().to(torch.float64)
        z = self.inner_solution(x)
        grad_z = f.hess_inner[0] @ z + f.cross[0].T @ x + f.linear_inner[0]
        grad_x = f.hess_outer[0] @ x + f.cross[0] @ z + f.linear_outer[0]
        v = -torch.cholesky_solve(grad_z[:, None], self._chol)[:, 0]
        return grad_x + g.cross[0] @ v

    def metrics(self, inner: torch.Tensor, outer: torch.Tensor) -> dict[str, float]:
        """The benchmark's ``value`` (‖∇h(x)‖²) and ``inner_distance`` (‖z*(x) − z‖²), and
        ``func`` = h(x) = f(z*(x), x) on the full outer batch."""
        z = self.inner_solution(outer)
        x = outer.detach().to(torch.float64)
        return {
            "value": float(self.hypergradient(outer).square().sum()),
            "inner_distance": float((z - inner.detach().to(torch.float64)).square().sum()),
            "func": float(self._f(z, x)),
        }
