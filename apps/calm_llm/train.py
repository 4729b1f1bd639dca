"""The multiple-choice run behind ``python -m apps.calm_llm``: prepare the run directory →
load the data and the model → for each method: train → fit → evaluate → write and export. The
stages are `apps.calm_llm.runner`'s, shared with the open-QA run (`apps.calm_llm.open_qa.run`);
what is this task's own is here: the zero-shot probe, ``--select`` (every grid point of a
method as its own row, then the choice by the calibration-split NLL) and re-exporting a kept
row whose export a cut run left incomplete.

Every row starts from the same LoRA initialization and writes ``metrics.json`` /
``results.md`` / PNGs as soon as it is evaluated, so a failure later loses nothing already
evaluated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from . import checkpoint, distributed, evaluate, export
from . import methods as method_registry
from . import model as model_lib
from .config import Config, select_grid, variant_name, with_overrides
from .logs import log
from .runner import load
from .runner.evaluate import evaluate_mc, zero_shot
from .runner.prepare import claim_run_dir, run_lock
from .runner.report import RunState, finish_run, restore_mc
from .runner.rows import run_row
from .runner.train import train_row


def selects(info: method_registry.MethodInfo, grid: list[dict[str, Any]]) -> bool:
    """Whether a --select grid applies to a method: it trains, and (for calm.* options) it
    reads the calm options (``"calm" in info.sections``)."""
    if not info.trains:
        return False
    calm_keys = any(k.startswith("calm.") for k in grid[0])
    return not calm_keys or "calm" in info.sections


def choose_variant(
    name: str,
    rows: list[str],
    points: list[dict[str, Any]],
    results: dict[str, dict[str, Any]],
    predictions: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]],
    extra: dict[str, Any],
) -> str:
    """``--select``: row ``name`` (and ``name:no_alpha``) become the variant with the lowest
    calibration-split NLL; every variant stays reported, and ``extra["selection"][name]``
    records the choice. Reads nothing but each variant's ``calib_nll``."""
    nll = {row: float(next(iter(results[row].values()))["calib_nll"]) for row in rows}
    best = min(rows, key=lambda r: (nll[r], rows.index(r)))  # ties: the first value given
    for suffix in ("", ":no_alpha"):
        if best + suffix in results:
            results[name + suffix] = {ds: {**r, "selected": best}
                                      for ds, r in results[best + suffix].items()}
            # copies: safetensors refuses two names for one storage
            predictions[name + suffix] = {ds: (p.clone(), y.clone()) for ds, (p, y)
                                          in predictions[best + suffix].items()}
    extra.setdefault("selection", {})[name] = {
        "by": "calibration-split NLL", "chosen": best,
        "points": [{"row": r, **p, "calib_nll": nll[r]} for r, p in zip(rows, points)],
    }
    return best


def run(cfg: Config) -> dict[str, Any]:
    """The whole run; returns ``{"results": ..., "run_dir": ..., "table": ...}``. Writes as it goes."""
    # an unloadable --model fails now, before a run folder or the data (or a minute of hub retries)
    model_lib.check_model_available(cfg.model)
    with run_lock(cfg):  # one process writes into the run directory at a time
        return _run(cfg)


def _run(cfg: Config) -> dict[str, Any]:
    dist = distributed.init(fsdp=cfg.fsdp)
    state, splits = prepare_run_dir(cfg, dist)
    restore_mc(state)  # before the minutes a model takes to load
    kept = set(state.results)
    ev = load.build_mc(cfg, dist, splits)
    if not state.results and cfg.zero_shot:
        zero_shot(state, ev)
    grid = select_grid(cfg)
    for index, name in enumerate(cfg.methods):
        info = method_registry.info(name)
        if grid and selects(info, grid):
            run_selection(state, ev, info, index, grid)
        elif name not in state.results:
            run_row(state, ev, info, name, ev.ctx, seed=row_seed(cfg, index), evaluate=evaluate_mc)
        if name in kept and not (grid and selects(info, grid)):
            reexport_kept(state, ev, info, index)
    ev.ctx.lm.load_inner(ev.init_lora)
    return finish_run(state, evaluate.render_table)


def prepare_run_dir(cfg: Config, dist: distributed.Dist) -> tuple[RunState, Any]:
    """Claim the run directory, refuse a resume that would mix results, read the data, and
    record config.json and splits.json. Returns the run's state and the data splits."""
    run_dir, splits = claim_run_dir(cfg, dist, load.load_data)
    state = RunState(cfg, dist, run_dir, cfg.hash(), evaluate.write_results)
    state.extra = {"config_hash": state.config_hash, "zero_shot_accuracy": {},
                   "split_fingerprints": splits.fingerprints()}
    return state, splits


def row_seed(cfg: Config, index: int) -> int:
    """The generator seed of the method at ``index`` in --methods; the same for every --select
    variant of it: they differ only by the setting."""
    return cfg.seed + 1000 * (index + 1)


def run_selection(state: RunState, ev: load.Evaluation, info: method_registry.MethodInfo, index: int,
                  grid: list[dict[str, Any]]) -> None:
    """``--select``: run every grid point of one method as its own row, then choose."""
    name, cfg = info.name, state.cfg
    rows = [variant_name(name, point) for point in grid]
    for row, point in zip(rows, grid):
        if row not in state.results:
            run_row(state, ev, info, row, replace(ev.ctx, cfg=with_overrides(cfg, point)),
                    seed=row_seed(cfg, index), evaluate=evaluate_mc, select=True)
    choose_variant(name, rows, grid, state.results, state.outputs, state.extra)
    state.write()
    log(f"[{name}] --select chose {state.extra['selection'][name]['chosen']} by "
        "calibration-split NLL", state.dist)


def reexport_kept(state: RunState, ev: load.Evaluation, info: method_registry.MethodInfo, index: int) -> None:
    """On resume, a kept row whose export is missing or incomplete (the run was cut between
    the row's results and the end of its export: killed, out of disk) is exported again from
    the row's final checkpoint, refitted as `evaluate_mc` fits it; a trained row without a
    checkpoint is named with why it cannot be. (``--select`` variants are not redone.)"""
    name, ctx = info.name, ev.ctx
    out = state.run_dir / "export" / name
    if export.is_complete(out) or name == "none":  # `none` is the base itself: no export
        return
    ckpt = state.run_dir / "checkpoints" / name
    if info.trains and not checkpoint.exists(ckpt):
        log(f"[{name}] its export ({out}) is missing or incomplete and cannot be redone: no "
            f"checkpoint of its final state in {ckpt} (the run had --checkpoint-every 0); "
            "train it again in a new run to export it", state.dist)
        return
    # seeded as `run_row` seeds the row; resuming restores the final step: no step is taken
    method = train_row(info, name, ctx, init_lora=ev.init_lora, seed=row_seed(state.cfg, index),
                       run_dir=state.run_dir, config_hash=state.config_hash, resume=True)
    method.after_training(method.predict)
    if state.dist.main and export.export_method(out, ctx.lm, method, run_dir=state.run_dir):
        log(f"[{name}] export redone from its final state: {out}", state.dist)
    state.dist.barrier()
