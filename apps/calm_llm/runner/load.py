"""Stage 2 of a run: the data (sources → seeded splits) and the model-side state every row is
run against (the model with its LoRA initialization, the collators, the methods' `Context`,
the evaluation sets), for both tasks.

The splits follow one protocol for both tasks (`data.splits.make_splits`: train / calibration /
per-source test from the in-domain sources, test sets from the out-of-domain ones, disjoint by
question text, deterministic in the split seed); only the rows differ (`MCQAExample` or
`OpenQAExample`) and, for open QA, the training form of a question (`to_instruction`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from calibration import semantic

from .. import distributed
from .. import model as model_lib
from ..config import Config, data_files, data_hub, needs_second_order, split_seed
from ..data import Collator, load_source, make_splits, warn_truncated
from ..data.open_qa import OpenQAExample, load_open_qa
from ..data.schema import InstructionExample
from ..logs import log
from ..methods.base import Context, Method
from ..predict import predict_option_logits
from .train import EvalSet

# the open-QA prompt: a question, answered by a short free-form answer
INSTRUCTION = "Answer the question with a short answer.\nQuestion: {question}"


@dataclass
class Evaluation:
    """The model-side state every row is run against: the context, the evaluation sets, the
    LoRA initialization each row starts from; for multiple choice the untrained model's option
    logits (shared by every method that does not train), for open QA the answer-clustering
    backend and the optional LLM judge."""

    ctx: Context
    eval_sets: list[EvalSet]
    init_lora: dict[str, torch.Tensor]
    base_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    backend: semantic.ClusterBackend | None = None
    judge: Any = None  # open_qa.judge.LLMJudge under --match judge
    # open QA: the untrained model's gold-answer logits on the calibration split (every row
    # that trains nothing has that model, so one forward serves them all)
    untrained_calib: tuple[torch.Tensor, torch.Tensor] | None = None

    def base_logits(self, es: EvalSet, method: Method) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, K) option logits and (N,) labels of the untrained model on ``es`` (cached)."""
        if es.name not in self.base_cache:
            self.base_cache[es.name] = predict_option_logits(self.ctx, method, es.examples, es.name)
        return self.base_cache[es.name]

    def at_init(self) -> bool:
        """Whether the model's trained tensors are still ``init_lora`` (a method that trains
        nothing could still have loaded others: then its logits are its own)."""
        now = self.ctx.lm.inner()
        return now.keys() == self.init_lora.keys() and all(
            torch.equal(now[k], v) for k, v in self.init_lora.items())


# -- data ----------------------------------------------------------------------------------------
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


# -- model ---------------------------------------------------------------------------------------
def load_model(cfg: Config, dist: distributed.Dist) -> Any:
    """Seed with ``--seed``, then load the model (base + LoRA θ) on the run's device."""
    torch.manual_seed(cfg.seed)
    device = model_lib.resolve_device(distributed.device_for(dist, cfg.device))
    log(f"loading model {cfg.model.name_or_path!r} on {device}", dist)
    if dist.fsdp:
        log(f"FSDP: base weights sharded over {dist.world} processes" if dist.world > 1
            else "FSDP asked for in a single process: nothing to shard over; running unsharded",
            dist)
    return model_lib.load(cfg.model, device=device, eager=needs_second_order(cfg), seed=cfg.seed,
                          dist=dist)


def eval_sets(splits: Any) -> list[EvalSet]:
    """The in-domain test sets, then the out-of-domain ones."""
    return ([EvalSet(n, "id", ex) for n, ex in splits.test.items()]
            + [EvalSet(n, "ood", ex) for n, ex in splits.ood.items()])


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
    return Evaluation(ctx, eval_sets(splits), lm.inner_state())


def build_open_qa(cfg: Config, dist: distributed.Dist, splits: Any) -> Evaluation:
    """Load the model, the cloze collator, the methods' `Context` (every training and
    calibration question as an instruction example), the clustering backend and the judge."""
    from ..open_qa.judge import LLMJudge

    lm = load_model(cfg, dist)
    collator = Collator(lm.tokenizer, mode="cloze", prompt_style=cfg.data.prompt_style,
                        max_length=cfg.model.max_length, max_options=cfg.data.max_options)
    ctx = Context(cfg=cfg, lm=lm, collator=collator,
                  train_examples=[to_instruction(e) for e in splits.train],
                  calib_examples=[to_instruction(e) for e in splits.calib],
                  train_collator=collator, option_token_ids=None, dist=dist)
    judge = (LLMJudge.load(cfg.open_qa.judge_model, device=lm.device, dtype=cfg.model.dtype)
             if cfg.open_qa.match == "judge" else None)
    return Evaluation(ctx, eval_sets(splits), lm.inner_state(), backend=cluster_backend(cfg),
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
