"""Training steps of the app against ``transformers.Trainer`` + peft on the same model and data.

    python -m bench.training [--quick] [--model smollm2|tiny] [--rounds 15] [--threads 1]

What is compared, side by side in one process (round-robin, `harness.time_alternating`):

- ``app_sft``: one optimizer step of the app's ``sft`` method as the runner takes it
  (`apps.calm_llm.runner.train.train_method`): ``method.step(k)`` — the next batch collated
  from the training stream, the completion-only forward (logits only from the first target
  column on), the cross-entropy, backward, θ's gradient clipped, AdamW and the warmup +
  cosine schedule stepped, gradients zeroed — then the runner's loss read and finiteness
  check (`check_finite`); history and checkpoint writes are left out;
- ``app_calm``: the same for the ``calm`` method of the preset (BOME, α affine), on its own
  copy of the model (no peer: its ratio to ``hf_trainer`` says what CALM costs over a user's
  plain fine-tuning step);
- ``hf_trainer``: the body of ``transformers.Trainer``'s inner training loop for one optimizer
  step (``Trainer._run_epoch`` at gradient accumulation 1), driven through the Trainer's own
  objects: the next batch from the same stream (the app's collator, so both sides pay the
  same collation), converted to the dict a causal LM takes (``labels`` = the app's shifted
  targets shifted back, -100 on prompt and padding: completion-only loss);
  ``Trainer.training_step(model, inputs, num_items_in_batch)`` (train mode, input
  preparation, ``compute_loss`` — the model's own loss over every position, normalized by the
  batch's target count — and ``accelerator.backward``); ``accelerator.clip_grad_norm_``;
  ``optimizer.step()``; ``lr_scheduler.step()``; ``model.zero_grad()``. Callbacks, logging
  and the loss accumulator of ``train()`` are left out (a few microseconds each);
- ``hf_trainer_train``: ``Trainer.train()`` itself, paused by a callback at the end of every
  optimizer step (it runs in a worker thread; the benchmark's thread waits while it steps), so
  that a timed call is one whole iteration of the real loop, including its bookkeeping and
  the DataLoader fetching and collating the next batch (`HFTrainerLoop`). Its losses equal
  ``hf_trainer``'s step by step: the driven step is the loop's step.

Same on both sides: the model (loaded once per candidate, fp32, identical weights), the LoRA
configuration (the preset's rank, alpha, target modules; dropout 0; A drawn from the same
seed, checked equal), the token ids and batches (the default run's SFT batches, the app's
``Collator``/``batch_iterator`` at the run's seed; each candidate steps through the same
sequence), the loss (completion-only cross-entropy, mean over answer tokens), the optimizer
(AdamW, the preset's lr, weight decay and gradient clipping; warmup + cosine over the preset's
steps — HF's warmup is ``k/w`` where the app's is ``(k+1)/(w+1)``, so the learning rates of
the first steps differ slightly; step 1's loss does not depend on it).

Correctness before timing: the first step's loss of ``hf_trainer`` equals ``app_sft``'s to
1e-4 relative (asserted); every record keeps its losses and their largest relative
difference from ``app_sft``'s over the steps taken.

Adding a candidate that is another configuration of the app (e.g. a packed training layout)
is one entry of `APP_CANDIDATES`: config overrides and a method name.
Writes bench/results/training[_quick].json and .md.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import harness

PRESETS = {"smollm2": "default", "tiny": "tiny"}  # --model -> the config preset it runs
# name -> (method, config overrides): each is the app's step at one configuration
APP_CANDIDATES: dict[str, tuple[str, dict[str, Any]]] = {
    "app_sft": ("sft", {}),
    "app_sft_padded": ("sft", {"train": {"train_layout": "padded"}}),
    "app_calm": ("calm", {}),
}
LOSS_RTOL = 1e-4
# the app's --optimizer -> the Trainer's ``optim`` running the same torch.optim class
HF_OPTIM = {"adamw": "adamw_torch", "sgd": "sgd"}


def app_config(model: str, overrides: dict[str, Any], steps: int) -> Any:
    """The preset ``model`` runs (`PRESETS`) on the CPU with ``overrides``; the schedule spans
    at least ``steps`` optimizer steps (the preset's own if longer)."""
    from apps.calm_llm.config import from_dict, load_file, resolve_config_file, validate

    cfg = from_dict(load_file(resolve_config_file(PRESETS[model])))
    # LoRA dropout 0 on both sides: the peer's steps must see the same function
    cfg = from_dict({"device": "cpu", "model": {"lora_dropout": 0.0}}, cfg)
    cfg = from_dict(overrides, cfg)
    cfg = from_dict({"train": {"steps": max(steps, cfg.train.steps)}}, cfg)
    validate(cfg)
    return cfg


def app_context(cfg: Any) -> Any:
    """The methods' `Context` for ``cfg``, built by the runner's own load stage
    (`apps.calm_llm.tasks.mcqa.build_mc`; one model per context: candidates never share
    parameters or optimizer state)."""
    from apps.calm_llm.distributed import Dist
    from apps.calm_llm.tasks.mcqa import build_mc, load_data

    return build_mc(cfg, Dist(), load_data(cfg)).ctx


class AppStep:
    """One optimizer step of method ``method`` at ``cfg``, as the runner's loop takes it."""

    def __init__(self, cfg: Any, method: str) -> None:
        from apps.calm_llm.methods import get

        self.ctx = app_context(cfg)
        torch.manual_seed(cfg.seed + 1000)  # as the runner seeds a method before building it
        self.method = get(method)(self.ctx)
        self.k = 0
        self.losses: list[float] = []

    def __call__(self) -> float:
        from apps.calm_llm.runner.train import check_finite

        with self.ctx.lm.mode(True):
            info = self.method.step(self.k)
        loss = float(info["loss"])
        check_finite(self.method, self.ctx, self.k + 1, "none")
        self.k += 1
        self.losses.append(loss)
        return loss


def hf_inputs(batch: Any) -> dict[str, torch.Tensor]:
    """The dict a causal LM takes for the app's padded ``batch``: ``labels[s, t + 1] =
    target_ids[s, t]`` (the app's targets are already shifted; the model shifts back), -100
    on prompt and padding, so the model's loss is the completion-only cross-entropy.

    The app never feeds an answer's last token (nothing is predicted from it), so that label
    sits on a padding column (attention 0), which is all the model's loss reads of it; one
    padding column is appended where a target sits in the last column."""
    if batch.prefix is not None or batch.packed is not None:
        raise ValueError("hf_inputs takes padded batches (a shared-prefix batch has no HF form)")
    tgt, ids, mask, pos = batch.target_ids, batch.input_ids, batch.attention_mask, batch.position_ids
    if bool((tgt[:, -1] != -100).any()):
        ids = torch.cat([ids, ids[:, -1:]], 1)
        mask = torch.cat([mask, torch.zeros_like(mask[:, -1:])], 1)
        pos = torch.cat([pos, pos[:, -1:]], 1)
        tgt = torch.cat([tgt, torch.full_like(tgt[:, -1:], -100)], 1)
    fed = (tgt[:, :-1] != -100) & (mask[:, 1:] == 1)
    if not bool((tgt[:, :-1][fed] == ids[:, 1:][fed]).all()):
        raise ValueError("the batch's targets are not its next input tokens: no labels form")
    labels = torch.full_like(ids, -100)
    labels[:, 1:] = tgt[:, :-1]
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "labels": labels}


def peft_model(cfg: Any) -> torch.nn.Module:
    """The preset's base with peft LoRA as a user writes it: ``get_peft_model`` with the same
    rank, alpha, targets, dropout 0, LoRA A drawn from the run's seed."""
    from peft import LoraConfig, get_peft_model

    from apps.calm_llm import model as model_lib

    base, _ = model_lib.load_base(cfg.model, seed=cfg.seed)
    mc = cfg.model
    lcfg = LoraConfig(r=mc.lora_r, lora_alpha=mc.lora_alpha, lora_dropout=0.0,
                      target_modules=list(mc.lora_target_modules), task_type="CAUSAL_LM",
                      bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return get_peft_model(base, lcfg)


class HFTrainerStep:
    """One optimizer step of ``transformers.Trainer`` on the app's batches (module docstring)."""

    def __init__(self, cfg: Any, stream_of: Callable[[], Any], *,
                 dataset: torch.utils.data.IterableDataset | None = None,
                 max_steps: int = 0) -> None:
        """``dataset``: what ``train()`` reads (whole batches, one per item); none when the
        steps are driven one by one. ``max_steps``: ``train()``'s length (default the
        schedule's)."""
        from transformers import Trainer, TrainingArguments

        t = cfg.train
        if t.optimizer not in HF_OPTIM:
            raise ValueError(f"train.optimizer {t.optimizer!r}: the Trainer peer has no equal "
                             f"optimizer; use one of {sorted(HF_OPTIM)} in the configuration")
        self.model = peft_model(cfg)
        self.tmp = tempfile.TemporaryDirectory(prefix="bench_training_")
        args = TrainingArguments(
            output_dir=self.tmp.name, use_cpu=True, report_to=[], seed=cfg.seed,
            per_device_train_batch_size=t.batch_size if dataset is None else 1,
            gradient_accumulation_steps=1,
            learning_rate=t.lr, weight_decay=t.weight_decay, optim=HF_OPTIM[t.optimizer],
            lr_scheduler_type=t.schedule if t.schedule != "constant" else "constant_with_warmup",
            warmup_steps=int(round(t.warmup_ratio * t.steps)), max_grad_norm=t.max_grad_norm,
            max_steps=max_steps or t.steps, save_strategy="no", logging_strategy="no", disable_tqdm=True,
            label_names=["labels"],
        )
        # an item of ``dataset`` is already a whole batch
        self.trainer = Trainer(model=self.model, args=args, train_dataset=dataset,
                               data_collator=lambda items: items[0])
        self.trainer.create_optimizer_and_scheduler(num_training_steps=t.steps)
        self.stream_of = stream_of
        self.stream = stream_of()
        self.losses: list[float] = []

    def __call__(self) -> float:
        tr, model = self.trainer, self.trainer.model
        inputs = hf_inputs(self.stream.next())
        n_items = int((inputs["labels"] != -100).sum())  # Trainer.get_batch_samples' count
        loss = tr.training_step(model, inputs, n_items)
        if tr.args.max_grad_norm > 0:
            tr.accelerator.clip_grad_norm_(model.parameters(), tr.args.max_grad_norm)
        tr.optimizer.step()
        tr.lr_scheduler.step()
        model.zero_grad()
        tr.state.global_step += 1
        self.losses.append(float(loss))
        return self.losses[-1]

    def close(self) -> None:
        """Nothing runs in the background here."""


class _StreamDataset(torch.utils.data.IterableDataset):
    """The app's training stream as HF inputs, ``steps`` whole batches, each collated when the
    Trainer's DataLoader asks for it (so the loop pays the collation, as the app's step does);
    iterable, so the Trainer reads it in order."""

    def __init__(self, stream_of: Callable[[], Any], steps: int) -> None:
        self.stream_of, self.steps = stream_of, steps

    def __iter__(self) -> Any:
        stream = self.stream_of()
        for _ in range(self.steps):
            yield hf_inputs(stream.next())


def _handoff_callback() -> Any:
    """A TrainerCallback that parks ``train()`` at the end of every optimizer step until the
    benchmark asks for the next one (``go``), and says when a step is done (``done``)."""
    import threading

    from transformers import TrainerCallback

    class Handoff(TrainerCallback):
        def __init__(self) -> None:
            self.go, self.done, self.stop = threading.Event(), threading.Event(), False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self.done.set()
            self.go.wait()
            self.go.clear()
            control.should_training_stop = self.stop
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self.done.set()
            return control

    return Handoff()


class HFTrainerLoop(HFTrainerStep):
    """``Trainer.train()`` itself, one optimizer step per call: ``train()`` runs in a worker
    thread over `_StreamDataset` (one whole app batch per item, in order) and a
    callback hands control back at each step's end. A timed call spans one whole iteration of
    the real loop: the loop's bookkeeping after the previous step, the DataLoader fetching and
    collating the next batch, ``training_step``, clipping, optimizer, scheduler, zero_grad."""

    def __init__(self, cfg: Any, stream_of: Callable[[], Any], steps: int) -> None:
        super().__init__(cfg, stream_of, dataset=_StreamDataset(stream_of, steps), max_steps=steps)
        tr, self.hand = self.trainer, _handoff_callback()
        tr.add_callback(self.hand)
        record = tr.training_step

        def training_step(*a: Any, **k: Any) -> torch.Tensor:
            loss = record(*a, **k)
            self.losses.append(float(loss))
            return loss

        tr.training_step = training_step
        self.thread: Any = None
        self.error: BaseException | None = None

    def _train(self, threads: int) -> None:
        torch.set_num_threads(threads)  # a new thread starts at OpenMP's default
        try:
            self.trainer.train()
        except BaseException as e:  # handed to the benchmark's thread, which waits on `done`
            self.error = e
            self.hand.done.set()

    def __call__(self) -> float:
        import threading

        if self.thread is None:
            self.thread = threading.Thread(target=self._train, args=(torch.get_num_threads(),),
                                           daemon=True)
            self.thread.start()
        else:
            self.hand.go.set()
        self.hand.done.wait()
        self.hand.done.clear()
        if self.error is not None:
            raise RuntimeError("Trainer.train() failed in its thread") from self.error
        return self.losses[-1]

    def close(self) -> None:
        """Let ``train()`` end and its thread finish."""
        if self.thread is not None and self.thread.is_alive():
            self.hand.stop = True
            self.hand.go.set()
            self.thread.join()


# the Trainer peers: (cfg, stream maker, steps of the run) -> a step callable
HF_CANDIDATES: dict[str, Callable[..., Any]] = {
    "hf_trainer": lambda cfg, stream_of, steps: HFTrainerStep(cfg, stream_of),
    "hf_trainer_train": HFTrainerLoop,
}


def same_lora_init(app: AppStep, hf: HFTrainerStep) -> None:
    """Both sides start from identical LoRA tensors (else step 1's losses could not agree)."""
    mine = {n.replace(".default", ""): p for n, p in app.ctx.lm.inner().items()}
    theirs = {n.replace(".default", ""): p for n, p in hf.model.named_parameters()
              if p.requires_grad}
    if set(mine) != set(theirs):
        raise AssertionError(f"LoRA names differ: {sorted(set(mine) ^ set(theirs))[:4]}")
    for n, p in mine.items():
        if not torch.equal(p.detach(), theirs[n].detach()):
            raise AssertionError(f"LoRA tensor {n} differs between the app and the peft peer")


def batch_tokens(stream_of: Callable[[], Any], steps: int) -> dict[str, float]:
    """Real (attended) and padded tokens per training batch over the first ``steps``: mean,
    min and max (what a packed layout would save)."""
    stream = stream_of()
    real, padded = [], []
    for _ in range(steps):
        b = stream.next()
        real.append(int(b.attention_mask.sum()))
        padded.append(b.attention_mask.numel())
    out: dict[str, float] = {}
    for name, xs in (("real", real), ("padded", padded)):
        out |= {f"{name}_tokens_per_batch": sum(xs) / steps, f"{name}_tokens_min": min(xs),
                f"{name}_tokens_max": max(xs)}
    return out


def build(model: str, names: list[str], steps: int) -> dict[str, Any]:
    """The candidates ``names`` (keys of `APP_CANDIDATES`, and ``hf_trainer``), each on its own
    model; the Trainer peers read the padded training stream of ``app_sft_padded``'s
    configuration (the same sequences ``app_sft`` packs: a Trainer takes padded batches)."""
    runs: dict[str, Any] = {}
    for name in names:
        if name in APP_CANDIDATES:
            method, over = APP_CANDIDATES[name]
            runs[name] = AppStep(app_config(model, over, steps), method)
    peers = [name for name in names if name in HF_CANDIDATES]
    if peers:
        method, over = APP_CANDIDATES["app_sft_padded"]
        sft = runs.get("app_sft_padded") or AppStep(app_config(model, over, steps), method)
        for name in peers:
            runs[name] = HF_CANDIDATES[name](sft.ctx.cfg, lambda: sft.ctx.stream("train"), steps)
            same_lora_init(sft, runs[name])
    return {name: runs[name] for name in names}


def check_first_loss(runs: dict[str, Any]) -> dict[str, float]:
    """Take step 1 of every candidate (untimed); assert ``hf_trainer``'s loss equals
    ``app_sft``'s to `LOSS_RTOL` relative. Returns each candidate's step-1 loss."""
    first = {name: run() for name, run in runs.items()}
    for name, loss in first.items():
        print(f"  step 1 loss {name:>12}: {loss:.6f}", flush=True)
    for peer in (name for name in first if name in HF_CANDIDATES and "app_sft" in first):
        a, h = first["app_sft"], first[peer]
        if abs(a - h) > LOSS_RTOL * abs(a):
            raise AssertionError(f"step-1 losses differ: app_sft {a:.6f}, {peer} {h:.6f} "
                                 f"(relative {abs(a - h) / abs(a):.2e} > {LOSS_RTOL:g})")
    return first


def _loss_gap(runs: dict[str, Any], name: str) -> float | None:
    """Largest relative difference between ``name``'s and ``app_sft``'s losses, step by step
    (same batches; after step 1 it also reflects the two schedules' warmup factors)."""
    if "app_sft" not in runs:
        return None
    pairs = zip(runs[name].losses, runs["app_sft"].losses)
    return max(abs(a - b) / abs(b) for a, b in pairs)


def records(runs: dict[str, Any], times: dict[str, list[float]], first: dict[str, float],
            model: str) -> list[dict[str, Any]]:
    """One record per candidate: its times, the speed-up over ``hf_trainer`` (median ratio and
    the per-round spread), its step-1 loss and every loss it reported."""
    ref = "hf_trainer" if "hf_trainer" in times else next(iter(times))
    t_ref = harness.median(times[ref])
    out = []
    for name, ts in times.items():
        t = harness.median(ts)
        spread = harness.paired_ratios(times, ref, name)
        out.append({
            "candidate": name, "model": model, "reference": ref,
            "method": APP_CANDIDATES[name][0] if name in APP_CANDIDATES else "sft",
            "overrides": APP_CANDIDATES[name][1] if name in APP_CANDIDATES else {},
            "seconds_median": t, "seconds_min": min(ts), "seconds_max": max(ts),
            "seconds_all": ts, "speedup_vs_ref": t_ref / t, "speedup_round_min": spread["min"],
            "speedup_round_median": spread["median"], "speedup_round_max": spread["max"],
            "first_loss": first[name], "losses": list(runs[name].losses),
            "max_rel_loss_diff_vs_app_sft": _loss_gap(runs, name),
        })
    return out


def render(meta: dict[str, Any], recs: list[dict[str, Any]]) -> str:
    """The markdown table of one run."""
    f = harness.fmt
    rows = [[r["candidate"], r["method"], f(r["seconds_median"], "ms"), f(r["seconds_min"], "ms"),
             f(r["speedup_vs_ref"], "x"),
             f"{f(r['speedup_round_min'], 'x')} / {f(r['speedup_round_max'], 'x')}",
             f"{r['first_loss']:.4f}"] for r in recs]
    env = meta["env"]
    return (
        f"# Training step: the app vs transformers.Trainer + peft ({meta['model']})\n\n"
        f"{meta['rounds']} timed rounds round-robin after step 1 (the loss check) and "
        f"{meta['warmup']} warm-up round(s), {env['threads']} torch thread(s), torch "
        f"{env['torch']}, transformers {meta['transformers']}, peft {meta['peft']}, "
        f"{env['date']}. Batches of the preset's SFT stream: "
        f"{meta['real_tokens_per_batch']:.0f} real tokens in "
        f"{meta['padded_tokens_per_batch']:.0f} padded ones on average "
        f"({meta['real_tokens_min']}–{meta['real_tokens_max']} in "
        f"{meta['padded_tokens_min']}–{meta['padded_tokens_max']}).\n\n"
        + harness.markdown_table(
            ["candidate", "method", "ms / step (median)", "ms (best)",
             f"speed-up vs {recs[0]['reference']}",
             "speed-up per round (min / max)", "step-1 loss"], rows)
        + "\n"
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 timed rounds")
    ap.add_argument("--model", default=None, choices=sorted(PRESETS))
    ap.add_argument("--candidates", nargs="+", default=[*APP_CANDIDATES, *HF_CANDIDATES],
                    choices=[*APP_CANDIDATES, *HF_CANDIDATES])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15; quick 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds after step 1")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=None, help="output stem")
    return ap


def _train_stream(runs: dict[str, Any]) -> Callable[[], Any]:
    """A maker of fresh SFT training streams of the runs' data (for token counts)."""
    run = next(iter(runs.values()))
    if isinstance(run, HFTrainerStep):
        return run.stream_of
    return lambda: run.ctx.stream("train")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import peft
    import transformers

    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or ("tiny" if args.quick else "smollm2")
    rounds = args.rounds or (2 if args.quick else 15)
    out = args.out or harness.RESULTS / ("training_quick" if args.quick else "training")
    steps = 1 + args.warmup + rounds
    runs = build(model, list(args.candidates), steps)
    meta = {"env": harness.environment(torch.device("cpu")), "model": model, "rounds": rounds,
            "warmup": args.warmup, "transformers": transformers.__version__,
            "peft": peft.__version__, "loss_rtol": LOSS_RTOL,
            **batch_tokens(_train_stream(runs), steps)}
    try:
        first = check_first_loss(runs)
        times = harness.time_alternating(runs, device=torch.device("cpu"), warmup=args.warmup,
                                         repeats=rounds, min_repeats=rounds)
    finally:
        for run in runs.values():
            if hasattr(run, "close"):
                run.close()
    rec = harness.Recorder(out.with_suffix(".json"), meta)
    for r in records(runs, times, first, model):
        rec.add(r)
        print(f"{r['candidate']:>12}: {1000 * r['seconds_median']:8.1f} ms/step  "
              f"speed-up vs {r['reference']} {r['speedup_vs_ref']:.2f}x "
              f"(rounds {r['speedup_round_min']:.2f}-{r['speedup_round_max']:.2f}x)", flush=True)
    out.with_suffix(".md").write_text(render(meta, rec.records))
    return {"meta": meta, "records": rec.records}


if __name__ == "__main__":
    main()
