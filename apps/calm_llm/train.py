"""The multiple-choice run behind ``python -m apps.calm_llm``: data → model → each method →
metrics. The stages it shares with the open-QA run are in `apps.calm_llm.runner` (claiming the
run directory and the resume checks; training one row).

For each method: reset the LoRA adapters to the shared initialization, train (with checkpoints
every ``checkpoint_every`` steps and resume), fit post-hoc parts, predict on the in-domain test
sets and the out-of-domain sets, and write ``metrics.json`` / ``results.md`` / PNGs at once, so a
failure later loses nothing already evaluated.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from calibration import metrics as calibration_metrics

from . import checkpoint, distributed, evaluate, export
from . import methods as method_registry
from . import model as model_lib
from .config import (
    Config,
    data_files,
    data_hub,
    needs_second_order,
    select_grid,
    split_seed,
    variant_name,
    with_overrides,
)
from .data import Collator, load_source, make_splits
from .data.collate import warn_truncated
from .io import CorruptFile, read_json, read_tensors
from .logs import log
from .methods.base import Context, Method
from .predict import predict_option_logits, probabilities
from .runner.prepare import RESULTS_FIX, base_method, check_kept_results, claim_run_dir, run_lock
from .runner.train import EvalSet, train_method


# -- data ----------------------------------------------------------------------------------------
def load_data(cfg: Config):
    """Sources → splits (train / calib / per-source test / OOD), deterministic in the split seed."""
    d = cfg.data
    files, hub = data_files(cfg), data_hub(cfg)

    def src(name: str, instruction: bool = False) -> list:
        return load_source(name, path=files.get(name), hub=hub.get(name),
                           limit=d.source_limit or None, seed=split_seed(cfg), instruction=instruction)

    in_domain = {name: src(name) for name in d.in_domain}
    ood = {name: src(name) for name in d.out_of_domain}
    # --instruction-data NAME is Alpaca rows whatever NAME is
    instruction = src(d.instruction_data, instruction=True) if d.instruction_data else None
    return make_splits(in_domain, ood, n_train=d.n_train, n_calib=d.n_calib, n_test=d.n_test,
                       n_ood=d.n_ood, seed=split_seed(cfg), instruction_train=instruction,
                       dedup=d.dedup)


# -- training ------------------------------------------------------------------------------------


# -- results -------------------------------------------------------------------------------------


def _load_predictions(path: Path) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """evaluate.write_results' predictions.safetensors: ``{method}/{dataset}/probs|labels``."""
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    if not path.is_file():
        return out
    t = read_tensors(path, RESULTS_FIX)
    try:
        for key in t:
            method, ds, kind = key.split("/")
            if kind == "probs":
                out.setdefault(method, {})[ds] = (t[key], t[f"{method}/{ds}/labels"])
    except (ValueError, KeyError) as e:  # readable, but not what write_results writes
        raise CorruptFile(f"{path}: not a predictions file of this project (entry {e}). "
                          f"{RESULTS_FIX}") from e
    return out


def reevaluate(
    results: dict[str, dict[str, Any]],
    predictions: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]],
    *,
    n_bins: int,
    n_boot: int,
) -> bool:
    """Recompute, in place, the metrics of saved results whose --n-bins/--n-boot differ from the
    current ones, from their saved predictions (no model needed); True when any changed.
    Keys the metrics do not produce (a method's extras, e.g. TS's temperature) are kept."""
    changed = False
    for m, per_ds in results.items():
        for ds, r in per_ds.items():
            if r.get("n_bins") == n_bins and r.get("n_boot") == n_boot:
                continue
            probs, y = predictions[m][ds]
            per_ds[ds] = {**r, **evaluate.dataset_metrics(probs, y, domain=r["domain"],
                                                          n_bins=n_bins, n_boot=n_boot)}
            changed = True
    return changed


def calib_metrics(ctx: Context, method: Method, row: str) -> dict[str, float]:
    """NLL, conf-ECE and accuracy of a method on the calibration split, recorded as
    extras so that settings can be chosen without looking at test or out-of-domain data."""
    ol, y = predict_option_logits(ctx, method, ctx.calib_examples, f"{row} calib")
    p = probabilities(method, ol)
    return {
        "calib_nll": calibration_metrics.nll(p, y),
        "calib_conf_ece": calibration_metrics.conf_ece(p, y, n_bins=ctx.cfg.n_bins),
        "calib_accuracy": calibration_metrics.accuracy(p, y),
    }


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


# -- the run, stage by stage ---------------------------------------------------------------------
@dataclass
class Run:
    """What the stages of one run share. ``results``/``predictions`` grow as methods finish
    (keyed by row); ``extra`` is metrics.json's run-level record (hash, zero-shot, selection)."""

    cfg: Config
    dist: distributed.Dist
    run_dir: Path
    config_hash: str
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    predictions: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def resume(self) -> bool:
        return bool(self.cfg.resume)

    def write(self) -> None:
        """metrics.json, results.md, predictions and reliability PNGs of every row so far."""
        if self.dist.main:
            evaluate.write_results(self.run_dir, self.results, self.predictions,
                                   n_bins=self.cfg.n_bins, extra=self.extra)


@dataclass
class Evaluation:
    """The model-side state every method is run against: the context, the evaluation sets, the
    LoRA initialization each method starts from, and the untrained model's option logits
    (shared by every method that does not train)."""

    ctx: Context
    eval_sets: list[EvalSet]
    init_lora: dict[str, torch.Tensor]
    base_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def base_logits(self, es: EvalSet, method: Method) -> tuple[torch.Tensor, torch.Tensor]:
        if es.name not in self.base_cache:
            self.base_cache[es.name] = predict_option_logits(self.ctx, method, es.examples, es.name)
        return self.base_cache[es.name]


def run(cfg: Config) -> dict[str, Any]:
    """The whole run; returns ``{"results": ..., "run_dir": ..., "table": ...}``. Writes as it goes."""
    # an unloadable --model fails now, before a run folder or the data (or a minute of hub retries)
    model_lib.check_model_available(cfg.model)
    with run_lock(cfg):  # one process writes into the run directory at a time
        return _run(cfg)


def _run(cfg: Config) -> dict[str, Any]:
    state, splits = prepare_run_dir(cfg, distributed.init(fsdp=cfg.fsdp))
    restore_evaluated(state)  # before the minutes a model takes to load
    kept = set(state.results)
    ev = build_context(state, splits)
    if not state.results and cfg.zero_shot:
        zero_shot(state, ev)
    grid = select_grid(cfg)
    for index, name in enumerate(cfg.methods):
        info = method_registry.info(name)
        if grid and selects(info, grid):
            run_selection(state, ev, info, index, grid)
        elif name not in state.results:
            run_method(state, ev, info, name, ev.ctx, index, select=False)
        if name in kept and not (grid and selects(info, grid)):
            reexport_kept(state, ev, info, index)
    ev.ctx.lm.load_inner(ev.init_lora)
    table = evaluate.render_table(state.results)
    if state.dist.main:
        print(table, flush=True)
    return {"results": state.results, "run_dir": str(state.run_dir), "table": table}


def prepare_run_dir(cfg: Config, dist: distributed.Dist) -> tuple[Run, Any]:
    """Claim the run directory, refuse a resume that would mix results, read the data, and
    record config.json and splits.json. Returns the run's state and the data splits."""
    run_dir, splits = claim_run_dir(cfg, dist, load_data)
    state = Run(cfg, dist, run_dir, cfg.hash())
    state.extra = {"config_hash": state.config_hash, "zero_shot_accuracy": {},
                   "split_fingerprints": splits.fingerprints()}
    return state, splits




def restore_evaluated(state: Run) -> None:
    """On resume, keep the rows already evaluated for the methods still asked for (a cut
    results file is named, not guessed at), re-evaluated if --n-bins/--n-boot changed."""
    cfg, path = state.cfg, state.run_dir / "metrics.json"
    if not (state.resume and path.is_file()):
        return
    saved_all = read_json(path, RESULTS_FIX)
    state.extra["zero_shot_accuracy"] = saved_all.get("zero_shot_accuracy", {})
    if "selection" in saved_all:
        state.extra["selection"] = saved_all["selection"]
    saved = saved_all.get("results", {})
    saved_preds = _load_predictions(state.run_dir / "predictions.safetensors")
    for m in saved:
        # rows derived from a method (calm@eta=0.1, calm:no_alpha) are kept with it
        if base_method(m) in cfg.methods and m in saved_preds:
            state.results[m], state.predictions[m] = saved[m], saved_preds[m]
            log(f"[{m}] already evaluated in {state.run_dir}; kept", state.dist)
    check_kept_results(state.run_dir, state.results, state.predictions)
    if reevaluate(state.results, state.predictions, n_bins=cfg.n_bins, n_boot=cfg.n_boot) \
            and state.dist.main:
        log(f"re-evaluated the kept methods with --n-bins {cfg.n_bins} --n-boot {cfg.n_boot}",
            state.dist)
        state.write()


def build_context(state: Run, splits: Any) -> Evaluation:
    """Seed, load the model, build the collators and the methods' `Context`."""
    cfg, dist, d = state.cfg, state.dist, state.cfg.data
    torch.manual_seed(cfg.seed)
    device = model_lib.resolve_device(distributed.device_for(dist, cfg.device))
    log(f"loading model {cfg.model.name_or_path!r} on {device}", dist)
    if dist.fsdp:
        log(f"FSDP: base weights sharded over {dist.world} processes" if dist.world > 1
            else "FSDP asked for in a single process: nothing to shard over; running unsharded",
            dist)
    lm = model_lib.load(cfg.model, device=device, eager=needs_second_order(cfg), seed=cfg.seed,
                        dist=dist)
    collator = Collator(lm.tokenizer, mode=d.mode, prompt_style=d.prompt_style,
                        max_length=cfg.model.max_length, max_options=d.max_options,
                        share_prefix=d.share_prefix, prefix_layout=lm.prefix_layout)
    train_collator = collator
    if d.instruction_data:
        train_collator = Collator(lm.tokenizer, mode="cloze", prompt_style=d.prompt_style,
                                  max_length=cfg.model.max_length, max_options=d.max_options)
    if dist.main:  # a prompt cut to --max-length is scored without its start: say how many
        warn_truncated({name: ((train_collator if name == "train" else collator).n_truncated(exs),
                               len(exs)) for name, exs in splits.named().items()},
                       cfg.model.max_length)
    ctx = Context(
        cfg=cfg, lm=lm, collator=collator, train_examples=list(splits.train),
        calib_examples=list(splits.calib), train_collator=train_collator,
        option_token_ids=collator.option_token_ids.to(device) if d.mode == "letter" else None,
        dist=dist, predictor=predict_option_logits,
    )
    eval_sets = [EvalSet(n, "id", ex) for n, ex in splits.test.items()]
    eval_sets += [EvalSet(n, "ood", ex) for n, ex in splits.ood.items()]
    return Evaluation(ctx, eval_sets, lm.inner_state())


def zero_shot(state: Run, ev: Evaluation) -> None:
    """Show that the model is above chance before training (recorded in metrics.json)."""
    probe = method_registry.get("none")(ev.ctx)
    for es in ev.eval_sets:
        ol, y = ev.base_logits(es, probe)
        acc = float((ol.argmax(-1) == y).float().mean())
        state.extra["zero_shot_accuracy"][es.name] = acc
        chance = float((1.0 / torch.isfinite(ol).sum(-1).float()).mean())
        log(f"zero-shot accuracy on {es.name} ({es.domain}, n={len(y)}): {acc:.3f} "
            f"(chance {chance:.3f})", state.dist)


def run_selection(state: Run, ev: Evaluation, info: method_registry.MethodInfo, index: int,
                  grid: list[dict[str, Any]]) -> None:
    """``--select``: run every grid point of one method as its own row, then choose."""
    name, cfg = info.name, state.cfg
    rows = [variant_name(name, point) for point in grid]
    for row, point in zip(rows, grid):
        if row not in state.results:
            run_method(state, ev, info, row, replace(ev.ctx, cfg=with_overrides(cfg, point)),
                       index, select=True)
    choose_variant(name, rows, grid, state.results, state.predictions, state.extra)
    state.write()
    log(f"[{name}] --select chose {state.extra['selection'][name]['chosen']} by "
        "calibration-split NLL", state.dist)


def run_method(state: Run, ev: Evaluation, info: method_registry.MethodInfo, row: str,
               ctx: Context, index: int, *, select: bool) -> None:
    """Train (resumably), fit, predict, write and export one method as row ``row``."""
    ctx.lm.load_inner(ev.init_lora)
    # the same seed for every --select variant of a method: they differ only by the setting
    torch.manual_seed(state.cfg.seed + 1000 * (index + 1))
    method = info.load()(ctx, name=row)  # the row names checkpoints/, history_<row>, export/<row>
    t0 = time.time()
    if info.trains:
        train_method(method, ctx, run_dir=state.run_dir, config_hash=state.config_hash,
                     resume=state.resume)
    method.after_training(method.predict)
    # every rank took the same steps; a drift here would make rank 0's results not the run's
    state.dist.check_identical({**ctx.lm.inner(), **method.outer_params()}, f"[{row}] after training")
    if select or state.cfg.eval_calib:  # the only numbers a choice of settings may read
        method.extras.update(calib_metrics(ctx, method, row))
    evaluate_method(state, ev, info, method, row, ctx)
    if state.dist.main:  # every method but `none` exports (ts: its T)
        export.export_method(state.run_dir / "export" / row, ctx.lm, method, run_dir=state.run_dir)
    accs = ", ".join(f"{ds} acc {r['accuracy']:.3f} ece {r['conf_ece']:.3f}"
                     for ds, r in state.results[row].items())
    log(f"[{row}] done in {time.time() - t0:.0f}s: {accs}", state.dist)
    state.dist.barrier()


def reexport_kept(state: Run, ev: Evaluation, info: method_registry.MethodInfo, index: int) -> None:
    """On resume, a kept row whose export is missing or incomplete (the run was cut between
    the row's results and the end of its export: killed, out of disk) is exported again from
    the row's final checkpoint, refitted as `run_method` fits it; a trained row without a
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
    ctx.lm.load_inner(ev.init_lora)
    torch.manual_seed(state.cfg.seed + 1000 * (index + 1))  # as `run_method` seeds the row
    method = info.load()(ctx, name=name)
    if info.trains:  # restores the final step: no step is taken
        train_method(method, ctx, run_dir=state.run_dir, config_hash=state.config_hash,
                     resume=True)
    method.after_training(method.predict)
    if state.dist.main and export.export_method(out, ctx.lm, method, run_dir=state.run_dir):
        log(f"[{name}] export redone from its final state: {out}", state.dist)
    state.dist.barrier()


def evaluate_method(state: Run, ev: Evaluation, info: method_registry.MethodInfo, method: Method,
                    row: str, ctx: Context) -> None:
    """Predict every evaluation set with `method` as row ``row`` (and, for a trained method
    that learns α, again without α as ``row:no_alpha``); write the results at once."""
    cfg = state.cfg
    passes = [(row, contextlib.nullcontext())]
    if info.trains and info.learns_alpha and cfg.calm.eval_without_alpha and method.alpha_in_use:
        passes.append((f"{row}:no_alpha", method.without_alpha()))
    for name, scope in passes:
        preds, res = {}, {}
        with scope:
            extras = dict(method.extras)
            if name != row and "calib_nll" in extras:  # the calibration split without α, too
                extras.update(calib_metrics(ctx, method, name))
            for es in ev.eval_sets:
                if not info.trains:
                    ol, y = ev.base_logits(es, method)
                else:
                    ol, y = predict_option_logits(ctx, method, es.examples, f"{name} {es.name}")
                probs = probabilities(method, ol)
                preds[es.name] = (probs, y.clone())  # cached labels are shared between methods
                res[es.name] = {
                    **evaluate.dataset_metrics(probs, y, domain=es.domain, n_bins=cfg.n_bins,
                                               n_boot=cfg.n_boot),
                    **extras,
                }
        state.results[name], state.predictions[name] = res, preds
    state.write()
