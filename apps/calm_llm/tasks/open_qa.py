"""The open-QA task (``--task open_qa``, docs/open_qa.md): free-form answers to open questions.

1. data: train / calibration / test splits from the in-domain open-QA sources, test sets from
   the out-of-domain ones (`data.splits.make_splits`, disjoint by question text); each training
   and calibration question becomes an instruction example whose response is its first gold
   alias and a newline, so ``sft`` is completion-only CE on the gold answer and CALM's upper
   level reads the gold answers' token positions (`to_instruction`);
2. per row: fit (``ts``: T on the gold answers' token NLL, `gold_token_logits`) → for every test
   question ``--n-samples`` answers at ``--sample-temperature``, a greedy answer and (with
   --verbalized) a verbalized confidence, with the method's logits processors (α, 1/T); the
   answers are clustered by meaning and judged against the gold aliases (`answer_questions`);
   `apps.calm_llm.open_qa.score` turns the records into Semantic-ECE and friends (Farquhar et
   al., 2024, "Detecting hallucinations in large language models using semantic entropy").
   Cost: (n + 1 (+1)) generations per question and pass.

Single process only, no ``--select`` (its `TaskInfo`: ``single_process``, ``supports_select``).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from calibration import semantic

from ...errors import RunRefused
from .. import distributed, sampling, scoring
from .. import methods as method_registry
from ..config import Config, data_files, data_hub, split_seed
from ..data import Collator, batch_iterator, make_splits
from ..data.open_qa import OpenQAExample, load_open_qa
from ..data.schema import InstructionExample
from ..logs import log
from ..methods.base import Context, Method
from ..open_qa import score
from ..open_qa.judge import LLMJudge, judge_answers
from ..runner.evaluate import passes
from ..runner.load import Evaluation, eval_sets, load_model
from ..runner.prepare import RESULTS_FIX, refuse_changed
from ..runner.report import RunState, restore_rows
from ..runner.train import EvalSet
from .base import Task

# the open-QA prompt: a question, answered by a short free-form answer
INSTRUCTION = "Answer the question with a short answer.\nQuestion: {question}"
VERBALIZED = ("Question: {question}\nProposed answer: {answer}\nHow confident are you that the "
              "proposed answer is correct? Reply with a number from 0 to 100.")
VERBALIZED_TOKENS = 8  # "Confidence: 85%" fits; a longer reply that holds no number is a failure


@dataclass
class OpenQAEvaluation(Evaluation):
    """`Evaluation` plus the answer-clustering backend, the optional LLM judge and the
    untrained model's gold-answer logits on the calibration split (every row that trains
    nothing has that model, so one forward serves them all)."""

    backend: semantic.ClusterBackend | None = None
    judge: LLMJudge | None = None  # under --match judge
    untrained_calib: tuple[torch.Tensor, torch.Tensor] | None = None


# -- data and model ------------------------------------------------------------------------------
def load_open_qa_splits(cfg: Config) -> Any:
    """Open-QA sources → `Splits`, by the multiple-choice protocol (disjoint by question text)."""
    d, files, hub = cfg.data, data_files(cfg), data_hub(cfg)

    def src(name: str) -> list[OpenQAExample]:
        return load_open_qa(name, path=files.get(name), hub=hub.get(name),
                            limit=d.source_limit or None, seed=split_seed(cfg))

    return make_splits({n: src(n) for n in d.in_domain}, {n: src(n) for n in d.out_of_domain},
                       n_train=d.n_train, n_calib=d.n_calib, n_test=d.n_test, n_ood=d.n_ood,
                       seed=split_seed(cfg), dedup=d.dedup)


def to_instruction(ex: OpenQAExample) -> InstructionExample:
    """The training form of an open-QA question: the gold answer (its first alias) ends with a
    newline, the token at which sampling stops, so the model learns where an answer ends."""
    return InstructionExample(ex.id, INSTRUCTION.format(question=ex.question), "",
                              ex.answers[0] + "\n", ex.source)


def build_open_qa(cfg: Config, dist: distributed.Dist, splits: Any) -> OpenQAEvaluation:
    """Load the model, the cloze collator, the methods' `Context` (every training and
    calibration question as an instruction example), the clustering backend and the judge."""
    lm = load_model(cfg, dist)
    collator = Collator(lm.tokenizer, mode="cloze", prompt_style=cfg.data.prompt_style,
                        max_length=cfg.model.max_length, max_options=cfg.data.max_options)
    ctx = Context(cfg=cfg, lm=lm, collator=collator,
                  train_examples=[to_instruction(e) for e in splits.train],
                  calib_examples=[to_instruction(e) for e in splits.calib],
                  train_collator=collator, option_token_ids=None, dist=dist)
    judge = (LLMJudge.load(cfg.open_qa.judge_model, device=lm.device, dtype=cfg.model.dtype)
             if cfg.open_qa.match == "judge" else None)
    return OpenQAEvaluation(ctx, eval_sets(splits), lm.inner_state(), backend=cluster_backend(cfg),
                            judge=judge)


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

# -- evaluation ----------------------------------------------------------------------------------
def evaluate_open_qa(state: RunState, ev: OpenQAEvaluation, info: method_registry.MethodInfo,
                     method: Method, row: str, ctx: Context, *, select: bool = False) -> None:
    """Fit on the trained model's gold-answer logits of the calibration split (``ts``: T), then
    answer every evaluation set in each of the method's `passes`, writing after each pass."""
    # α and 1/T act after the model, so one forward of the calibration split serves the fit
    # and every pass's calib_nll; the rows that train nothing share the untrained model's
    untrained = not info.trains and ev.at_init()
    calib = ev.untrained_calib if untrained else None
    if calib is None:
        calib = gold_token_logits(ctx, ctx.calib_examples)
        ev.untrained_calib = calib if untrained else ev.untrained_calib
    method.after_training(lambda _examples: calib)
    for name, scope in passes(state, info, method, row):
        with scope:
            evaluate_pass(state, ev, method, name, calib)
        state.write()


def evaluate_pass(state: RunState, ev: OpenQAEvaluation, method: Method, name: str,
                  calib: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Answer every evaluation set with the method as it predicts now (α on or off) as row
    ``name``; the calibration split's gold-answer NLL is recorded beside the metrics."""
    cfg = state.cfg
    extras = {**method.extras, "calib_nll": calib_nll(method, *calib)}
    state.results[name], state.outputs[name] = {}, {}
    for es in ev.eval_sets:
        t0 = time.time()
        recs = answer_questions(ev, method, es, f"{name} {es.name}")
        seconds = (time.time() - t0) / max(len(recs), 1)
        state.outputs[name][es.name] = recs
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


def prompt_text(collator: Collator, instruction: str) -> str:
    """The prompt string the model continues (chat template or Alpaca, as --prompt-style)."""
    return collator.instruction_texts(InstructionExample("p", instruction, "", "", "p"))[0]


def answer_questions(ev: OpenQAEvaluation, method: Method, es: EvalSet, desc: str) -> list[score.QuestionRecord]:
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

# -- resume: the rows already evaluated ----------------------------------------------------------
def restore_open_qa(state: RunState) -> None:
    """Open QA: keep the evaluated rows, each number checked against what its saved answers
    give, re-evaluated from them if --n-bins/--n-boot changed."""
    cfg, path = state.cfg, state.run_dir / "metrics.json"
    if restore_rows(state, score.read_records) is None:
        return
    changed = False
    for row, per_ds in state.results.items():
        records = state.outputs[row]
        for ds, r in list(per_ds.items()):
            if ds not in records:
                raise RunRefused(f"{path}: row {row!r} has {ds} but the run's saved answers hold "
                                 f"none for it. {RESULTS_FIX}")
            # an edited value (or another run's metrics.json) is refused, not carried on
            refuse_changed(r, score.dataset_metrics(
                records[ds], domain=r["domain"], n_bins=r.get("n_bins", cfg.n_bins),
                n_boot=0, n_splits=cfg.open_qa.split_half_splits),
                f"{path}: {row} on {ds}:", "the saved answers")
            if r.get("n_bins") != cfg.n_bins or r.get("n_boot") != cfg.n_boot:
                per_ds[ds] = {**r, **score.dataset_metrics(records[ds], domain=r["domain"],
                                                           n_bins=cfg.n_bins, n_boot=cfg.n_boot,
                                                           n_splits=cfg.open_qa.split_half_splits)}
                changed = True
    if changed:
        state.write()


class OpenQA(Task):
    """``--task open_qa``: the stages' calls, answered by the functions above."""

    def load_splits(self, cfg: Config) -> Any:
        return load_open_qa_splits(cfg)

    def run_record(self, splits: Any, dist: distributed.Dist) -> dict[str, Any]:
        log(f"open QA: {len(splits.train)} training, {len(splits.calib)} calibration questions; "
            "test " + ", ".join(f"{n} {len(v)}" for n, v in [*splits.test.items(),
                                                              *splits.ood.items()]), dist)
        return super().run_record(splits, dist)

    def build(self, cfg: Config, dist: distributed.Dist, splits: Any) -> OpenQAEvaluation:
        return build_open_qa(cfg, dist, splits)

    def restore(self, state: RunState) -> None:
        restore_open_qa(state)

    def evaluate(self, state: RunState, ev: Evaluation, info: method_registry.MethodInfo,
                 method: Method, row: str, ctx: Context, *, select: bool = False) -> None:
        assert isinstance(ev, OpenQAEvaluation)
        evaluate_open_qa(state, ev, info, method, row, ctx, select=select)

    def write_results(self, run_dir: Path, results: dict[str, dict[str, Any]],
                      outputs: dict[str, dict[str, Any]], *, n_bins: int,
                      extra: dict[str, Any]) -> None:
        score.write_results(run_dir, results, outputs, n_bins=n_bins, extra=extra)

    def render_table(self, results: dict[str, dict[str, Any]]) -> str:
        return score.render_table(results)
