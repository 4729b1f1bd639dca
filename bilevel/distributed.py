"""Data-parallel runs over ``torch.distributed``: every rank its own shard of the batches.

Launched with ``torchrun --nproc-per-node W script.py`` (or any launcher that initializes a
process group), every rank holds the same α and θ and its own equal-sized shard of the upper
and lower batches. Each gradient a solver forms from a batch (w.r.t. α or θ: an inner step's,
a Hessian-vector or mixed product of a linear solve, ∇f, BOME's value-function terms, SOBA's
oracles, a meta-gradient) is averaged over the ranks with one ``torch.distributed.all_reduce``
(SUM, then ÷ W: gloo has no AVG) before it is used, so for objectives that are means over
their batch, with shards of equal size,

    (1/W) Σ_r ∇ mean_{i ∈ shard r} ℓ_i  =  ∇ mean_{i ∈ batch} ℓ_i,

every rank computes the same directions as one process on the concatenated batch (to
round-off) and the ranks' variables stay identical. See docs/bilevel.md, "Distributed
(data-parallel) runs", for where the averages are taken and what is not covered.

Data parallelism is on whenever a process group is initialized and has more than one rank;
``with bilevel.distributed.data_parallel(False):`` (or ``bilevel.fit(..., distributed=False)``)
turns it off, ``data_parallel(True, group=g)`` names a subgroup (e.g. the data-parallel
group of a model-parallel run).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from . import tree

__all__ = ["average", "barrier", "data_parallel", "is_data_parallel", "rank", "shard",
           "world_size"]

# (enabled, group): enabled None = on whenever a process group is initialized (the default)
_SETTING: ContextVar[tuple[bool | None, Any]] = ContextVar("bilevel_data_parallel",
                                                           default=(None, None))


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextmanager
def data_parallel(enabled: bool = True, group: Any = None) -> Iterator[None]:
    """Turn data parallelism on (over ``group``, default the whole world) or off inside the
    ``with`` block, whatever the default would be. ``enabled=True`` without an initialized
    process group is a RuntimeError (a run meant to be parallel must not silently run alone)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"data_parallel: enabled must be a bool, got {enabled!r}")
    if enabled and not _initialized():
        raise RuntimeError(
            "data_parallel(True): no torch.distributed process group is initialized; launch "
            "with torchrun and call torch.distributed.init_process_group() first"
        )
    token = _SETTING.set((enabled, group))
    try:
        yield
    finally:
        _SETTING.reset(token)


def world_size() -> int:
    """W, the number of ranks the gradients are averaged over (1 when data parallelism is off)."""
    enabled, group = _SETTING.get()
    if enabled is False or not _initialized():
        return 1
    return dist.get_world_size(group)


def rank() -> int:
    """This process's rank in the data-parallel group (0 when data parallelism is off)."""
    enabled, group = _SETTING.get()
    if enabled is False or not _initialized():
        return 0
    return dist.get_rank(group)


def is_data_parallel() -> bool:
    """True when the solvers average their gradients over more than one rank."""
    return world_size() > 1


def barrier() -> None:
    """Wait until every data-parallel rank has arrived (``torch.distributed.barrier``); nothing
    when data parallelism is off. ``fit`` calls it after rank 0 writes a checkpoint."""
    if world_size() > 1:
        dist.barrier(group=_SETTING.get()[1])


def all_mean(xs: Sequence[torch.Tensor], *, differentiable: bool = False) -> list[torch.Tensor]:
    """(1/W) Σ_r x_r for each tensor of ``xs`` (flat list), the identity when W = 1.

    The tensors are concatenated into one buffer per (dtype, device) so that a whole
    gradient costs one collective, not one per leaf. ``differentiable=True`` uses
    ``torch.distributed.nn.functional.all_reduce``, whose backward all-reduces the incoming
    gradient (the adjoint of a mean over ranks is a mean over ranks): for an unrolled inner
    step θ_{t+1} = θ_t − β mean_r ∇g_r(θ_t) that reverse-mode differentiates through.
    Otherwise the result carries no graph.
    """
    W = world_size()
    xs = list(xs)
    if W == 1 or not xs:
        return xs
    group = _SETTING.get()[1]
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, x in enumerate(xs):
        buckets.setdefault((x.dtype, x.device), []).append(i)
    out: list[torch.Tensor] = list(xs)
    for idx in buckets.values():
        parts = [xs[i] for i in idx]
        if differentiable:
            # imported here: torch.distributed.nn pulls in RPC modules a plain run never needs
            from torch.distributed.nn.functional import all_reduce

            flat = all_reduce(torch.cat([x.reshape(-1) for x in parts]), group=group) / W
        else:
            with torch.no_grad():
                flat = torch.cat([x.detach().reshape(-1) for x in parts])  # fresh storage
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
                flat.div_(W)
        for i, piece in zip(idx, flat.split([x.numel() for x in parts])):
            out[i] = piece.view_as(xs[i])
    return out


def average(values: Any) -> Any:
    """The mean over the data-parallel ranks of a pytree of tensors (one collective per
    dtype and device), e.g. a metric each rank computed on its shard; the pytree itself
    when data parallelism is off. Every rank must call it (it is a collective)."""
    leaves, spec = tree.flatten(values, name="average")
    return tree.unflatten(all_mean(leaves), spec)


def shard(batch: Any) -> Any:
    """This rank's shard of a batch held whole by every rank: each tensor leaf split along
    dim 0 into W equal parts, part ``rank()`` kept (a view; non-tensor leaves unchanged).
    The batch itself when data parallelism is off.

    Equal shards are what makes the mean of the ranks' mean gradients the full-batch mean
    gradient; a leading size that W does not divide is a ValueError (pad or drop examples,
    as ``torch.utils.data.DistributedSampler`` does, instead).
    """
    W, r = world_size(), rank()
    if W == 1:
        return batch
    leaves, spec = pytree.tree_flatten_with_path(batch)
    out = []
    for path, x in leaves:
        if isinstance(x, torch.Tensor):
            n = x.shape[0] if x.ndim else 0
            if x.ndim == 0 or n % W:
                raise ValueError(
                    f"shard: batch{pytree.keystr(path)} has leading size {n if x.ndim else '()'}, "
                    f"which {W} ranks cannot split into equal shards; the mean over ranks of "
                    "per-shard means equals the full-batch mean only for equal shards, so "
                    f"pad or drop examples to a multiple of {W}"
                )
            x = x.tensor_split(W)[r]
        out.append(x)
    return pytree.tree_unflatten(out, spec)
