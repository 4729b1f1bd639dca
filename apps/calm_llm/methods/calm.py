"""CALM: bilevel calibration of an LLM, and its ablations.

    min_α  f(α, θ*(α)) = − mean entropy of the α-adjusted answer distribution (calibration batch)
    s.t.   θ*(α) ∈ argmin_θ g(α, θ) = completion-only CE of the α-adjusted model (training batch)

θ = the LoRA tensors (inner variables), α = calibration.alpha parameters on the vocabulary
logits (outer variables). Solved by ``bilevel.BOME`` (first order) or, with ``--solver``,
``bilevel.ITD`` / ``bilevel.AID`` on the same `bilevel.Problem`. Each solver step returns a
direction for α and for θ; torch.optim optimizers (θ: AdamW, α: Adam by default, both with the
warmup + cosine schedule) apply them.

Ablations: ``calm_scalar`` (α = one temperature), ``calm_iterate`` (alternate an α step on f and
a θ step on g, no coupling term), ``calm_regularization`` (min over (α, θ) of g − γ·entropy).
"""

from __future__ import annotations

import math

import torch

import bilevel
from calibration import objectives

from .. import scoring
from .alpha_wiring import Alpha, make_alpha
from .base import Context, Method, finite_option_logits


class CalmObjectives:
    """The two objectives as plain functions ``(outer, inner, batch) -> scalar``."""

    def __init__(self, ctx: Context, alpha: Alpha) -> None:
        self.ctx, self.alpha = ctx, alpha

    def adjusted(self, outer: dict, inner: dict, batch):
        logits, batch = self.ctx.forward(inner, batch)
        return self.alpha.apply(self.ctx.dist.sync(outer), logits), batch

    def lower(self, outer: dict, inner: dict, batch) -> torch.Tensor:
        """g: completion-only CE of the α-adjusted model (mean over target tokens)."""
        z, batch = self.adjusted(outer, inner, batch)
        return scoring.lm_loss(z, batch)

    def upper(self, outer: dict, inner: dict, batch) -> torch.Tensor:
        """f: minus the mean entropy of the α-adjusted predictive distribution.

        ``upper_objective="options"``: entropy of the softmax over the N questions' option
        scores (letter: option-letter logits; cloze: option log-likelihoods);
        ``"answer_tokens"`` (cloze): entropy of the next-token distributions at every answer token.
        """
        z, batch = self.adjusted(outer, inner, batch)
        if self.ctx.cfg.calm.upper_objective == "answer_tokens":
            return -objectives.entropy(scoring.answer_logits(z, batch))
        return -objectives.entropy(finite_option_logits(self.ctx.option_logits(z, batch)))

    def problem(self) -> bilevel.Problem:
        return bilevel.Problem(upper=self.upper, lower=self.lower)


def make_solver(ctx: Context):
    """bilevel.BOME / ITD / AID from the config."""
    c = ctx.cfg.calm
    if c.solver == "bome":
        return bilevel.BOME(inner_steps=c.inner_steps, inner_lr=c.inner_lr, eta=c.eta, phi=c.phi, c=c.c)
    if ctx.dist.world > 1:
        raise ValueError(f"--solver {c.solver} (second order) is not supported across processes")
    if c.solver == "itd":
        return bilevel.ITD(inner_steps=c.inner_steps, inner_lr=c.inner_lr,
                           truncate=c.itd_truncate or None)
    return bilevel.AID(inner_steps=c.inner_steps, inner_lr=c.inner_lr,
                       linear_solver=bilevel.linalg.CG(maxiter=c.cg_maxiter, tol=c.cg_tol))


class Calm(Method):
    """The bilevel method (BOME over (α, LoRA) by default)."""

    name = "calm"
    trains = True
    alpha_param: str | None = None  # None = from the config; calm_scalar fixes "temperature"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        c = ctx.cfg.calm
        self.alpha = make_alpha(
            self.alpha_param or c.alpha_param, c.alpha_form, c.alpha_scope,
            vocab_size=ctx.lm.vocab_size, option_token_ids=ctx.option_token_ids,
            device=ctx.lm.device,
        )
        self.obj = CalmObjectives(ctx, self.alpha)
        self.theta_optimizer()
        self.alpha_optimizer(list(self.alpha.params.values()))
        self.streams = {"train": ctx.stream("train"), "calib": ctx.stream("calib")}
        self.setup()

    def setup(self) -> None:
        self.problem = self.obj.problem()
        self.solver = make_solver(self.ctx)

    def outer_params(self) -> dict[str, torch.Tensor]:
        return self.alpha.params

    def vocab_transform(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.ctx.cfg.calm.alpha_at_inference:
            return logits
        return self.alpha.apply(self.alpha.params, logits)

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()
        accum = self.ctx.cfg.train.grad_accum
        infos: list[dict[str, float]] = []
        for _ in range(accum):
            lower_batch = self.streams["train"].next()
            upper_batch = self.streams["calib"].next()
            # the solver works on its own copies; it only reads these values
            inner = {n: p.detach() for n, p in params.items()}
            outer = {n: a.detach() for n, a in self.alpha.params.items()}
            res = self.solver.step(self.problem, outer, inner,
                                   upper_batch=upper_batch, lower_batch=lower_batch)
            _accumulate(params, res.inner_grad, 1.0 / accum)
            _accumulate(self.alpha.params, res.outer_grad, 1.0 / accum)
            infos.append(res.info)
        info = {key: sum(i[key] for i in infos) / len(infos) for key in infos[0]}
        info["loss"] = info.get("lower_loss", info.get("lower", math.nan))
        self.apply_step()
        return info


class CalmScalar(Calm):
    """Ablation: α collapsed to one learned temperature."""

    name = "calm_scalar"
    alpha_param = "temperature"


class CalmIterate(Calm):
    """Ablation: alternate an α step on f (θ fixed) and a θ step on g (α fixed); no coupling."""

    name = "calm_iterate"

    def setup(self) -> None:
        pass

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()
        accum = self.ctx.cfg.train.grad_accum
        fs, gs = [], []
        for _ in range(accum):  # α step on the upper objective
            f = self.obj.upper(self.alpha.params, {n: p.detach() for n, p in params.items()},
                               self.streams["calib"].next())
            (f / accum).backward()
            fs.append(float(f.detach()))
        self.optimizers["alpha"].step()
        self.optimizers["alpha"].zero_grad(set_to_none=True)
        outer = {n: a.detach() for n, a in self.alpha.params.items()}
        for _ in range(accum):  # θ step on the lower objective at the new α
            g = self.obj.lower(outer, params, self.streams["train"].next())
            (g / accum).backward()
            gs.append(float(g.detach()))
        self.apply_step()
        return {"loss": sum(gs) / accum, "lower_loss": sum(gs) / accum, "upper_loss": sum(fs) / accum}


class CalmRegularization(Calm):
    """Ablation: min over (α, θ) of g(α, θ) − γ·entropy = g + γ·f jointly, no bilevel constraint."""

    name = "calm_regularization"

    def setup(self) -> None:
        pass

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()
        accum = self.ctx.cfg.train.grad_accum
        gamma = self.ctx.cfg.calm.gamma
        fs, gs = [], []
        for _ in range(accum):
            g = self.obj.lower(self.alpha.params, params, self.streams["train"].next())
            f = self.obj.upper(self.alpha.params, params, self.streams["calib"].next())
            ((g + gamma * f) / accum).backward()
            gs.append(float(g.detach()))
            fs.append(float(f.detach()))
        self.apply_step()
        g_mean, f_mean = sum(gs) / accum, sum(fs) / accum
        return {"loss": g_mean + gamma * f_mean, "lower_loss": g_mean, "upper_loss": f_mean}


@torch.no_grad()
def _accumulate(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], scale: float) -> None:
    for n, p in params.items():
        g = grads[n].to(p.dtype) * scale
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.add_(g)
