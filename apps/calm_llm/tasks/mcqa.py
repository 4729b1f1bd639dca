"""The multiple-choice task (``--task mcqa``, the default): each question's K options are
scored by the model (`predict.predict_option_logits`), a method's probabilities are
``p = softmax(its transform of the scores)`` (N, K), and `apps.calm_llm.evaluate` turns them and
the labels into accuracy, conf-/cw-ECE with bootstrap intervals, Brier and NLL
(``metrics.json``, ``results.md``, ``predictions.safetensors``, reliability diagrams).

What is this task's own beyond that: the data (multiple-choice sources, optionally Alpaca rows
under --instruction-data, `load_data`), the collators (`build_mc`), the zero-shot probe,
``--select`` (every grid point of a method as its own row, then the choice by the
calibration-split NLL), the resume checks against the saved predictions, and re-exporting a
kept row whose export a cut run left incomplete. Cost of a pass: one forward per question (the
untrained model's scores are computed once and shared by every method that does not train).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from calibration import metrics as calibration_metrics

from ...errors import RunRefused
from .. import checkpoint, distributed, evaluate, export
from .. import methods as method_registry
from ..config import (
    Config,
    data_files,
    data_hub,
    select_grid,
    split_seed,
    variant_name,
    with_overrides,
)
from ..data import Collator, load_source, make_splits, warn_truncated
from ..io import CorruptFile, read_tensors
from ..logs import log
from ..methods.base import Context, Method
from ..predict import predict_option_logits, probabilities
from ..runner.evaluate import passes
from ..runner.load import Evaluation, eval_sets, load_model
from ..runner.prepare import RESULTS_FIX, refuse_changed
from ..runner.report import RunState, restore_rows
from ..runner.rows import run_row
from ..runner.train import EvalSet, train_row
from .base import Task


@dataclass
class MCEvaluation(Evaluation):
    """`Evaluation` plus the untrained model's option logits, shared by every method that does
    not train."""

    base_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def base_logits(self, es: EvalSet, method: Method) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, K) option logits and (N,) labels of the untrained model on ``es`` (cached)."""
        if es.name not in self.base_cache:
            self.base_cache[es.name] = predict_option_logits(self.ctx, method, es.examples, es.name)
        return self.base_cache[es.name]


# -- data and model ------------------------------------------------------------------------------
def load_data(cfg: Config) -> Any:
    """Multiple-choice sources → `Splits` (train / calib / per-source test / OOD)."""
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


def build_mc(cfg: Config, dist: distributed.Dist, splits: Any) -> Evaluation:
    """Load the model, build the collators (cloze for Alpaca rows under --instruction-data) and
    the methods' `Context` for multiple choice."""
    d = cfg.data
    lm = load_model(cfg, dist)
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
        option_token_ids=collator.option_token_ids.to(lm.device) if d.mode == "letter" else None,
        dist=dist, predictor=predict_option_logits,
    )
    return MCEvaluation(ctx, eval_sets(splits), lm.inner_state())



# -- evaluation ----------------------------------------------------------------------------------
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


def zero_shot(state: RunState, ev: MCEvaluation) -> None:
    """Show that the model is above chance before training (recorded in metrics.json)."""
    probe = method_registry.get("none")(ev.ctx)
    for es in ev.eval_sets:
        ol, y = ev.base_logits(es, probe)
        acc = float((ol.argmax(-1) == y).float().mean())
        state.extra["zero_shot_accuracy"][es.name] = acc
        chance = float((1.0 / torch.isfinite(ol).sum(-1).float()).mean())
        log(f"zero-shot accuracy on {es.name} ({es.domain}, n={len(y)}): {acc:.3f} "
            f"(chance {chance:.3f})", state.dist)


def evaluate_mc(state: RunState, ev: MCEvaluation, info: method_registry.MethodInfo, method: Method,
                row: str, ctx: Context, *, select: bool) -> None:
    """Fit (``after_training`` on the calibration split's option logits), then predict every
    evaluation set with `method` in each of its `passes`; write the results at once. The
    calibration-split metrics are recorded when a choice of settings may read them."""
    method.after_training(method.predict)
    # every rank took the same steps; a drift here would make rank 0's results not the run's
    state.dist.check_identical({**ctx.lm.inner(), **method.outer_params()}, f"[{row}] after training")
    if select or state.cfg.eval_calib:  # the only numbers a choice of settings may read
        method.extras.update(calib_metrics(ctx, method, row))
    for name, scope in passes(state, info, method, row):
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
                    **evaluate.dataset_metrics(probs, y, domain=es.domain, n_bins=state.cfg.n_bins,
                                               n_boot=state.cfg.n_boot),
                    **extras,
                }
        state.results[name], state.outputs[name] = res, preds
    state.write()



# -- resume: the rows already evaluated ----------------------------------------------------------
def read_predictions(run_dir: Path) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """evaluate.write_results' predictions.safetensors: ``{method}/{dataset}/probs|labels``."""
    path = run_dir / "predictions.safetensors"
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


def restore_mc(state: RunState) -> None:
    """Multiple choice: keep the evaluated rows (a cut results file is named, not guessed at),
    with the zero-shot accuracies and ``--select`` choices, re-evaluated from their saved
    predictions if --n-bins/--n-boot changed."""
    cfg = state.cfg
    saved = restore_rows(state, read_predictions)
    if saved is None:
        return
    state.extra["zero_shot_accuracy"] = saved.get("zero_shot_accuracy", {})
    if "selection" in saved:
        state.extra["selection"] = saved["selection"]
    check_kept_results(state.run_dir, state.results, state.outputs)
    if reevaluate(state.results, state.outputs, n_bins=cfg.n_bins, n_boot=cfg.n_boot) \
            and state.dist.main:
        log(f"re-evaluated the kept methods with --n-bins {cfg.n_bins} --n-boot {cfg.n_boot}",
            state.dist)
        state.write()


def check_kept_results(run_dir: Path, results: dict[str, dict[str, Any]],
                       predictions: dict[str, dict[str, tuple[Any, Any]]]) -> None:
    """Refuse kept rows whose metrics.json values are not what their saved predictions give.

    A resume keeps the rows already evaluated and writes them into the new metrics.json, so an
    edited value (or a metrics.json from another run beside these predictions) would be carried
    on as a result. Each kept (row, dataset) is recomputed from predictions.safetensors with its
    own --n-bins and compared, point metrics only (the bootstrap intervals would cost n_boot
    metric evaluations each). Option logits are float32 on every device (`predict`) and the
    probabilities are saved as float32, so the recomputation repeats the original one; the
    tolerance (relative 1e-9) only absorbs summation order. Cost: one
    `evaluate.dataset_metrics(n_boot=0)` per pair.
    """
    metrics_path, preds_path = run_dir / "metrics.json", run_dir / "predictions.safetensors"
    for row, per_ds in results.items():
        for ds, saved in per_ds.items():
            if ds not in predictions[row]:
                raise RunRefused(f"{metrics_path}: row {row!r} has {ds} but {preds_path} holds "
                                 f"no predictions for it. {RESULTS_FIX}")
            probs, y = predictions[row][ds]
            now = evaluate.dataset_metrics(probs, y, domain=saved["domain"],
                                           n_bins=saved.get("n_bins", 10), n_boot=0)
            refuse_changed(saved, now, f"{metrics_path}: {row} on {ds}:",
                           f"the saved predictions ({preds_path})")



# -- rows and --select ---------------------------------------------------------------------------
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


def row_seed(cfg: Config, index: int) -> int:
    """The generator seed of the method at ``index`` in --methods; the same for every --select
    variant of it: they differ only by the setting."""
    return cfg.seed + 1000 * (index + 1)


def run_selection(state: RunState, ev: MCEvaluation, info: method_registry.MethodInfo, index: int,
                  grid: list[dict[str, Any]]) -> None:
    """``--select``: run every grid point of one method as its own row, then choose."""
    name, cfg = info.name, state.cfg
    rows = [variant_name(name, point) for point in grid]
    for row, point in zip(rows, grid):
        if row not in state.results:
            run_row(state, ev, info, row, replace(ev.ctx, cfg=with_overrides(cfg, point)),
                    seed=row_seed(cfg, index), select=True)
    choose_variant(name, rows, grid, state.results, state.outputs, state.extra)
    state.write()
    log(f"[{name}] --select chose {state.extra['selection'][name]['chosen']} by "
        "calibration-split NLL", state.dist)


def reexport_kept(state: RunState, ev: MCEvaluation, info: method_registry.MethodInfo, index: int) -> None:
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


class MultipleChoice(Task):
    """``--task mcqa``: the stages' calls, answered by the functions above."""

    def load_splits(self, cfg: Config) -> Any:
        return load_data(cfg)

    def run_record(self, splits: Any, dist: distributed.Dist) -> dict[str, Any]:
        return {"zero_shot_accuracy": {}, "split_fingerprints": splits.fingerprints()}

    def build(self, cfg: Config, dist: distributed.Dist, splits: Any) -> MCEvaluation:
        return build_mc(cfg, dist, splits)

    def restore(self, state: RunState) -> None:
        restore_mc(state)

    def before_rows(self, state: RunState, ev: Evaluation) -> None:
        assert isinstance(ev, MCEvaluation)
        if not state.results and state.cfg.zero_shot:
            zero_shot(state, ev)

    def run_rows(self, state: RunState, ev: Evaluation) -> None:
        """Every --methods row; under --select every grid point of a method it applies to,
        then the choice; a kept row's incomplete export is redone."""
        assert isinstance(ev, MCEvaluation)
        cfg, kept, grid = state.cfg, set(state.results), select_grid(state.cfg)
        for index, name in enumerate(cfg.methods):
            info = method_registry.info(name)
            if grid and selects(info, grid):
                run_selection(state, ev, info, index, grid)
            elif name not in state.results:
                run_row(state, ev, info, name, ev.ctx, seed=row_seed(cfg, index))
            if name in kept and not (grid and selects(info, grid)):
                reexport_kept(state, ev, info, index)

    def row_seed(self, cfg: Config, index: int, row: str) -> int:
        return row_seed(cfg, index)

    def evaluate(self, state: RunState, ev: Evaluation, info: method_registry.MethodInfo,
                 method: Method, row: str, ctx: Context, *, select: bool = False) -> None:
        assert isinstance(ev, MCEvaluation)
        evaluate_mc(state, ev, info, method, row, ctx, select=select)

    def write_results(self, run_dir: Path, results: dict[str, dict[str, Any]],
                      outputs: dict[str, dict[str, Any]], *, n_bins: int,
                      extra: dict[str, Any]) -> None:
        evaluate.write_results(run_dir, results, outputs, n_bins=n_bins, extra=extra)

    def render_table(self, results: dict[str, dict[str, Any]]) -> str:
        return evaluate.render_table(results)
