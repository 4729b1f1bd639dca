"""Dense: materialize A from n matvecs and solve it exactly (rank-revealing pseudo-inverse)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import tree
from .._checks import check_int, check_nonnegative
from ._base import Info, LinearSolver, ListMatvec, flat_cat, split_like

__all__ = ["Dense"]


@dataclass(frozen=True)
class Dense(LinearSolver):
    """Exact solve: materializes A (n × n) from n matvecs with unit vectors, then
    x = A⁺ b through the singular value decomposition A = U Σ Vᵀ,

        x = Σ_{i : σ_i > rcond·σ_max} (u_iᵀ b / σ_i) v_i,

    the minimum-norm least-squares solution; singular values at or below rcond·σ_max count
    as zero (``info["rank"]`` is the number kept). ``rcond=None`` (the default) is n·ε of the
    dtype (numpy's ``matrix_rank`` and ``lstsq`` default): a direction that round-off alone
    could have produced is dropped, not amplified by 1/σ. A nonsingular A gets A⁻¹ b.

    There is no LU fast path: ``torch.linalg.solve_ex`` reports success on numerically
    singular matrices (it returned 3–7× wrong answers here) and no condition estimate comes
    cheaper than the SVD itself. Measured (2-core CPU, one thread, float64, 2026-12-07): the
    SVD takes 1.2 ms at n = 66, where the 66 Hessian-vector products of the 5-8-2 MLP of
    ``bench/linalg_nonconvex.py`` take ~60 ms; 0.10 s at n = 500 and 5.2 s at n = 2000
    (LU: 6 ms and 0.21 s), when 2000 autograd matvecs of a real model cost seconds too. For
    small problems and as a test oracle only: refuses n > ``max_size`` (n matvecs, n²
    memory, O(n³) SVD). ``init`` is
    accepted and ignored. ``info``: ``iterations`` (= n matvecs), ``rank``, ``residual``
    (the true ‖b − A x‖, from the materialized A; > 0 when b is outside A's range) and
    ``converged`` (True: the least-squares problem is solved exactly).
    """

    max_size: int = 4096
    rcond: float | None = None

    def __post_init__(self) -> None:
        check_int("Dense", "max_size", self.max_size, minimum=1)
        if self.rcond is not None:
            check_nonnegative("Dense", "rcond", self.rcond)
            if self.rcond >= 1.0:
                raise ValueError(f"Dense: rcond must be < 1 (relative to σ_max), got {self.rcond}")

    def solve(
        self,
        matvec: ListMatvec,
        b: Sequence[torch.Tensor],
        init: Sequence[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], Info]:
        """``(x, {"iterations", "rank", "residual", "converged"})``; see the class docstring."""
        b = list(b)
        n = tree.numel_list(b)
        if n > self.max_size:
            raise ValueError(
                f"Dense: the system has {n} unknowns, more than max_size={self.max_size}; "
                "use MINRES, CG or NormalCG for large inner variables"
            )
        if n == 0:
            return [t.clone() for t in b], _info(0, 0, 0.0)
        dtype = b[0].dtype
        for t in b[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        flat_b = torch.cat([t.reshape(-1).to(dtype) for t in b])
        eye = torch.eye(n, dtype=dtype, device=flat_b.device)
        columns = [flat_cat(matvec(split_like(eye[i], b))) for i in range(n)]
        a = torch.stack(columns, dim=1).to(dtype)  # column i = A e_i
        if not bool(torch.isfinite(a).all()):
            raise FloatingPointError("Dense: the materialized matrix has non-finite entries")
        x, rank = pinv_solve(a, flat_b, self.rcond)
        residual = float(torch.linalg.vector_norm(flat_b - a @ x))
        return split_like(x, b), _info(n, rank, residual)


def _info(n: int, rank: int, residual: float) -> Info:
    return {"iterations": float(n), "rank": float(rank), "residual": residual, "converged": True}


def pinv_solve(
    a: torch.Tensor, b: torch.Tensor, rcond: float | None = None
) -> tuple[torch.Tensor, int]:
    """``(A⁺ b, rank)`` for an (n, n) matrix ``a`` and an (n,) vector ``b``, by the SVD with
    singular values ≤ rcond·σ_max dropped (rcond None: n·ε of a's dtype)."""
    n = a.shape[0]
    if rcond is None:
        rcond = n * torch.finfo(a.dtype).eps
    u, s, vh = torch.linalg.svd(a)
    if not math.isfinite(float(s[0])) or float(s[0]) == 0.0:
        return torch.zeros_like(b), 0
    keep = s > rcond * s[0]
    rank = int(keep.sum())
    coef = (u[:, :rank].T @ b) / s[:rank]  # singular values come sorted, largest first
    return vh[:rank].T @ coef, rank
