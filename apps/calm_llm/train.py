"""The runner behind ``python -m apps.calm_llm``: data → model → each method → metrics.

For each method: reset the LoRA adapters to the shared initialization, train (with checkpoints
every ``checkpoint_every`` steps and resume), fit post-hoc parts, predict on the in-domain test
sets and the out-of-domain sets, and write ``metrics.json`` / ``results.md`` / PNGs at once, so a
failure later loses nothing already evaluated.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from calibration import metrics as calibration_metrics

from ..errors import NonFiniteLoss, RunRefused
from . import checkpoint, distributed, evaluate, export
from . import methods as method_registry
from . import model as model_lib
from .config import (
    Config,
    data_files,
    data_hub,
    differences,
    needs_second_order,
    select_grid,
    split_seed,
    variant_name,
    with_overrides,
)
from .data import Collator, load_source, make_splits
from .data.collate import warn_truncated
from .data.splits import manifest_changes
from .history import HistoryWriter, plot_training
from .io import atomic_write_text, read_json, read_tensors
from .logs import log
from .methods.base import Context, Method
from .predict import predict_option_logits, probabilities

# what a run directory holds once a run has started in it (a new run never writes over these)
RUN_FILES = ("config.json", "splits.json", "metrics.json", "predictions.safetensors",
             "checkpoints", "export")


@dataclass
class EvalSet:
    name: str
    domain: str  # "id" | "ood"
    examples: list


def make_run_dir(cfg: Config, dist: distributed.Dist | None = None) -> Path:
    """The run's folder: ``--resume DIR``, ``--out DIR`` when it holds no other run, or a fresh
    ``runs/<timestamp>`` claimed with an exclusive mkdir (a ``-2``, ``-3``... suffix when two
    runs start in the same second), so two runs never share a folder."""
    if cfg.resume:
        return Path(cfg.resume)
    if cfg.out:
        out = Path(cfg.out)
        held = [f for f in RUN_FILES if (out / f).exists()]
        if held:
            raise RunRefused(
                f"--out {out} already holds a run ({', '.join(held)}); a new run does not write "
                f"over another's results: continue that one with --resume {out}, or give a new --out"
            )
        return out
    name = None
    if dist is None or dist.main:
        stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
        while True:
            cand = Path("runs") / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                cand.mkdir(parents=True, exist_ok=False)
                name = str(cand)
                break
            except FileExistsError:
                n += 1
    if dist is not None and dist.world > 1:  # every rank writes under rank 0's claim
        import torch.distributed as tdist

        box = [name]
        tdist.broadcast_object_list(box, src=0)
        name = box[0]
    return Path(name)


def check_resume_config(cfg: Config, run_dir: Path) -> None:
    """Refuse a resume whose options differ from the run's config.json in a way that changes
    results, naming each such option with both values."""
    from .config import ConfigError, from_dict

    fix = "Restore it from a copy, or start a new run with --out."
    try:
        saved = from_dict(read_json(run_dir / "config.json", fix))
    except ConfigError as e:
        raise RunRefused(f"{run_dir / 'config.json'}: {e}") from e
    diff = differences(saved, cfg)
    if diff:
        raise RunRefused(
            f"--resume {run_dir}: options differ from that run's config.json in a way that changes "
            f"results: {'; '.join(diff)}. Resume with the run's values (output, checkpoint and "
            "evaluation options --n-bins/--n-boot may change), or start a new run with --out"
        )


def check_resume_splits(cfg: Config, run_dir: Path, manifest: dict[str, Any], d: distributed.Dist) -> None:
    """Refuse a resume whose data give other splits than the run's splits.json (the methods
    evaluated before would be scored on other questions or labels than those evaluated after),
    unless ``--force-resume``; then the old record is kept as ``splits.before-resume.json``."""
    path = run_dir / "splits.json"
    if not path.is_file():  # killed before the splits were recorded: nothing was evaluated
        return
    saved = read_json(path, "Delete it to record the current data's splits, but only if the "
                            "data files are still those the run started with.")
    changes = manifest_changes(saved, manifest)
    if not changes:
        return
    msg = (f"--resume {run_dir}: the data no longer give the splits recorded in {path}: "
           f"{'; '.join(changes)}")
    if not cfg.force_resume:
        raise RunRefused(f"{msg}. Restore the data files the run started with, or pass "
                         "--force-resume to continue on the new data (the methods evaluated "
                         "before and after would then mix the two)")
    log(f"warning: {msg}; continuing (--force-resume), the old record kept as "
        "splits.before-resume.json", d)
    if d.main:
        os.replace(path, run_dir / "splits.before-resume.json")


def base_method(row: str) -> str:
    """The method a results row belongs to: ``calm@eta=0.1:no_alpha`` -> ``calm``."""
    return row.split("@", 1)[0].split(":", 1)[0]


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
                       n_ood=d.n_ood, seed=split_seed(cfg), instruction_train=instruction)


# -- training ------------------------------------------------------------------------------------
def train_method(
    method: Method, ctx: Context, *, run_dir: Path, config_hash: str, resume: bool
) -> list[dict[str, float]]:
    """Run ``cfg.train.steps`` optimizer steps of `method`, checkpointing and resuming."""
    from tqdm.auto import tqdm

    cfg = ctx.cfg
    ckpt_dir = run_dir / "checkpoints" / method.name
    start, history = 0, []
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
            # cost of the step on record (what studies and GPU estimates are sized from); the
            # loss read above has synchronised the device
            cost = {"step_seconds": time.perf_counter() - t0}
            if cuda:
                cost["max_memory_gib"] = torch.cuda.max_memory_allocated(ctx.lm.device) / 2**30
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


# -- results -------------------------------------------------------------------------------------
# a results file cut short (full disk, kill) is recomputed from the checkpoints, not guessed at
RESULTS_FIX = ("Delete metrics.json and predictions.safetensors in that folder and resume again: "
               "every method is evaluated again (from its final checkpoint where it has one)")


def _load_predictions(path: Path) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """evaluate.write_results' predictions.safetensors: ``{method}/{dataset}/probs|labels``."""
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    if not path.is_file():
        return out
    t = read_tensors(path, RESULTS_FIX)
    for key in t:
        method, ds, kind = key.split("/")
        if kind == "probs":
            out.setdefault(method, {})[ds] = (t[key], t[f"{method}/{ds}/labels"])
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
    state, splits = prepare_run_dir(cfg, distributed.init(fsdp=cfg.fsdp))
    restore_evaluated(state)  # before the minutes a model takes to load
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
    state.extra = {"config_hash": state.config_hash, "zero_shot_accuracy": {}}
    return state, splits


def claim_run_dir(cfg: Config, dist: distributed.Dist, load: Any) -> tuple[Path, Any]:
    """The run directory and ``load(cfg)``'s splits, after the resume checks (the same options,
    the same splits), with config.json and splits.json recorded. Shared by both tasks."""
    run_dir = make_run_dir(cfg, dist)
    dist.barrier()  # every rank has checked the folder before rank 0 writes into it
    if cfg.resume and not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no config.json there (not a run directory)")
    if cfg.resume:
        check_resume_config(cfg, run_dir)
    # the data are read and checked against the run's record before anything is written
    splits = load(cfg)
    manifest = splits.manifest()
    if cfg.resume:
        check_resume_splits(cfg, run_dir, manifest, dist)
    if dist.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir)
        atomic_write_text(run_dir / "splits.json", json.dumps(manifest, indent=1))
    log(f"run directory: {run_dir}", dist)
    return run_dir, splits


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
