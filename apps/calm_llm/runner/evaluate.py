"""Stage 4 of a run: evaluate a trained (and fitted) method on every evaluation set, as one
row, and (for a trained method that learns α) again without α as ``row:no_alpha``.

Two implementations, chosen by the task, behind one signature
``evaluate_*(state, ev, info, method, row, ctx, *, select)``; each fits the method's post-hoc
part (``ts``: T), evaluates every pass and writes the results at once:

* `evaluate_mc`: option scoring. Each question's K option log-likelihoods (``predict``) become
  probabilities ``p = softmax(method's transform of the scores)`` (N, K); the metrics of
  `apps.calm_llm.evaluate` (accuracy, conf-/cw-ECE with bootstrap intervals, Brier, NLL) are
  computed from ``p`` and the labels. Cost: one forward per question and pass (the untrained
  model's scores are computed once and shared by every method that does not train).
* `evaluate_open_qa`: sampling. For each question, ``--n-samples`` answers at
  ``--sample-temperature``, a greedy answer and (with --verbalized) a verbalized confidence,
  with the method's logits processors (α, 1/T); the answers are clustered by meaning and judged
  against the gold aliases; `apps.calm_llm.open_qa.score` turns the records into Semantic-ECE
  and friends (Farquhar et al., 2024, "Detecting hallucinations in large language models using
  semantic entropy"). Cost: (n + 1 (+1)) generations per question and pass.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from calibration import metrics as calibration_metrics
from calibration import semantic

from .. import evaluate, sampling, scoring
from .. import methods as method_registry
from ..data import Collator, batch_iterator
from ..data.open_qa import OpenQAExample
from ..data.schema import InstructionExample
from ..logs import log
from ..methods.base import Context, Method
from ..open_qa import score
from ..open_qa.judge import judge_answers
from ..predict import predict_option_logits, probabilities
from .load import INSTRUCTION, Evaluation
from .report import RunState
from .train import EvalSet

VERBALIZED = ("Question: {question}\nProposed answer: {answer}\nHow confident are you that the "
              "proposed answer is correct? Reply with a number from 0 to 100.")
VERBALIZED_TOKENS = 8  # "Confidence: 85%" fits; a longer reply that holds no number is a failure

def passes(state: RunState, info: method_registry.MethodInfo, method: Method,
           row: str) -> list[tuple[str, Any]]:
    """The rows one trained method is evaluated as: ``row`` as it predicts, and, for a trained
    method that learns α and uses it (with --eval-without-alpha), ``row:no_alpha`` with α
    switched off; each with the context manager that sets the method up for it."""
    out: list[tuple[str, Any]] = [(row, contextlib.nullcontext())]
    if info.trains and info.learns_alpha and state.cfg.calm.eval_without_alpha \
            and method.alpha_in_use:
        out.append((f"{row}:no_alpha", method.without_alpha()))
    return out


# -- multiple choice: option scoring -------------------------------------------------------------
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


def zero_shot(state: RunState, ev: Evaluation) -> None:
    """Show that the model is above chance before training (recorded in metrics.json)."""
    probe = method_registry.get("none")(ev.ctx)
    for es in ev.eval_sets:
        ol, y = ev.base_logits(es, probe)
        acc = float((ol.argmax(-1) == y).float().mean())
        state.extra["zero_shot_accuracy"][es.name] = acc
        chance = float((1.0 / torch.isfinite(ol).sum(-1).float()).mean())
        log(f"zero-shot accuracy on {es.name} ({es.domain}, n={len(y)}): {acc:.3f} "
            f"(chance {chance:.3f})", state.dist)


def evaluate_mc(state: RunState, ev: Evaluation, info: method_registry.MethodInfo, method: Method,
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


# -- open QA: sampling ---------------------------------------------------------------------------
def evaluate_open_qa(state: RunState, ev: Evaluation, info: method_registry.MethodInfo,
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


def evaluate_pass(state: RunState, ev: Evaluation, method: Method, name: str,
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


def answer_questions(ev: Evaluation, method: Method, es: EvalSet, desc: str) -> list[score.QuestionRecord]:
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
