"""SABA, the SAGA-variance-reduced single-loop method of Dagréou, Ablin, Vaiter & Moreau, "A
framework for bilevel optimization that enables stochastic and global variance reduction
algorithms", NeurIPS 2022: SOBA's directions with every oracle replaced by its
SAGA estimate (Defazio, Bach & Lacoste-Julien, NeurIPS 2014) over finite sums of batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import tree
from .._autodiff import leaf_aliases
from .._checks import check_int, check_positive
from .._internals import CheckedObjectives, FlatVariables, flatten_variables
from ..distributed import all_mean, world_size
from ..problem import Problem
from ._state import SolverState, WarmStart
from .base import StepResult
from .soba import lower_oracles, soba_result, upper_oracles

__all__ = ["SABA", "Indexed"]


@dataclass(frozen=True)
class Indexed:
    """A batch together with its index in a finite sum: how SABA learns which of its
    ``n_upper``/``n_lower`` memory entries a step's batch refreshes. The objectives receive
    ``batch`` only; ``index`` is an int in [0, n)."""

    index: int
    batch: Any


class SagaTable:
    """The SAGA memory of one finite sum of n terms: the last oracle value seen per index
    (one ``(n, *shape)`` tensor per leaf) and their mean, kept incrementally.

    ``estimate(i, new)`` = new − memory_i + mean(memory) (unbiased for the full-sum oracle
    when i is uniform); ``commit`` then stores new as memory_i and updates the mean by
    (new − memory_i)/n. A table not yet filled holds zeros (SAGA started from a zero memory).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.rows: list[torch.Tensor] | None = None
        self.mean: list[torch.Tensor] | None = None

    def fill(self, rows: list[list[torch.Tensor]]) -> None:
        """Every entry at once (``rows[i]`` = the oracle of term i); the mean recomputed."""
        self.rows = [torch.stack(leaf) for leaf in zip(*rows)]
        self.mean = [r.mean(dim=0) for r in self.rows]

    def estimate(self, owner: str, index: int, new: list[torch.Tensor]) -> list[torch.Tensor]:
        """The variance-reduced oracle for term ``index`` (nothing is stored yet)."""
        if self.rows is None or self.mean is None:
            self.rows = [torch.zeros((self.n, *x.shape), dtype=x.dtype, device=x.device) for x in new]
            self.mean = [torch.zeros_like(x) for x in new]
        for r, x in zip(self.rows, new):
            if r.shape[1:] != x.shape or r.dtype != x.dtype or r.device != x.device:
                raise ValueError(
                    f"{owner}: the SAGA memory holds leaves of shape {tuple(r.shape[1:])}, "
                    f"{r.dtype} on {r.device} but this step's variables give {tuple(x.shape)}, "
                    f"{x.dtype} on {x.device}; call reset() before changing the variables"
                )
        return [x - r[index] + m for x, r, m in zip(new, self.rows, self.mean)]

    def commit(self, index: int, new: list[torch.Tensor]) -> None:
        """Store ``new`` as entry ``index`` and move the mean by (new − old)/n."""
        assert self.rows is not None and self.mean is not None  # estimate() ran first
        for x, r, m in zip(new, self.rows, self.mean):
            m.add_(x - r[index], alpha=1.0 / self.n)
            r[index] = x


class _Memory:
    """SABA's two SAGA tables: the lower sum's (∇_θ g_i, ∇²_αθ g_i v, ∇²_θθ g_i v) and the
    upper sum's (∇_α f_j, ∇_θ f_j)."""

    def __init__(self) -> None:
        self.lower: SagaTable | None = None
        self.upper: SagaTable | None = None

    def state_dict(self) -> dict:
        def table(t: SagaTable | None) -> dict | None:
            if t is None or t.rows is None or t.mean is None:
                return None
            return {"rows": [r.clone() for r in t.rows], "mean": [m.clone() for m in t.mean]}

        return {"lower": table(self.lower), "upper": table(self.upper)}

    def load_state_dict(self, state: dict) -> None:
        for which in ("lower", "upper"):
            saved = state[which]
            if saved is None:
                setattr(self, which, None)
                continue
            t = SagaTable(int(saved["rows"][0].shape[0]) if saved["rows"] else 0)
            t.rows, t.mean = [r.clone() for r in saved["rows"]], [m.clone() for m in saved["mean"]]
            setattr(self, which, t)

    def clear(self) -> None:
        self.lower = self.upper = None


@dataclass(frozen=True)
class SABA(SolverState):
    """SOBA with SAGA variance reduction over finite sums (Dagréou et al. 2022, SABA):

        g = (1/n) Σ_i g_i,  f = (1/m) Σ_j f_j   (n = ``n_lower``, m = ``n_upper`` batches)

    A step gets one lower batch i and one upper batch j, evaluates SOBA's oracles on them at
    the current (α, θ, v), and replaces each oracle o_i by its SAGA estimate
    ô = o_i − memory_i + (1/n) Σ_k memory_k (memory_i: o_i at the point where batch i was
    last seen), then stores o_i as memory_i. The directions are SOBA's, with the estimates:

        D_θ = ∇̂_θ g,   D_v = ∇̂²_θθ g v + ∇̂_θ f (v ← v − ``v_lr`` D_v),   D_α = ∇̂_α f + ∇̂²_αθ g v

    As the estimates' variance vanishes at the solution, SABA converges with constant step
    sizes where SOBA, stochastic, only reaches a noise ball (the paper's convergence result
    for SABA; checked in tests/bilevel/test_bilevel_saba.py).

    Batches: ``upper_batch`` and ``lower_batch`` must be :class:`Indexed` (index, batch)
    — the shared ``step`` interface unchanged; e.g. ``fit(..., batches=lambda k:
    (Indexed(j, upper[j]), Indexed(i, lower[i])))`` with i, j drawn uniformly (the
    estimates are unbiased only for uniform indices). The memory starts at zero;
    :meth:`fill_memory` evaluates every entry at the current point, SAGA's usual start
    (a full pass: n + m oracle calls), and after it the direction at that point is
    exactly the full-sum SOBA direction. :meth:`reset` forgets v and the memory.

    Cost per step: SOBA's (one forward of g with ``create_graph``, one backward through ∇_θ g
    for both HVPs, one forward-backward of f) plus O(|α| + |θ|) arithmetic. Memory: SOBA's,
    plus the tables: n · (|α| + 2|θ|) + m · (|α| + |θ|) numbers.
    """

    v_lr: float
    n_upper: int
    n_lower: int
    _v: WarmStart = field(default_factory=WarmStart, init=False, repr=False, compare=False)
    _memory: _Memory = field(default_factory=_Memory, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive("SABA", "v_lr", self.v_lr)
        check_int("SABA", "n_upper", self.n_upper, minimum=1)
        check_int("SABA", "n_lower", self.n_lower, minimum=1)

    def _index(self, batch: object, which: str) -> tuple[int, Any]:
        n = self.n_upper if which == "upper" else self.n_lower
        if not isinstance(batch, Indexed):
            raise TypeError(
                f"SABA.step: {which}_batch must be bilevel.Indexed(index, batch) so that SABA "
                f"knows which of its n_{which}={n} memory entries it refreshes, got "
                f"{type(batch).__name__}; wrap it, e.g. Indexed(i, batches[i])"
            )
        i = batch.index
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(
                f"SABA.step: {which}_batch.index must be an int in [0, n_{which}={n}), got "
                f"{i!r}; raise n_{which} or fix the index"
            )
        return i, batch.batch

    def fill_memory(
        self,
        problem: Problem,
        outer: Any,
        inner: Any,
        *,
        upper_batches: Sequence[Any],
        lower_batches: Sequence[Any],
    ) -> None:
        """Evaluate every memory entry at the current (α, θ, v) (v = 0 before any step):
        ``lower_batches[i]`` for i < n_lower, ``upper_batches[j]`` for j < n_upper (plain
        batches, not :class:`Indexed`). Replaces the whole memory; v is unchanged."""
        for which, batches, n in (("upper", upper_batches, self.n_upper),
                                  ("lower", lower_batches, self.n_lower)):
            if len(batches) != n:
                raise ValueError(
                    f"SABA.fill_memory: {which}_batches has {len(batches)} batches but "
                    f"n_{which}={n}; pass one batch per memory entry"
                )
            if any(isinstance(b, Indexed) for b in batches):
                raise TypeError(
                    f"SABA.fill_memory: {which}_batches[i] is entry i already; pass the plain "
                    "batches, not bilevel.Indexed"
                )
        objectives = CheckedObjectives(problem, "SABA.fill_memory")
        variables, alpha, theta, trees, v = self._start("SABA.fill_memory", outer, inner)
        lower = [list(lower_oracles(objectives, alpha, theta, trees, b, v)[1:]) for b in lower_batches]
        upper = [list(upper_oracles(objectives, alpha, theta, trees, b)[1:]) for b in upper_batches]
        objectives.check()
        self._memory.lower, self._memory.upper = SagaTable(self.n_lower), SagaTable(self.n_upper)
        self._memory.lower.fill([sum(o, []) for o in lower])
        self._memory.upper.fill([sum(o, []) for o in upper])

    def _start(self, owner: str, outer: Any, inner: Any) -> tuple[
        FlatVariables, list[torch.Tensor], list[torch.Tensor], tuple[Any, Any], list[torch.Tensor]
    ]:
        variables = flatten_variables(owner, outer, inner)
        alpha, theta = leaf_aliases(variables.outer), leaf_aliases(variables.inner)
        trees = (variables.outer_tree(alpha), variables.inner_tree(theta))
        v = self._v.init_for(variables.inner)
        return variables, alpha, theta, trees, tree.zeros_like_list(variables.inner) if v is None else v

    def step(
        self, problem: Problem, outer: Any, inner: Any, *, upper_batch: Any, lower_batch: Any
    ) -> StepResult:
        """One SABA step on batches ``Indexed(j, ·)`` (upper) and ``Indexed(i, ·)`` (lower)."""
        j, ub = self._index(upper_batch, "upper")
        i, lb = self._index(lower_batch, "lower")
        _check_same_indices(j, i)
        objectives = CheckedObjectives(problem, "SABA.step")
        variables, alpha, theta, trees, v = self._start("SABA.step", outer, inner)
        g, *low = lower_oracles(objectives, alpha, theta, trees, lb, v)
        f, *up = upper_oracles(objectives, alpha, theta, trees, ub)
        low_new, up_new = sum(low, []), sum(up, [])
        mem = self._memory
        mem.lower = mem.lower or SagaTable(self.n_lower)
        mem.upper = mem.upper or SagaTable(self.n_upper)
        low_hat = mem.lower.estimate("SABA.step", i, low_new)
        up_hat = mem.upper.estimate("SABA.step", j, up_new)
        na, nt = len(alpha), len(theta)
        g_theta, hv_alpha, hv_theta = low_hat[:nt], low_hat[nt : nt + na], low_hat[nt + na :]
        f_alpha, f_theta = up_hat[:na], up_hat[na:]
        d_alpha = [fa + h for fa, h in zip(f_alpha, hv_alpha)]
        d_v = [h + ft for h, ft in zip(hv_theta, f_theta)]
        result, self._v.v = soba_result(
            objectives, variables, (f, g), (d_alpha, g_theta, d_v), v, self.v_lr
        )
        # Only after the finiteness check inside soba_result: a failed step stores nothing.
        mem.lower.commit(i, low_new)
        mem.upper.commit(j, up_new)
        return result


def _check_same_indices(j: int, i: int) -> None:
    """Under data parallelism, every rank must refresh the same memory entries: entry i is
    then the union of the ranks' shards of batch i, and the averaged oracles of the ranks
    are that union's (docs/bilevel.md, "Distributed (data-parallel) runs"). Checked with
    one collective: the ranks' indices agree iff their variance over the ranks is 0 (for
    integers not all equal it is at least (W − 1)/W², far above round-off)."""
    W = world_size()
    if W == 1:
        return
    x = torch.tensor([j, i, j * j, i * i], dtype=torch.float64)
    m = all_mean([x])[0].tolist()
    if any(m[2 + k] - m[k] ** 2 > 0.5 / W**2 for k in range(2)):
        raise ValueError(
            "SABA.step: the data-parallel ranks passed different Indexed indices; every "
            "rank must pass the same index (its own shard of batch i), e.g. from a "
            "generator seeded the same on every rank"
        )
