"""CALM: bilevel calibration of an LLM, and its ablations.

    min_α  f(α, θ*(α)) = − mean entropy of the α-adjusted answer distribution (calibration batch)
    s.t.   θ*(α) ∈ argmin_θ g(α, θ) = completion-only CE of the α-adjusted model (training batch)

(the paper's problem, as reconstructed; ``--upper-loss nll|soft_ece``, ``--alpha-acts`` and
``--alpha-decay`` are this project's extensions, see docs/calm.md.)

θ = the LoRA tensors (inner variables), α = calibration.alpha parameters on the vocabulary
logits (outer variables). Solved by ``bilevel.BOME`` (first order) or, with ``--solver``,
``bilevel.ITD`` / ``bilevel.AID`` on the same `bilevel.Problem`. Each solver step returns a
direction for α and for θ; torch.optim optimizers (θ: AdamW, α: Adam by default, both with the
warmup + cosine schedule) apply them.

Ablations: ``calm_scalar`` (α = one temperature), ``calm_iterate`` (alternate an α step on f and
a θ step on g, no coupling term), ``calm_regularization`` (min over (α, θ) of g − γ·entropy).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

import bilevel
from calibration import objectives

from ...errors import ConfigError
from .. import scoring, solvers
from . import spec
from .alpha_wiring import Alpha, answer_token_ids, make_alpha
from .base import Context, Method, finite_option_logits, gold_only, lr_lambda
from .upper import UPPER_LOSSES


class CalmObjectives:
    """The two objectives as plain functions ``(outer, inner, batch) -> scalar``.

    Where α acts is ``--alpha-acts`` (see `alpha_wiring`); the upper loss is the
    ``--upper-loss`` entry of `upper.UPPER_LOSSES` on ``--upper-objective`` plus the prior
    δ·½‖α − identity‖² (``--alpha-decay``). ``last`` holds the calibration batch's mean
    entropy and confidence of the α-adjusted option distribution at the last upper call.
    """

    def __init__(self, ctx: Context, alpha: Alpha) -> None:
        self.ctx, self.alpha = ctx, alpha
        c = ctx.cfg.calm
        self.vocab_alpha_lower = c.alpha_acts == "lower_and_inference"
        self.vocab_alpha_upper = alpha.on == "vocab"
        # validation has checked that the loss acts on what this run reads (`UpperLoss.acts_on`)
        loss = UPPER_LOSSES.get(c.upper_loss)
        self.on_options = loss.function("options") if "options" in loss.acts_on else None
        self.on_answer_tokens = (loss.function("answer_tokens")
                                 if "answer_tokens" in loss.acts_on else None)
        self.last: dict[str, float] = {}

    def lower(self, outer: dict, inner: dict, batch) -> torch.Tensor:
        """g: completion-only CE (mean over target tokens), of the α-adjusted model when α
        acts in the lower level."""
        logits, batch = self.ctx.forward(inner, batch)
        if self.vocab_alpha_lower:
            logits = self.alpha.apply(self.ctx.dist.sync(outer), logits)
        return scoring.lm_loss(logits, batch)

    def upper(self, outer: dict, inner: dict, batch) -> torch.Tensor:
        """f: the upper loss of the α-adjusted predictive distribution on a calibration batch.

        ``upper_objective="options"``: of the softmax over the N questions' option scores
        (letter: option-letter logits; cloze: option log-likelihoods);
        ``"answer_tokens"`` (cloze): of the next-token distributions at every answer token
        (entropy) or at the gold answer's tokens (nll).
        """
        c = self.ctx.cfg.calm
        outer_s = self.ctx.dist.sync(outer)
        logits, batch = self.ctx.forward(inner, batch)
        z = self.alpha.apply(outer_s, logits) if self.vocab_alpha_upper else logits
        if batch.mode == "instruction":  # open QA: free-form gold answers, no options
            return self._answer_token_upper(outer, z, batch)
        if c.upper_objective == "answer_tokens":
            f = self.on_answer_tokens(z, batch)
            ol = self.ctx.option_logits(z.detach(), batch)
        else:
            ol = self.ctx.option_logits(z, batch)
            if not self.vocab_alpha_upper:
                # finite before α: an absent option slot's -inf scaled by 1/τ has a gradient
                # -inf/τ² in τ, which the mask after it turns into NaN (0·inf), not into 0
                ol = self.alpha.apply(outer_s, finite_option_logits(ol))
            f = self.on_options(finite_option_logits(ol), batch.labels)
            ol = ol.detach()
        if c.alpha_decay > 0:
            f = f + c.alpha_decay * self.alpha.param.deviation(outer)
        with torch.no_grad():
            p = torch.softmax(finite_option_logits(ol.float()), dim=-1)
            self.last = {
                "calib_entropy": -(p * p.clamp_min(1e-30).log()).sum(-1).mean(),
                "calib_confidence": p.max(-1).values.mean(),
                "calib_accuracy": (p.argmax(-1) == batch.labels).float().mean(),
            }
        return f

    def _answer_token_upper(self, outer: dict, z: torch.Tensor, batch) -> torch.Tensor:
        """Open QA's f: the mean entropy (negated) of the α-adjusted next-token distributions
        at the gold answers' token positions, or (``--upper-loss nll``) their CE: the loss's
        ``on_answer_tokens``; ``last`` records the token-level entropy and confidence (max
        probability)."""
        c = self.ctx.cfg.calm
        f = self.on_answer_tokens(z, batch)
        za = scoring.answer_logits(z, batch)
        if c.alpha_decay > 0:
            f = f + c.alpha_decay * self.alpha.param.deviation(outer)
        with torch.no_grad():
            p = torch.softmax(za.detach().float(), dim=-1)
            self.last = {"calib_entropy": -(p * p.clamp_min(1e-30).log()).sum(-1).mean(),
                         "calib_confidence": p.max(-1).values.mean()}
        return f

    def problem(self) -> bilevel.Problem:
        return bilevel.Problem(upper=self.upper, lower=self.lower)


# the built-in upper losses on the answer tokens (`upper.UPPER_LOSSES`): ``f(logits, batch)``
def neg_entropy_at_answer_tokens(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """−mean entropy of the next-token distributions at every answer token (every option's,
    in cloze multiple choice; the gold answer's, in open QA)."""
    return -objectives.entropy(scoring.answer_logits(logits, batch))


def nll_at_answer_tokens(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """Mean CE of the gold answer's tokens (an instruction batch holds only gold answers)."""
    return scoring.lm_loss(logits, batch if batch.mode == "instruction" else gold_only(batch))


def make_solver(ctx: Context):
    """The bilevel solver of ``--solver`` (the `apps.calm_llm.solvers` table), from the config."""
    c = ctx.cfg.calm
    if solvers.is_second_order(c.solver) and ctx.dist.world > 1:
        raise ConfigError(f"--solver {c.solver} (second order) is not supported across processes")
    return solvers.build_solver(ctx.cfg)


# the built-in entries of the solver tables: ``factory(cfg)``, reading their own options
# (``cfg.options_of(name)``) as a plugin's factory does; each linear solver returns the
# ``solve(matvec, b, init=None) -> (x, info)`` callable of `LinearSolverInfo`'s contract
def bome_solver(cfg: Any) -> bilevel.BOME:
    c, o = cfg.calm, cfg.options_of("bome")
    return bilevel.BOME(inner_steps=c.inner_steps, inner_lr=c.inner_lr, eta=o.eta, phi=o.phi, c=o.c)


def itd_solver(cfg: Any) -> bilevel.ITD:
    c, o = cfg.calm, cfg.options_of("itd")
    return bilevel.ITD(inner_steps=c.inner_steps, inner_lr=c.inner_lr, truncate=o.truncate or None)


def aid_solver(cfg: Any) -> bilevel.AID:
    c = cfg.calm
    return bilevel.AID(inner_steps=c.inner_steps, inner_lr=c.inner_lr,
                       linear_solver=solvers.build_linear_solver(cfg))


def cg_linear_solver(cfg: Any) -> bilevel.linalg.LinearSolve:
    o = cfg.options_of("cg")
    return bilevel.linalg.solve_cg(maxiter=o.maxiter, tol=o.tol)


def neumann_linear_solver(cfg: Any) -> bilevel.linalg.LinearSolve:
    o = cfg.options_of("neumann")
    return bilevel.linalg.solve_neumann(steps=o.terms, lr=cfg.calm.inner_lr, tol=o.tol)


def dense_linear_solver(cfg: Any) -> bilevel.linalg.LinearSolve:
    return bilevel.linalg.solve_dense()


class Calm(Method):
    """The bilevel method (BOME over (α, LoRA) by default)."""

    info = spec.info("calm")
    alpha_param: str | None = None  # None = from the config; calm_scalar fixes "temperature"

    def __init__(self, ctx: Context, *, name: str | None = None) -> None:
        super().__init__(ctx, name=name)
        c = ctx.cfg.calm
        support_ids = None
        if c.alpha_support == "answer_tokens" and c.alpha_acts != "options":
            support_ids = self._answer_tokens()
        param = self.alpha_param or c.alpha_param
        own = ctx.cfg.plugin_options.get(param)  # a plugin α's own options (--<name>-<option>)
        self.alpha = make_alpha(
            param, c.alpha_form, c.alpha_support,
            vocab_size=ctx.lm.vocab_size, option_token_ids=ctx.option_token_ids,
            device=ctx.lm.device, positivity=c.alpha_positivity, tau_max=c.alpha_tau_max,
            acts=c.alpha_acts, answer_token_ids=support_ids,
            n_option_slots=ctx.cfg.data.max_options,
            extra_options=dataclasses.asdict(own) if own is not None else None,
        )
        self.obj = CalmObjectives(ctx, self.alpha)
        if c.bome_optimizer == "sgd":
            self.joint_optimizer()
        else:
            self.theta_optimizer()
            self.alpha_optimizer(list(self.alpha.params.values()))
        self.streams = {"train": ctx.stream("train"), "calib": ctx.stream("calib")}
        self.setup()

    def _answer_tokens(self) -> torch.Tensor:
        """The support of α: tokens at the answer positions the two levels read (training
        targets as trained, every calibration option; letter mode adds every option letter)."""
        ctx = self.ctx
        train_opts = "gold" if (not ctx.letter or ctx.instruction) else "all"
        ids = [answer_token_ids(ctx.train_examples, ctx.train_collator, options=train_opts),
               answer_token_ids(ctx.calib_examples, ctx.collator, options="all")]
        if ctx.option_token_ids is not None:
            ids.append(ctx.option_token_ids.cpu())
        return torch.cat(ids).unique()

    def joint_optimizer(self) -> torch.optim.Optimizer:
        """``--bome-optimizer sgd``: u ← u − ξ_k · direction for u = (θ, α), ξ_k = --bome-lr
        times the warmup + decay schedule; no momentum, no clipping (BOME's analysis)."""
        params = [*self.ctx.lm.inner().values(), *self.alpha.params.values()]
        opt = torch.optim.SGD(params, lr=self.ctx.cfg.calm.bome_lr)
        self.optimizers["joint"] = opt
        self.schedulers["joint"] = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(self.ctx.cfg))
        return opt

    def setup(self) -> None:
        self.problem = self.obj.problem()
        self.solver = make_solver(self.ctx)

    def outer_params(self) -> dict[str, torch.Tensor]:
        return self.alpha.params

    _no_alpha = False

    @property
    def alpha_in_use(self) -> bool:
        """Whether predictions apply α (off by --no-alpha-at-inference or `without_alpha`)."""
        return self.ctx.cfg.calm.alpha_at_inference and not self._no_alpha

    @contextlib.contextmanager
    def without_alpha(self) -> Iterator[None]:
        """Predictions inside the block leave α out (what θ alone contributes)."""
        self._no_alpha = True
        try:
            yield
        finally:
            self._no_alpha = False

    def vocab_transform(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.alpha_in_use or self.alpha.on != "vocab":
            return logits
        return self.alpha.apply(self.alpha.params, logits)

    def generation_processors(self) -> list:
        """α on the next-token scores while generating: the exported `AlphaLogitsProcessor`."""
        if not self.alpha_in_use or self.alpha.on != "vocab":
            return []
        from ..export import AlphaLogitsProcessor

        params = {n: p.detach() for n, p in self.alpha.params.items()}
        return [AlphaLogitsProcessor(self.alpha.param, params, self.alpha.class_ids,
                                     vocab_size=self.ctx.lm.vocab_size)]

    def option_transform(self, option_logits: torch.Tensor) -> torch.Tensor:
        if not self.alpha_in_use or self.alpha.on != "options":
            return option_logits
        with torch.no_grad():
            params = {n: p.to(option_logits.device) for n, p in self.alpha.params.items()}
            return self.alpha.apply(params, option_logits)

    def apply_step(self) -> None:
        self.note_gradients()  # before the clamp (a clamped inf would look finite)
        clip = self.ctx.cfg.calm.alpha_grad_clip
        if clip > 0:  # per entry: no single vocabulary entry can take a step larger than lr·c
            for a in self.alpha.params.values():
                if a.grad is not None:
                    a.grad.clamp_(-clip, clip)
        if "joint" in self.optimizers:  # SGD on the joint direction exactly: no θ clipping
            for name, opt in self.optimizers.items():
                opt.step()
                opt.zero_grad(set_to_none=True)
                self.schedulers[name].step()
            return
        super().apply_step()

    def record(self, info: dict[str, float]) -> dict[str, float]:
        """The step's diagnostics plus α's statistics and the calibration batch's entropy,
        confidence and accuracy (all after the step: what the next step starts from)."""
        info = dict(info)
        info.update({k: float(v) for k, v in self.obj.last.items()})
        info.update(self.alpha.stats())
        return info

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()
        accum = self.ctx.cfg.train.grad_accum

        def micro_step() -> dict[str, Any]:
            lower_batch = self.streams["train"].next()
            upper_batch = self.streams["calib"].next()
            # the solver works on its own copies; it only reads these values
            inner = {n: p.detach() for n, p in params.items()}
            outer = {n: a.detach() for n, a in self.alpha.params.items()}
            # the ranks' gradients are averaged inside the objectives (distributed.Dist.sync),
            # so bilevel's own data parallelism stays off: it would average equal values again
            with bilevel.distributed.data_parallel(False):
                res = self.solver.step(self.problem, outer, inner,
                                       upper_batch=upper_batch, lower_batch=lower_batch)
            # the contract the app reads, checked on every step (dict look-ups): a solver
            # without info["lower_loss"] is named here, not as a "non-finite loss" later
            solvers.check_step(self.ctx.cfg.calm.solver, res, outer, inner)
            # the solver's directions, not a loss, are what θ and α follow
            _accumulate(params, res.inner_grad, 1.0 / accum)
            _accumulate(self.alpha.params, res.outer_grad, 1.0 / accum)
            return res.info

        info = self.accumulate(micro_step)
        info["loss"] = info["lower_loss"]  # `solvers.REQUIRED_INFO`: every step reported it
        self.apply_step()
        return self.record(info)


class CalmScalar(Calm):
    """Ablation: α collapsed to one learned temperature."""

    info = spec.info("calm_scalar")
    alpha_param = "temperature"


class CalmIterate(Calm):
    """Ablation: alternate an α step on f (θ fixed) and a θ step on g (α fixed); no coupling."""

    info = spec.info("calm_iterate")

    def setup(self) -> None:
        pass

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()

        def alpha_micro_step() -> dict[str, torch.Tensor]:  # α on the upper objective, θ fixed
            f = self.obj.upper(self.alpha.params, {n: p.detach() for n, p in params.items()},
                               self.streams["calib"].next())
            return {"objective": f, "upper_loss": f}

        upper = self.accumulate(alpha_micro_step)
        self.note_gradients()
        self.optimizers["alpha"].step()
        self.optimizers["alpha"].zero_grad(set_to_none=True)
        outer = {n: a.detach() for n, a in self.alpha.params.items()}

        def theta_micro_step() -> dict[str, torch.Tensor]:  # θ on the lower objective at the new α
            g = self.obj.lower(outer, params, self.streams["train"].next())
            return {"objective": g, "lower_loss": g}

        lower = self.accumulate(theta_micro_step)
        self.apply_step()
        return self.record({"loss": lower["lower_loss"], **lower, **upper})


class CalmRegularization(Calm):
    """Ablation: min over (α, θ) of g(α, θ) − γ·entropy = g + γ·f jointly, no bilevel constraint."""

    info = spec.info("calm_regularization")

    def setup(self) -> None:
        pass

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()
        gamma = self.ctx.cfg.calm.gamma

        def micro_step() -> dict[str, torch.Tensor]:
            g = self.obj.lower(self.alpha.params, params, self.streams["train"].next())
            f = self.obj.upper(self.alpha.params, params, self.streams["calib"].next())
            return {"objective": g + gamma * f, "lower_loss": g, "upper_loss": f}

        info = self.accumulate(micro_step)
        self.apply_step()
        return self.record({"loss": info["lower_loss"] + gamma * info["upper_loss"], **info})


@torch.no_grad()
def _accumulate(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], scale: float) -> None:
    for n, p in params.items():
        g = grads[n].to(p.dtype) * scale
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)
