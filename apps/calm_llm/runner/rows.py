"""One row of a run, for any task: train (stage 3) → fit and evaluate (stage 4) → export and
summarize (stage 5). A row is a method, or a ``--select`` variant of one; ``row:no_alpha`` is
evaluated with it.
"""

from __future__ import annotations

import time

from .. import methods as method_registry
from ..methods.base import Context
from .load import Evaluation
from .report import RunState, finish_row
from .train import train_row


def run_row(state: RunState, ev: Evaluation, info: method_registry.MethodInfo, row: str,
            ctx: Context, *, seed: int, select: bool = False) -> None:
    """Train ``info``'s method as row ``row`` from the shared LoRA initialization with the
    generator at ``seed`` (resumably), fit and evaluate it with the run's task
    (``state.task.evaluate``, which writes the results), export it and log its summary."""
    t0 = time.time()
    method = train_row(info, row, ctx, init_lora=ev.init_lora, seed=seed, run_dir=state.run_dir,
                       config_hash=state.config_hash, resume=bool(state.cfg.resume))
    state.task.evaluate(state, ev, info, method, row, ctx, select=select)
    finish_row(state, ctx, method, row, t0)
