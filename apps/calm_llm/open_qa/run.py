"""The open-QA run behind ``python -m apps.calm_llm --task open_qa`` (docs/open_qa.md), in the
stages of `apps.calm_llm.runner` that the multiple-choice run (`apps.calm_llm.train`) uses too:

1. prepare: claim the run directory, the resume checks, config.json / splits.json;
2. load: train / calibration / test splits from the in-domain open-QA sources, test sets from
   the out-of-domain ones (`data.splits.make_splits`, disjoint by question text); each training
   and calibration question becomes an instruction example whose response is its first gold
   alias and a newline, so ``sft`` is completion-only CE on the gold answer and CALM's upper
   level reads the gold answers' token positions (`runner.load.to_instruction`);
3. per method: train (resumably) → fit (``ts``: T on the gold answers' token NLL) → sample n
   answers, a greedy answer and (optionally) a verbalized confidence for every test question,
   with the method's logits processors (α, 1/T) → records → metrics → write → export
   (`runner.evaluate.evaluate_open_qa`).

Single process only (a clear error under ``accelerate launch``/``torchrun``).
"""

from __future__ import annotations

import zlib
from typing import Any

from ...errors import ConfigError
from .. import distributed
from .. import methods as method_registry
from .. import model as model_lib
from ..config import Config
from ..logs import log
from ..runner import load
from ..runner.evaluate import evaluate_open_qa
from ..runner.prepare import claim_run_dir, run_lock
from ..runner.report import RunState, finish_run, restore_open_qa
from ..runner.rows import run_row
from . import score


def run(cfg: Config) -> dict[str, Any]:
    """The whole open-QA run; returns ``{"results", "run_dir", "table"}``. Writes as it goes."""
    model_lib.check_model_available(cfg.model)  # before the lock makes the --out folder
    with run_lock(cfg):  # one process writes into the run directory at a time
        return _run(cfg)


def _run(cfg: Config) -> dict[str, Any]:
    dist = distributed.init(fsdp=cfg.fsdp)
    if dist.world > 1:
        raise ConfigError("--task open_qa runs in a single process (sampling is not sharded); "
                          "launch it without accelerate/torchrun")
    if cfg.select:
        raise ConfigError("--select is not supported with --task open_qa (its choice reads "
                          "multiple-choice predictions); run one setting per run")
    state, splits = prepare(cfg, dist)
    restore_open_qa(state)
    ev = load.build_open_qa(cfg, dist, splits)
    for name in cfg.methods:
        if name not in state.results:
            run_row(state, ev, method_registry.info(name), name, ev.ctx, seed=row_seed(cfg, name),
                    evaluate=evaluate_open_qa, ece="semantic_ece")
    ev.ctx.lm.load_inner(ev.init_lora)
    return finish_run(state, score.render_table)


def prepare(cfg: Config, dist: distributed.Dist) -> tuple[RunState, Any]:
    """Claim the run directory, refuse a resume that would mix results, carve and record the
    splits (config.json, splits.json), as the multiple-choice run does."""
    run_dir, splits = claim_run_dir(cfg, dist, load.load_open_qa_splits)
    log(f"open QA: {len(splits.train)} training, {len(splits.calib)} calibration questions; "
        "test " + ", ".join(f"{n} {len(v)}" for n, v in [*splits.test.items(), *splits.ood.items()]),
        dist)
    state = RunState(cfg, dist, run_dir, cfg.hash(), score.write_results)
    state.extra = {"config_hash": state.config_hash, "split_fingerprints": splits.fingerprints()}
    return state, splits


def row_seed(cfg: Config, row: str) -> int:
    """The generator seed of a row: by its name, not its place in --methods, so that a row is
    the same in any run."""
    return cfg.seed + zlib.crc32(row.encode()) % 100_000
