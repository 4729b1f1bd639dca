"""A whole run, for any task: prepare the run directory → load the data and the model → for
each row: train → fit → evaluate → write and export → the final table.

The stages are this package's; what differs between tasks is the `tasks.base.Task` passed in
(``python -m apps.calm_llm`` passes ``tasks.get(cfg.task)``): its data, its evaluation, its
files and its table. Every row starts from the same LoRA initialization and writes its results
as soon as it is evaluated, so a failure later loses nothing already evaluated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import distributed
from .. import model as model_lib
from ..config import Config
from .prepare import claim_run_dir, run_lock
from .report import RunState, finish_run

if TYPE_CHECKING:
    from ..tasks.base import Task


def run(cfg: Config, task: Task) -> dict[str, Any]:
    """The whole run; returns ``{"results": ..., "run_dir": ..., "table": ...}``. Writes as it goes."""
    # an unloadable --model fails now, before a run folder or the data (or a minute of hub retries)
    model_lib.check_model_available(cfg.model)
    with run_lock(cfg):  # one process writes into the run directory at a time
        return _run(cfg, task)


def _run(cfg: Config, task: Task) -> dict[str, Any]:
    dist = distributed.init(fsdp=cfg.fsdp)
    task.check(cfg, dist)
    state, splits = prepare(cfg, dist, task)
    task.restore(state)  # before the minutes a model takes to load
    ev = task.build(cfg, dist, splits)
    task.before_rows(state, ev)
    task.run_rows(state, ev)
    ev.ctx.lm.load_inner(ev.init_lora)
    return finish_run(state)


def prepare(cfg: Config, dist: distributed.Dist, task: Task) -> tuple[RunState, Any]:
    """Claim the run directory, refuse a resume that would mix results, read the task's data,
    and record config.json and splits.json. Returns the run's state and the data splits."""
    run_dir, splits = claim_run_dir(cfg, dist, task)
    state = RunState(cfg, dist, run_dir, cfg.hash(), task)
    state.extra = {"config_hash": state.config_hash, **task.run_record(splits, dist)}
    return state, splits
