"""Stage 2 of a run, for any task: the model (with its LoRA initialization) and the
model-side state every row is run against (`Evaluation`), and the evaluation sets of a run's
splits. The data and the collators are the task's (`apps.calm_llm.tasks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import distributed
from .. import model as model_lib
from ..config import Config, needs_second_order
from ..logs import log
from ..methods.base import Context
from .train import EvalSet


@dataclass
class Evaluation:
    """The model-side state every row is run against: the context, the evaluation sets and the
    LoRA initialization each row starts from. A task that keeps more (multiple choice: the
    untrained model's option logits; open QA: the clustering backend) subclasses it."""

    ctx: Context
    eval_sets: list[EvalSet]
    init_lora: dict[str, torch.Tensor]

    def at_init(self) -> bool:
        """Whether the model's trained tensors are still ``init_lora`` (a method that trains
        nothing could still have loaded others: then its logits are its own)."""
        now = self.ctx.lm.inner()
        return now.keys() == self.init_lora.keys() and all(
            torch.equal(now[k], v) for k, v in self.init_lora.items())


# -- model ---------------------------------------------------------------------------------------
def load_model(cfg: Config, dist: distributed.Dist) -> Any:
    """Seed with ``--seed``, then load the model (base + LoRA θ) on the run's device."""
    torch.manual_seed(cfg.seed)
    device = model_lib.resolve_device(distributed.device_for(dist, cfg.device))
    log(f"loading model {cfg.model.name_or_path!r} on {device}", dist)
    if dist.fsdp:
        log(f"FSDP: base weights sharded over {dist.world} processes" if dist.world > 1
            else "FSDP asked for in a single process: nothing to shard over; running unsharded",
            dist)
    return model_lib.load(cfg.model, device=device, eager=needs_second_order(cfg), seed=cfg.seed,
                          dist=dist)


def eval_sets(splits: Any) -> list[EvalSet]:
    """The in-domain test sets, then the out-of-domain ones."""
    return ([EvalSet(n, "id", ex) for n, ex in splits.test.items()]
            + [EvalSet(n, "ood", ex) for n, ex in splits.ood.items()])


