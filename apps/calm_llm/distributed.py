"""Data parallelism for the CALM runner under ``accelerate launch`` / ``torchrun`` (DDP semantics).

Each rank takes its own slice of every global batch; gradients are averaged across ranks *inside*
the objectives: `Dist.sync` wraps the trainable tensors in an identity whose backward all-reduces
(means) the gradient. So every gradient any code takes — ``loss.backward()`` of a baseline, and
each ``torch.autograd.grad`` inside a bilevel solver (BOME's inner steps, ∇f, ∇q̂) — is already
the gradient of the mean loss over the global batch, every rank computes the same directions,
and the ranks' parameters stay identical without a DDP module wrapper (which would only hook
``.backward()`` of the module's own parameters, not the functional calls the solvers make).

The mean of per-rank losses equals the loss on the combined batch when every rank's loss is a
mean over the same number of terms (letter mode: one answer token per question). Second-order
solvers (itd/aid) differentiate through gradients and are not supported across processes.
FSDP / DeepSpeed-ZeRO sharding is refused with a clear error (see ``docs/calm.md``); a 7B base
fits one GPU per rank in bf16 or, with ``--quantization 4bit``, on small GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class _MeanGrad(torch.autograd.Function):
    """Identity forward; backward = all-reduce mean of the incoming gradient over ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: D401
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        return g / dist.get_world_size()


@dataclass
class Dist:
    """Rank/world of this process; world = 1 (all no-ops) without a process group."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sync(self, tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors whose gradients are averaged over ranks (identity when world = 1)."""
        if self.world == 1:
            return tree
        return {k: _MeanGrad.apply(v) if v.requires_grad else v for k, v in tree.items()}

    def mean(self, x: float) -> float:
        """Average a Python float over ranks (logging of losses)."""
        if self.world == 1:
            return x
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def shard_collator(self, collator: Any, per_rank: int) -> Any:
        """A collator that keeps this rank's contiguous slice of a global batch."""
        if self.world == 1:
            return collator
        return _ShardCollator(collator, self.rank, per_rank)


class _ShardCollator:
    def __init__(self, collator: Any, rank: int, per_rank: int) -> None:
        self.collator, self.rank, self.per_rank = collator, rank, per_rank

    def __call__(self, examples: list, **kwargs: Any) -> Any:
        part = examples[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        if not part:
            raise ValueError(
                f"rank {self.rank}: empty shard of a batch of {len(examples)} examples "
                "(use more training examples than processes × batch size)"
            )
        return self.collator(part, **kwargs)

    def __getattr__(self, name: str) -> Any:  # option_token_ids, mode, ...
        return getattr(self.collator, name)


def init(backend: str | None = None) -> Dist:
    """Join the process group that ``accelerate launch``/``torchrun`` describe in the environment.

    Single process (no WORLD_SIZE or WORLD_SIZE=1): returns ``Dist()`` and starts nothing.
    The backend is nccl on CUDA, gloo on CPU.
    """
    for var, what in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")):
        if os.environ.get(var, "").lower() in ("1", "true"):
            raise RuntimeError(
                f"{what} sharding is not supported by the CALM runner (the objectives call the model "
                "through torch.func.functional_call over unsharded LoRA tensors); use the DDP config "
                "apps/calm_llm/configs/accelerate-ddp.yaml, with --quantization 4bit when the base "
                "model does not fit on one GPU"
            )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return Dist(rank=dist.get_rank(), world=dist.get_world_size())


def device_for(d: Dist, requested: str) -> str:
    """Under multi-GPU launch each rank takes its local GPU."""
    if d.world > 1 and requested in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return requested
