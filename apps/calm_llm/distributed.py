"""Data parallelism for the CALM runner under ``accelerate launch`` / ``torchrun``: DDP, or FSDP.

Each rank takes its own slice of every global batch; gradients are averaged across ranks *inside*
the objectives: `Dist.sync` wraps the trainable tensors in an identity whose backward all-reduces
(means) the gradient. So every gradient any code takes — ``loss.backward()`` of a baseline, and
each ``torch.autograd.grad`` inside a bilevel solver (BOME's inner steps, ∇f, ∇q̂) — is already
the gradient of the mean loss over the global batch, every rank computes the same directions,
and the ranks' parameters stay identical without a DDP module wrapper (which would only hook
``.backward()`` of the module's own parameters, not the functional calls the solvers make).

FSDP (`shard_frozen_base`, PyTorch FSDP2 ``fully_shard``) shards only the *frozen base weights*:
one FSDP unit per transformer block plus the root, with the LoRA tensors passed as
``ignored_params``. The LoRA tensors stay plain, replicated tensors, so
``torch.func.functional_call`` swaps them exactly as without FSDP and their gradients are
averaged by `Dist.sync` as in DDP; FSDP all-gathers a block's base weights before its forward
(and again before its backward) and frees them after, so each rank holds 1/world of the base.
Base weights get no gradients, so FSDP has nothing to reduce-scatter. The training math is the
DDP math; only where the frozen weights live changes.

The mean of per-rank losses equals the loss on the combined batch when every rank's loss is a
mean over the same number of terms (letter mode: one answer token per question). Second-order
solvers (itd/aid) differentiate through gradients and are not supported across processes.
DeepSpeed is refused with a clear error (see ``docs/calm.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError


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
    """Rank/world of this process; world = 1 (all no-ops) without a process group.

    Attributes:
        rank, world: this process and the number of processes.
        fsdp: shard the frozen base weights over the ranks (`shard_frozen_base`).
        reshard_after_forward: FSDP frees a block's gathered weights after its forward (True,
            least memory) or keeps them until its backward (False: one all-gather less per block).
    """

    rank: int = 0
    world: int = 1
    fsdp: bool = False
    reshard_after_forward: bool = True

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
        t = torch.tensor([float(x)], dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def check_identical(self, tensors: dict[str, torch.Tensor], what: str) -> None:
        """Raise if the ranks' copies of `tensors` differ (they must: every rank takes the same steps).

        Compares per-tensor float64 fingerprints (Σx, Σ|x|, Σx·w with a fixed pseudo-random w)
        through one all-reduce of their max and one of their min: equal tensors give bitwise
        equal fingerprints, and a drift of one element changes Σx·w unless it is exactly zero.
        """
        if self.world == 1:
            return
        names = sorted(tensors)
        rows = []
        for n in names:
            x = tensors[n].detach().double().flatten()
            w = torch.sin(torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device))
            rows.append(torch.stack([x.sum(), x.abs().sum(), (x * w).sum()]))
        fp = torch.stack(rows).to(_comm_device()) if rows else torch.zeros(0, 3, dtype=torch.float64)
        hi, lo = fp.clone(), fp.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        differ = (hi != lo).any(1)
        if bool(differ.any()):
            bad = [names[i] for i in differ.nonzero().flatten().tolist()]
            raise RuntimeError(
                f"{what}: the {self.world} ranks hold different values of {len(bad)} tensor(s), "
                f"e.g. {bad[:3]}; data-parallel training must keep them identical"
            )

    def shard_collator(self, collator: Any, per_rank: int) -> Any:
        """A collator that keeps this rank's contiguous slice of a global batch."""
        if self.world == 1:
            return collator
        return _ShardCollator(collator, self.rank, per_rank)


def _comm_device() -> torch.device:
    """Where collectives' own tensors live: the current GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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


def _env_true(var: str) -> bool:
    return os.environ.get(var, "").lower() in ("1", "true", "yes")


def init(backend: str | None = None, *, fsdp: bool = False) -> Dist:
    """Join the process group that ``accelerate launch``/``torchrun`` describe in the environment.

    Single process (no WORLD_SIZE or WORLD_SIZE=1): returns ``Dist()`` and starts nothing.
    The backend is nccl on CUDA, gloo on CPU. FSDP is on when ``fsdp`` is asked for (``--fsdp``)
    or when an accelerate FSDP config launched us (``ACCELERATE_USE_FSDP``); of that config the
    runner reads ``fsdp_reshard_after_forward`` and refuses ``fsdp_offload_params`` (the
    sharding itself is `shard_frozen_base`, not accelerate's wrapping policy).
    """
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        raise ConfigError(
            "DeepSpeed is not supported by the CALM runner (its engine owns the module's "
            "parameters, while the objectives call the model through torch.func.functional_call "
            "over the LoRA tensors); use apps/calm_llm/configs/accelerate-fsdp.yaml to shard the "
            "base model, or accelerate-ddp.yaml (with --quantization 4bit on small GPUs)"
        )
    fsdp = fsdp or _env_true("ACCELERATE_USE_FSDP")
    if fsdp and _env_true("FSDP_OFFLOAD_PARAMS"):
        raise ConfigError(
            "fsdp_offload_params is not supported by the CALM runner (the LoRA tensors stay on the "
            "GPU outside FSDP); set it to false in the accelerate config"
        )
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() != "false"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(fsdp=fsdp, reshard_after_forward=reshard)
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return Dist(rank=dist.get_rank(), world=dist.get_world_size(), fsdp=fsdp,
                reshard_after_forward=reshard)


def device_for(d: Dist, requested: str) -> str:
    """Under multi-GPU launch each rank takes its local GPU."""
    if d.world > 1 and requested in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return requested


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model (its ``_no_split_modules`` classes)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_frozen_base(model: nn.Module, d: Dist, device: torch.device) -> nn.Module:
    """FSDP2-shard the frozen weights of `model` over the ranks of `d`; trainable tensors stay whole.

    ``fully_shard`` goes on every transformer block, then on the root (embeddings, final norm,
    head); all parameters with ``requires_grad`` (LoRA) are ``ignored_params``: not sharded,
    not managed, so ``functional_call`` can swap them and `Dist.sync` averages their gradients.
    FSDP moves what it manages to `device` (the model may be loaded on the CPU, so no GPU ever
    holds the whole base); the ignored tensors and any leftover buffer are moved here.

    Args:
        model: the LoRA-wrapped model, base weights frozen, unquantized.
        d: a process group with ``world > 1``.
        device: this rank's device (the mesh is built over ``device.type``).
    Returns:
        `model`, sharded in place.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if d.world <= 1:
        raise ConfigError("FSDP needs several processes (accelerate launch / torchrun)")
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if any(not p.is_floating_point() or type(p) is not nn.Parameter for p in frozen):
        raise ConfigError(
            "FSDP cannot shard quantized (4/8-bit) base weights here; use --quantization none "
            "with FSDP, or the DDP config with --quantization 4bit"
        )
    trainable = {p for p in model.parameters() if p.requires_grad}
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(
            f"FSDP: found no transformer blocks in {type(model).__name__} (no _no_split_modules); "
            "the DDP config works for any model"
        )
    mesh = init_device_mesh(device.type, (d.world,))
    for block in blocks:
        fully_shard(block, mesh=mesh, ignored_params=trainable,
                    reshard_after_forward=d.reshard_after_forward)
    fully_shard(model, mesh=mesh, ignored_params=trainable,
                reshard_after_forward=d.reshard_after_forward)
    with torch.no_grad():
        for p in trainable:
            p.data = p.data.to(device)
        for mod in model.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.device != device:
                    mod._buffers[name] = buf.to(device)
    return model
