"""The open-QA runner behind ``python -m apps.calm_llm --task open_qa`` (docs/open_qa.md).

The stages mirror the multiple-choice runner (`apps.calm_llm.train`), whose run-directory,
resume checks, checkpointed training loop and export it reuses:

1. splits: train / calibration / test from the in-domain open-QA sources, test sets from the
   out-of-domain ones (`data.splits.make_splits`, disjoint by question text);
2. training data: each training and calibration question becomes an instruction example whose
   response is its first gold alias and a newline, so ``sft`` is completion-only CE on the gold
   answer and CALM's upper level reads the gold answers' token positions;
3. per method: train (resumably) → fit (``ts``: T on the gold answers' token NLL) → sample n
   answers, a greedy answer and (optionally) a verbalized confidence for every test question,
   with the method's logits processors (α, 1/T) → records → metrics → write → export.

Single process only (a clear error under ``accelerate launch``/``torchrun``).
"""

from __future__ import annotations

import contextlib
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from calibration import semantic

from ...errors import ConfigError, RunRefused
from .. import distributed, export, sampling, scoring
from .. import methods as method_registry
from .. import model as model_lib
from ..config import Config, data_files, data_hub, needs_second_order, split_seed
from ..data import Collator, batch_iterator, make_splits
from ..data.open_qa import OpenQAExample, load_open_qa
from ..data.schema import InstructionExample
from ..io import read_json
from ..logs import log
from ..methods.base import Context, Method
from ..runner.prepare import RESULTS_FIX, base_method, claim_run_dir, refuse_changed, run_lock
from ..runner.train import EvalSet, train_method
from . import score
from .judge import LLMJudge, judge_answers

INSTRUCTION = "Answer the question with a short answer.\nQuestion: {question}"
VERBALIZED = ("Question: {question}\nProposed answer: {answer}\nHow confident are you that the "
              "proposed answer is correct? Reply with a number from 0 to 100.")
VERBALIZED_TOKENS = 8  # "Confidence: 85%" fits; a longer reply that holds no number is a failure


def to_instruction(ex: OpenQAExample) -> InstructionExample:
    """The training form of a question: the gold answer (its first alias) ends with a newline,
    the token at which sampling stops, so the model learns where an answer ends."""
    return InstructionExample(ex.id, INSTRUCTION.format(question=ex.question), "",
                              ex.answers[0] + "\n", ex.source)


def prompt_text(collator: Collator, instruction: str) -> str:
    """The prompt string the model continues (chat template or Alpaca, as --prompt-style)."""
    return collator.instruction_texts(InstructionExample("p", instruction, "", "", "p"))[0]


# -- data ----------------------------------------------------------------------------------------
def load_splits(cfg: Config):
    """Open-QA sources → seeded splits (the MCQA protocol; disjoint by question text)."""
    d, files, hub = cfg.data, data_files(cfg), data_hub(cfg)

    def src(name: str) -> list[OpenQAExample]:
        return load_open_qa(name, path=files.get(name), hub=hub.get(name),
                            limit=d.source_limit or None, seed=split_seed(cfg))

    return make_splits({n: src(n) for n in d.in_domain}, {n: src(n) for n in d.out_of_domain},
                       n_train=d.n_train, n_calib=d.n_calib, n_test=d.n_test, n_ood=d.n_ood,
                       seed=split_seed(cfg), dedup=d.dedup)


def cluster_backend(cfg: Config) -> semantic.ClusterBackend:
    """--cluster: exact match (offline default), MiniLM embeddings, or NLI entailment."""
    q = cfg.open_qa
    if q.cluster == "embedding":
        from ..semantic_models import sentence_embedder

        return semantic.EmbeddingSimilarity(sentence_embedder(), threshold=q.cluster_threshold)
    if q.cluster == "nli":
        from ..semantic_models import nli_entailment

        return semantic.BidirectionalEntailment(nli_entailment(q.nli_model))
    return semantic.ExactMatch()


# -- the run's state -----------------------------------------------------------------------------
@dataclass
class OpenQARun:
    """What the stages share; ``results``/``records`` grow as methods finish (keyed by row)."""

    cfg: Config
    dist: distributed.Dist
    run_dir: Any
    config_hash: str
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: dict[str, dict[str, list[score.QuestionRecord]]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self) -> None:
        score.write_results(self.run_dir, self.results, self.records, n_bins=self.cfg.n_bins,
                            extra=self.extra)


@dataclass
class OpenQAEval:
    """The model-side state: context (collator, training/calibration examples), evaluation
    sets, the LoRA initialization every method starts from, the clustering backend."""

    ctx: Context
    eval_sets: list[EvalSet]
    init_lora: dict[str, torch.Tensor]
    backend: semantic.ClusterBackend
    judge: LLMJudge | None = None  # --match judge
    # `gold_token_logits` of the model at ``init_lora``: every row that does not train (none,
    # ts) has that model, so one forward over the calibration split serves them all
    untrained_calib: tuple[torch.Tensor, torch.Tensor] | None = None


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
    restore(state)
    ev = build(state, splits)
    for name in cfg.methods:
        if name not in state.results:
            run_method(state, ev, method_registry.info(name), name)
    ev.ctx.lm.load_inner(ev.init_lora)
    table = score.render_table(state.results)
    print(table, flush=True)
    return {"results": state.results, "run_dir": str(state.run_dir), "table": table}


def prepare(cfg: Config, dist: distributed.Dist) -> tuple[OpenQARun, Any]:
    """Claim the run directory, refuse a resume that would mix results, carve and record the
    splits (config.json, splits.json), as the multiple-choice runner does."""
    run_dir, splits = claim_run_dir(cfg, dist, load_splits)
    log(f"open QA: {len(splits.train)} training, {len(splits.calib)} calibration questions; "
        "test " + ", ".join(f"{n} {len(v)}" for n, v in [*splits.test.items(), *splits.ood.items()]),
        dist)
    state = OpenQARun(cfg, dist, run_dir, cfg.hash())
    state.extra = {"config_hash": state.config_hash, "split_fingerprints": splits.fingerprints()}
    return state, splits


def restore(state: OpenQARun) -> None:
    """On resume, keep the rows already evaluated for the methods still asked for,
    re-evaluated from their records if --n-bins/--n-boot changed."""
    cfg, path = state.cfg, state.run_dir / "metrics.json"
    if not (cfg.resume and path.is_file()):
        return
    saved = read_json(path, RESULTS_FIX).get("results", {})
    records = score.read_records(state.run_dir)
    changed = False
    for row, per_ds in saved.items():
        if base_method(row) not in cfg.methods or row not in records:
            continue
        state.records[row] = records[row]
        state.results[row] = {}
        for ds, r in per_ds.items():
            if ds not in records[row]:
                raise RunRefused(f"{path}: row {row!r} has {ds} but the run's saved answers hold "
                                 f"none for it. {RESULTS_FIX}")
            # an edited value (or another run's metrics.json) is refused, not carried on
            refuse_changed(r, score.dataset_metrics(
                records[row][ds], domain=r["domain"], n_bins=r.get("n_bins", cfg.n_bins),
                n_boot=0, n_splits=cfg.open_qa.split_half_splits),
                f"{path}: {row} on {ds}:", "the saved answers")
            if r.get("n_bins") != cfg.n_bins or r.get("n_boot") != cfg.n_boot:
                r = {**r, **score.dataset_metrics(records[row][ds], domain=r["domain"],
                                                  n_bins=cfg.n_bins, n_boot=cfg.n_boot,
                                                  n_splits=cfg.open_qa.split_half_splits)}
                changed = True
            state.results[row][ds] = r
        log(f"[{row}] already evaluated in {state.run_dir}; kept", state.dist)
    if changed:
        state.write()


def build(state: OpenQARun, splits: Any) -> OpenQAEval:
    """Seed, load the model, build the collator, the methods' `Context` and the backend."""
    cfg = state.cfg
    torch.manual_seed(cfg.seed)
    device = model_lib.resolve_device(distributed.device_for(state.dist, cfg.device))
    log(f"loading model {cfg.model.name_or_path!r} on {device}", state.dist)
    lm = model_lib.load(cfg.model, device=device, eager=needs_second_order(cfg), seed=cfg.seed,
                        dist=state.dist)
    collator = Collator(lm.tokenizer, mode="cloze", prompt_style=cfg.data.prompt_style,
                        max_length=cfg.model.max_length, max_options=cfg.data.max_options)
    ctx = Context(cfg=cfg, lm=lm, collator=collator,
                  train_examples=[to_instruction(e) for e in splits.train],
                  calib_examples=[to_instruction(e) for e in splits.calib],
                  train_collator=collator, option_token_ids=None, dist=state.dist)
    eval_sets = [EvalSet(n, "id", ex) for n, ex in splits.test.items()]
    eval_sets += [EvalSet(n, "ood", ex) for n, ex in splits.ood.items()]
    judge = (LLMJudge.load(cfg.open_qa.judge_model, device=lm.device, dtype=cfg.model.dtype)
             if cfg.open_qa.match == "judge" else None)
    return OpenQAEval(ctx, eval_sets, lm.inner_state(), cluster_backend(cfg), judge)


# -- one method ----------------------------------------------------------------------------------
def run_method(state: OpenQARun, ev: OpenQAEval, info: method_registry.MethodInfo, row: str) -> None:
    """Train (resumably), fit, answer every evaluation set, write and export one method."""
    ctx = ev.ctx
    ctx.lm.load_inner(ev.init_lora)
    # seeded by the row's name, not its place in --methods: a row is the same in any run
    torch.manual_seed(state.cfg.seed + zlib.crc32(row.encode()) % 100_000)
    method = info.load()(ctx, name=row)
    t0 = time.time()
    if info.trains:
        train_method(method, ctx, run_dir=state.run_dir, config_hash=state.config_hash,
                     resume=bool(state.cfg.resume))
    # the trained model's gold-answer logits on the calibration split: the ts fit and every
    # pass's calib_nll read them (α and 1/T act after the model, so one forward serves all)
    untrained = not info.trains and at_init(ev)
    calib = ev.untrained_calib if untrained else None
    if calib is None:
        calib = gold_token_logits(ctx, ctx.calib_examples)
        ev.untrained_calib = calib if untrained else ev.untrained_calib
    method.after_training(lambda _examples: calib)
    passes = [(row, contextlib.nullcontext())]
    if info.trains and info.learns_alpha and state.cfg.calm.eval_without_alpha \
            and method.alpha_in_use:
        passes.append((f"{row}:no_alpha", method.without_alpha()))
    for name, scope in passes:
        with scope:
            evaluate_pass(state, ev, method, name, calib)
        state.write()
    if state.dist.main:  # every method but `none` exports (ts: its T)
        export.export_method(state.run_dir / "export" / row, ctx.lm, method, run_dir=state.run_dir)
    accs = ", ".join(f"{ds} acc {r['accuracy']:.3f} sem-ECE {r['semantic_ece']:.3f}"
                     for ds, r in state.results[row].items())
    log(f"[{row}] done in {time.time() - t0:.0f}s: {accs}", state.dist)


def at_init(ev: OpenQAEval) -> bool:
    """Whether the model's trained tensors are still ``ev.init_lora`` (a method that trains
    nothing could still have loaded others: then its logits are its own)."""
    now = ev.ctx.lm.inner()
    return now.keys() == ev.init_lora.keys() and all(
        torch.equal(now[k], v) for k, v in ev.init_lora.items())


def evaluate_pass(state: OpenQARun, ev: OpenQAEval, method: Method, name: str,
                  calib: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Answer every evaluation set with the method as it predicts now (α on or off) as row
    ``name``; the calibration split's gold-answer NLL is recorded beside the metrics."""
    cfg = state.cfg
    extras = {**method.extras, "calib_nll": calib_nll(method, *calib)}
    state.results[name], state.records[name] = {}, {}
    for es in ev.eval_sets:
        t0 = time.time()
        recs = answer_questions(ev, method, es, f"{name} {es.name}")
        seconds = (time.time() - t0) / max(len(recs), 1)
        state.records[name][es.name] = recs
        state.results[name][es.name] = {
            **score.dataset_metrics(recs, domain=es.domain, n_bins=cfg.n_bins, n_boot=cfg.n_boot,
                                    n_splits=cfg.open_qa.split_half_splits),
            **extras, "seconds_per_question": seconds,
        }


def gold_token_logits(ctx: Context, examples: list[InstructionExample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, V) next-token logits of the model at the M gold-answer tokens of ``examples``, and
    the (M,) gold tokens: what ``ts`` fits T to and what ``calib_nll`` scores."""
    zs, ys = [], []
    with ctx.lm.mode(False), torch.no_grad():
        for batch in batch_iterator(examples, ctx.collator, ctx.cfg.train.eval_batch_size,
                                    shuffle=False, seed=0):
            logits, batch = ctx.forward(None, batch.to(ctx.lm.device))
            zs.append(scoring.answer_logits(logits, batch).float().cpu())
            ys.append(scoring.answer_targets(logits, batch).cpu())
    return torch.cat(zs), torch.cat(ys)


def calib_nll(method: Method, z: torch.Tensor, y: torch.Tensor) -> float:
    """Mean token NLL of the calibration split's gold answers under the method's model as it
    generates (its logits processors applied to ``z`` (M, V), the `gold_token_logits` of the
    trained model, against ``y`` (M,)): lower is better, no test data read."""
    for p in method.generation_processors():
        z = p(None, z)
    return float(F.cross_entropy(z.float(), y))


def answer_questions(ev: OpenQAEval, method: Method, es: EvalSet, desc: str) -> list[score.QuestionRecord]:
    """Sample, answer greedily, ask for a verbalized confidence; cluster and judge."""
    ctx, q = ev.ctx, ev.ctx.cfg.open_qa
    collator, lm, procs = ctx.collator, ctx.lm, method.generation_processors()
    prompts = [prompt_text(collator, INSTRUCTION.format(question=e.question)) for e in es.examples]
    # the seed of a set does not depend on which methods ran before it: a resumed run samples
    # exactly what the uninterrupted one would have
    seed = ctx.cfg.seed + zlib.crc32(es.name.encode()) % 100_000
    # samples and greedy answers from one prompt forward per batch (bit-identical to two passes)
    samples, greedy = sampling.sample_and_greedy(
        lm, prompts, n=q.n_samples, temperature=q.sample_temperature, top_p=q.top_p,
        max_new_tokens=q.max_new_tokens, seed=seed, processors=procs,
        batch_size=q.gen_batch_size, desc=f"{desc} sampling+greedy")
    replies: list[str | None] = [None] * len(prompts)
    if q.verbalized:
        vprompts = [prompt_text(collator, VERBALIZED.format(question=e.question, answer=g.text))
                    for e, g in zip(es.examples, greedy)]
        replies = [g.text for g in sampling.greedy_answers(
            lm, vprompts, max_new_tokens=VERBALIZED_TOKENS, processors=procs,
            batch_size=q.gen_batch_size, desc=f"{desc} verbalized")]
    clusters = [ev.backend.cluster(s, question=ex.question) for ex, s in zip(es.examples, samples)]
    modal = [semantic.modal_answer(s, ids) for s, ids in zip(samples, clusters)]
    # the modal and greedy answers of every question judged in one pass (one batched judge call)
    items = [(ex.question, a, ex.answers) for ex, a in zip(es.examples, modal)] + \
            [(ex.question, g.text, ex.answers) for ex, g in zip(es.examples, greedy)]
    right = judge_answers(items, q.match, ev.judge)
    n = len(es.examples)
    return [make_record(ex, s, ids, m, g, reply, mc, gc) for ex, s, ids, m, g, reply, mc, gc
            in zip(es.examples, samples, clusters, modal, greedy, replies, right[:n], right[n:])]


def make_record(ex: OpenQAExample, samples: list[str], cluster_ids: list[int], modal: str,
                greedy: Any, reply: str | None, modal_correct: bool,
                greedy_correct: bool) -> score.QuestionRecord:
    """One question's record: clusters, the modal answer and both answers with their verdicts."""
    return score.QuestionRecord(
        id=ex.id, question=ex.question, answers=list(ex.answers), samples=list(samples),
        cluster_ids=list(cluster_ids), modal_answer=modal, modal_correct=modal_correct,
        greedy=greedy.text, greedy_logprobs=list(greedy.token_logprobs),
        greedy_correct=greedy_correct,
        verbalized_reply=reply,
        verbalized=None if reply is None else semantic.parse_verbalized_confidence(reply),
    )
