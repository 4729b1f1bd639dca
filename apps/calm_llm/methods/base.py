"""What every method shares: the run context, batch streams, optimizers, schedules, α wiring.

A method turns (model, data, config) into a trained state plus a predictor. Its predictor is
two transforms applied to what the model outputs: ``vocab_transform`` on the vocabulary logits
(α for CALM) and ``option_transform`` on the (N, K) option logits (temperature scaling).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from .. import scoring
from ..data import Batch, Collator, batch_iterator
from ..distributed import Dist
from ..model import CausalLM
from ..predict import predict_option_logits
from .spec import MethodInfo

if TYPE_CHECKING:  # the type only: methods import nothing from config (config reads methods)
    from ..config import Config


class Stream:
    """An endless, seeded stream of training batches that knows its position (for resume).

    ``position`` counts batches handed out; rebuilding the stream at a position continues
    exactly where a killed run stopped (``batch_iterator(start=...)`` skips in O(1)).
    """

    def __init__(
        self,
        examples: list,
        collator: Any,
        batch_size: int,
        *,
        seed: int,
        device: torch.device,
        options: str = "all",
        position: int = 0,
    ) -> None:
        self.examples, self.collator, self.batch_size = examples, collator, batch_size
        self.seed, self.device, self.options = seed, device, options
        self.seek(position)

    def seek(self, position: int) -> None:
        self.position = position
        self._it: Iterator[Batch] = batch_iterator(
            self.examples, self.collator, self.batch_size, shuffle=True, seed=self.seed,
            options=self.options, start=position,
        )

    def next(self) -> Batch:
        self.position += 1
        return next(self._it).to(self.device)


@dataclass
class Context:
    """Everything a method needs; built once per run by the runner.

    Attributes:
        cfg: the validated configuration.
        lm: the LoRA-wrapped model (adapters reset to their initial values per method).
        collator: MCQA collator in the configured mode.
        train_examples: training split (MCQA, or instruction examples).
        calib_examples: in-domain calibration split.
        train_collator: collator for the training examples (instruction data has its own mode).
        option_token_ids: (K,) option-letter ids (letter mode) or None.
        dist: process-group helper (world size 1 without accelerate/torchrun).
        predictor: ``predictor(ctx, method, examples) -> (option_logits, labels)``, what
            ``Method.predict`` calls (the runner passes the one it evaluates with).
    """

    cfg: Config
    lm: CausalLM
    collator: Collator
    train_examples: list
    calib_examples: list
    train_collator: Any
    option_token_ids: torch.Tensor | None
    dist: Dist = field(default_factory=Dist)
    predictor: Callable[..., tuple[torch.Tensor, torch.Tensor]] = predict_option_logits

    @property
    def letter(self) -> bool:
        return self.cfg.data.mode == "letter"

    @property
    def instruction(self) -> bool:
        return bool(self.cfg.data.instruction_data)

    @property
    def train_layout(self) -> str:
        """How training batches are laid out: ``--train-layout``, except that "packed" falls
        back to "padded" where the model cannot run the block mask (`CausalLM.prefix_layout`
        is "cache": an attention kernel without custom masks, a sliding window, FSDP)."""
        want = self.cfg.train.train_layout
        if want == "packed" and self.lm.prefix_layout != "packed":
            return "padded"
        return want

    def stream(self, kind: str, *, options: str | None = None, seed_offset: int = 0) -> Stream:
        """A training ('train') or calibration ('calib') batch stream, sharded over ranks."""
        t = self.cfg.train
        examples = self.train_examples if kind == "train" else self.calib_examples
        collator = self.train_collator if kind == "train" else self.collator
        if (self.cfg.model.gradient_checkpointing and getattr(collator, "share_prefix", False)
                and getattr(collator, "prefix_layout", "") == "cache"):
            # checkpointed layers drop the KV cache a cache-layout prefix lives in: train unshared
            # (the packed layout is one forward and checkpoints like any other)
            collator = copy.copy(collator)
            collator.share_prefix = False
        if kind == "train" and self.train_layout == "packed":
            collator = copy.copy(collator)  # the evaluation collator may be the same object
            collator.pack_sequences = True
        per_rank = t.batch_size if kind == "train" else t.calib_questions
        if options is None:
            # cloze training needs only the gold continuation (the CE falls on it alone)
            options = "gold" if (kind == "train" and not self.letter) else "all"
        return Stream(
            examples,
            self.dist.shard_collator(collator, per_rank),
            per_rank * self.dist.world,
            seed=self.cfg.seed + seed_offset + (0 if kind == "train" else 7919),
            device=self.lm.device,
            options=options,
        )

    def forward(self, inner: dict | None, batch: Batch) -> tuple[torch.Tensor, Batch]:
        """Vocabulary logits and the batch they line up with.

        Letter batches only need the answer column (``logits_to_keep=1``); other batches keep
        the columns from the first target on (`target_columns`), so the V-wide logits are
        never materialized over prompt tokens; a packed shared-prefix batch gives (M, V) at its
        target positions, and the batch returned records them (``logit_rows``), so that a later
        change of its targets (`gold_only`) cannot misalign them. ``inner`` is synced over ranks.
        """
        if inner is not None:
            inner = self.dist.sync(inner)
        if batch.mode == "letter":
            return self.lm.logits(inner, batch, last_only=True), batch
        if batch.packed is not None:
            batch = replace(batch, logit_rows=batch.logit_positions)
        return self.lm.logits(inner, batch, keep=target_columns(batch)), batch

    def option_logits(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """(N, K) option scores of (already adjusted) vocabulary logits; -inf for absent options."""
        return scoring.option_logits(
            logits, batch, cloze_norm=self.cfg.data.cloze_norm,
            option_token_ids=self.option_token_ids,
        )


def target_columns(batch: Batch) -> int:
    """k = L − (first column holding a target): the logits columns scoring needs.

    `scoring` lines logits (S, k, V) up with the last k columns of ``target_ids``.
    """
    has = (batch.target_ids != -100).any(0)
    L = int(batch.target_ids.shape[1])
    return L - int(has.nonzero()[0]) if bool(has.any()) else 1


def finite_option_logits(ol: torch.Tensor) -> torch.Tensor:
    """Absent options (-inf) -> a very negative finite score, so entropies and their gradients
    stay finite (p = 0 exactly, and 0 · log p has no NaN)."""
    return ol.masked_fill(~torch.isfinite(ol), -1e4)


def present_columns(option_logits: torch.Tensor) -> torch.Tensor:
    """Drop option slots absent (-inf) from every question; any other absent slot gets a score
    far below the rest (probability ~0 under any temperature a fit may reach)."""
    ol = option_logits[:, torch.isfinite(option_logits).any(0)]
    if bool(torch.isfinite(ol).all()):
        return ol
    return finite_option_logits(ol)


def gold_only(batch: Batch) -> Batch:
    """A cloze 'all options' batch whose targets keep only each question's gold continuation."""
    gold = batch.seq_option == batch.labels[batch.seq_question]
    # (M, V) logits of a packed batch stay at the positions of the targets they were taken at
    return replace(batch, target_ids=batch.target_ids.masked_fill(~gold[:, None], -100),
                   logit_rows=batch.logit_positions)


def all_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor: whether every entry of every tensor is finite. One small reduction
    per tensor and no host sync (the caller reads the flag once per step, with the others);
    True for no tensors."""
    flags = [torch.isfinite(t.detach()).all() for t in tensors]
    if not flags:
        return torch.ones((), dtype=torch.bool)
    device = flags[0].device  # α may sit on another device than the LoRA tensors
    return torch.stack([f.to(device) for f in flags]).all()


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup for ``warmup_ratio · steps`` steps, then cosine / linear decay / constant."""
    steps = cfg.train.steps
    warm = int(round(cfg.train.warmup_ratio * steps))
    kind = cfg.train.schedule

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / (warm + 1)
        if kind == "constant":
            return 1.0
        frac = (step - warm) / max(1, steps - warm)
        if kind == "linear":
            return max(0.0, 1.0 - frac)
        return 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))

    return f


def make_optimizer(kind: str, params: list[torch.Tensor], lr: float, weight_decay: float = 0.0):
    """torch.optim optimizer by name (adamw / adam / sgd)."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {kind!r} (adamw, adam, sgd)")


class Method:
    """Base class: an untrained predictor (the model as given). Subclasses override what they change.

    Life cycle (driven by ``apps.calm_llm.train``): ``__init__(ctx, name=row)`` → ``step(k)``
    for k in [start, steps) (only when ``trains``) → ``after_training(self.predict)`` →
    predictions through ``vocab_transform`` and ``option_transform``. ``tensors()``/``meta()``
    and ``load(...)`` hold everything but the LoRA weights for checkpoints (the runner saves
    those). A subclass sets ``info`` (its `spec.MethodInfo`); ``name`` and ``trains`` follow.
    """

    info: MethodInfo | None = None
    name = "none"
    trains = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "info" in cls.__dict__ and cls.info is not None:  # the table is the one source
            cls.name, cls.trains = cls.info.name, cls.info.trains

    def __init__(self, ctx: Context, *, name: str | None = None) -> None:
        """``name``: the results row (``calm@eta=0.1`` for a --select variant; default the
        method's name): it names the checkpoints, history and export folders."""
        self.ctx = ctx
        if name is not None:
            self.name = name
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, torch.optim.lr_scheduler.LambdaLR] = {}
        self.streams: dict[str, Stream] = {}
        self.extras: dict[str, Any] = {}
        # whether the gradients of the last optimizer step were finite (`note_gradients`)
        self.grads_finite: torch.Tensor = torch.ones((), dtype=torch.bool)

    # -- training ---------------------------------------------------------------------------
    def step(self, k: int) -> dict[str, float]:
        raise NotImplementedError(f"{self.name} does not train")

    def accumulate(self, micro_step: Callable[[], dict[str, Any]]) -> dict[str, float]:
        """Run ``micro_step()`` once per micro-batch (``--grad-accum`` times) and return the mean
        of what it reports.

        ``micro_step`` returns a dict of scalars; its ``"objective"`` entry (a tensor), when
        present, is back-propagated scaled by 1/grad_accum (the gradients add up to the mean
        over micro-batches) and left out of the report. Other entries (tensors or floats) are
        averaged over the micro-batches.
        """
        accum = self.ctx.cfg.train.grad_accum
        reports: list[dict[str, float]] = []
        for _ in range(accum):
            out = dict(micro_step())
            objective = out.pop("objective", None)
            if objective is not None:
                (objective / accum).backward()
            reports.append({k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
                            for k, v in out.items()})
        return {k: sum(r[k] for r in reports) / accum for k in reports[0]}

    def after_training(self, predict: Callable[[list], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hook after the last step; ``predict(examples) -> (option_logits, labels)``."""

    def predict(self, examples: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, K) option logits of `examples` under this method's vocabulary transform, and the
        (N,) labels (what the runner evaluates; RCFT's E-step reads it on the training set)."""
        return self.ctx.predictor(self.ctx, self, examples)

    # -- prediction -------------------------------------------------------------------------
    def vocab_transform(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def generation_processors(self) -> list:
        """transformers ``LogitsProcessor``s that make ``generate`` sample from this method's
        model (open QA): applied to the raw next-token scores (B, V) before the sampling
        temperature and top-p. None for a method that changes only the weights."""
        return []

    def option_transform(self, option_logits: torch.Tensor) -> torch.Tensor:
        return option_logits

    # -- state ------------------------------------------------------------------------------
    def outer_params(self) -> dict[str, torch.Tensor]:
        """α (or other non-LoRA trained tensors); saved in checkpoints and exports."""
        return {}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Extra method state for checkpoints (e.g. RCFT's bin accuracies)."""
        return {}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `tensors`."""

    def theta_optimizer(self) -> torch.optim.Optimizer:
        """AdamW (default) over the LoRA tensors with the warmup+cosine schedule."""
        t = self.ctx.cfg.train
        opt = make_optimizer(t.optimizer, list(self.ctx.lm.inner().values()), t.lr, t.weight_decay)
        self.optimizers["theta"] = opt
        self.schedulers["theta"] = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.ctx.cfg))
        return opt

    def alpha_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        c = self.ctx.cfg.calm
        opt = make_optimizer(c.alpha_optimizer, params, c.alpha_lr)
        self.optimizers["alpha"] = opt
        self.schedulers["alpha"] = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.ctx.cfg))
        return opt

    def note_gradients(self) -> None:
        """Record (as a device flag, no sync) whether every gradient the optimizers are about
        to apply is finite. Called before any clipping (a clamped inf looks finite) and before
        each optimizer step of a step; the flags of one step accumulate (AND) until the runner
        reads and resets them after the step (`runner.train.check_finite`), since the step
        itself zeroes the gradients."""
        self.grads_finite = self.grads_finite & all_finite(
            p.grad for opt in self.optimizers.values() for group in opt.param_groups
            for p in group["params"] if p.grad is not None)

    def apply_step(self) -> None:
        """Clip θ's gradient, step every optimizer and scheduler, zero the gradients."""
        self.note_gradients()
        clip = self.ctx.cfg.train.max_grad_norm
        if clip > 0 and "theta" in self.optimizers:
            torch.nn.utils.clip_grad_norm_(list(self.ctx.lm.inner().values()), clip)
        for name, opt in self.optimizers.items():
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.schedulers[name].step()
