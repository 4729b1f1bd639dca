"""Stage 3 of a run, shared by both tasks: train one row (a method, or a ``--select``
variant of one) for ``--steps`` optimizer steps, with checkpoints, resume and the history."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import Diverged, NonFiniteLoss
from .. import checkpoint
from ..history import HistoryWriter, plot_training
from ..logs import log
from ..methods.base import Context, Method, all_finite
from .prepare import mark_started


@dataclass
class EvalSet:
    name: str
    domain: str  # "id" | "ood"
    examples: list


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory the CUDA allocator held on ``device`` since its last reset (GiB); None
    elsewhere (the CPU keeps no such statistic). One function, so that a test can stand in
    for the GPU's statistics."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def check_finite(method: Method, ctx: Context, step: int, last_good: str) -> None:
    """Raise `Diverged` when optimizer step ``step`` applied a non-finite gradient or left a
    non-finite trained tensor (LoRA θ, α), before that state can be checkpointed.

    A loss can stay finite while the weights are not (a too large --lr first makes LoRA's B
    huge, then inf/NaN, and the loss sits at ln V), so the loss check alone lets a diverged
    state through. Cost: one isfinite reduction per trained tensor and one host sync per step.
    """
    trained = [*ctx.lm.inner().values(), *method.outer_params().values()]
    grads_ok, params_ok = torch.stack([method.grads_finite.to(ctx.lm.device),
                                       all_finite(trained).to(ctx.lm.device)]).tolist()
    method.grads_finite = torch.ones((), dtype=torch.bool)  # the next step's flags start afresh
    if grads_ok and params_ok:
        return
    what = "gradients" if not grads_ok else "parameters (LoRA θ or α)"
    t, c = ctx.cfg.train, ctx.cfg.calm
    lrs = f"--lr {t.lr:g}" + (f", --alpha-lr {c.alpha_lr:g}" if method.outer_params() else "")
    clip = " or clip θ's gradient with --max-grad-norm" if t.max_grad_norm == 0 else ""
    raise Diverged(
        f"[{method.name}] training diverged: non-finite {what} at step {step} ({lrs}); "
        f"nothing of this step was checkpointed, last good checkpoint: {last_good}. Lower the "
        f"learning rate{clip} and start a new run with --out"
    )


def train_method(
    method: Method, ctx: Context, *, run_dir: Path, config_hash: str, resume: bool
) -> list[dict[str, float]]:
    """Run ``cfg.train.steps`` optimizer steps of `method`, checkpointing and resuming."""
    from tqdm.auto import tqdm

    cfg = ctx.cfg
    ckpt_dir = run_dir / "checkpoints" / method.name
    start, history = 0, []
    mark_started(run_dir, ctx.dist)
    if resume and checkpoint.exists(ckpt_dir):
        start, history = checkpoint.restore(ckpt_dir, method=method, lm=ctx.lm,
                                            config_hash=config_hash)
        log(f"[{method.name}] resumed from {ckpt_dir} at step {start}", ctx.dist)
    record = HistoryWriter(run_dir, method.name, enabled=ctx.dist.main,
                           tensorboard=cfg.report_to == "tensorboard")
    record.start(history)  # the file holds the kept steps: no gap, no step twice
    last_good = str(ckpt_dir) if checkpoint.exists(ckpt_dir) else "none (no checkpoint yet)"
    bar = tqdm(range(start, cfg.train.steps), desc=method.name, initial=start,
               total=cfg.train.steps, disable=not ctx.dist.main, file=sys.stderr)
    cuda = ctx.lm.device.type == "cuda"
    if cuda:  # the peak recorded below is this method's own
        torch.cuda.reset_peak_memory_stats(ctx.lm.device)
    with ctx.lm.mode(True):
        for k in bar:
            t0 = time.perf_counter()
            try:
                info = method.step(k)
            except FloatingPointError as e:  # bilevel's solvers check their objectives each step
                raise NonFiniteLoss(
                    f"[{method.name}] non-finite loss at step {k + 1} ({e}); "
                    f"last good checkpoint: {last_good}"
                ) from e
            loss = ctx.dist.mean(info["loss"])
            if not math.isfinite(loss):
                raise NonFiniteLoss(
                    f"[{method.name}] non-finite loss ({loss}) at step {k + 1}; "
                    f"last good checkpoint: {last_good}"
                )
            check_finite(method, ctx, k + 1, last_good)
            # cost of the step on record (what studies and GPU estimates are sized from); the
            # loss read above has synchronised the device
            cost = {"step_seconds": time.perf_counter() - t0}
            peak = peak_memory_gib(ctx.lm.device)
            if peak is not None:
                cost["max_memory_gib"] = peak
            history.append({"step": k + 1, **{key: float(v) for key, v in info.items()}, **cost})
            record.append(history[-1])
            bar.set_postfix(loss=f"{loss:.4f}")
            done = k + 1
            if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.train.steps):
                if ctx.dist.main:
                    checkpoint.save(ckpt_dir, method=method, lora=ctx.lm.inner(), step=done,
                                    config_hash=config_hash, history=history)
                ctx.dist.barrier()
                last_good = f"{ckpt_dir} (step {done})"
    record.close()
    if ctx.dist.main and history:
        plot_training(history, run_dir / f"training_{method.name}.png", title=method.name)
    return history


def train_row(info: Any, row: str, ctx: Context, *, init_lora: dict[str, torch.Tensor], seed: int,
              run_dir: Path, config_hash: str, resume: bool) -> Method:
    """One row from the shared start: the LoRA adapters reset to ``init_lora``, the generator
    seeded with ``seed``, the method built as row ``row`` (which names its checkpoints/,
    history_<row> and export/<row>) and, if it trains, trained (resuming a checkpoint under
    ``resume``). Returns the method, trained but not yet fitted."""
    ctx.lm.load_inner(init_lora)
    torch.manual_seed(seed)
    method = info.load()(ctx, name=row)
    if info.trains:
        train_method(method, ctx, run_dir=run_dir, config_hash=config_hash, resume=resume)
    return method
