"""`sft` (= CFT, calibration-aware fine-tuning's plain variant) and `label_smoothing`.

Both minimize the completion-only cross-entropy over the full vocabulary on the answer tokens
(letter mode: the answer letter; cloze mode: the gold option's text), with AdamW on the LoRA
tensors under the warmup + cosine schedule; `label_smoothing` smooths the targets by ε.
"""

from __future__ import annotations

import torch

from .. import scoring
from ..data import Batch
from . import spec
from .base import Context, Method


class SFT(Method):
    info = spec.info("sft")

    def __init__(self, ctx: Context, *, name: str | None = None) -> None:
        super().__init__(ctx, name=name)
        self.theta_optimizer()
        self.streams = {"train": ctx.stream("train")}

    def smoothing(self) -> float:
        return 0.0

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return scoring.lm_loss(logits, batch, label_smoothing=self.smoothing())

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()

        def micro_step() -> dict[str, torch.Tensor]:
            loss = self.loss(*self.ctx.forward(params, self.streams["train"].next()))
            return {"objective": loss, "loss": loss}

        info = self.accumulate(micro_step)
        self.apply_step()
        return info


class LabelSmoothing(SFT):
    info = spec.info("label_smoothing")

    def smoothing(self) -> float:
        return self.ctx.cfg.options_of("label_smoothing").epsilon

    def loss(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``vocab``: ε/V on every vocabulary entry. With V ≈ 50k that leaves the option-letter
        target almost one-hot (gold 1 − ε, other letters ε/V), so it barely smooths the answer
        distribution. ``options`` (letter batches): target q = (1 − ε)·δ_gold + ε·uniform over the
        question's n option letters, i.e. L = (1 − ε)·CE(gold) − (ε/n)·Σ_j log p(letter_j),
        p = softmax over the vocabulary at the answer position."""
        if self.ctx.cfg.options_of("label_smoothing").scope == "vocab":
            return super().loss(logits, batch)
        eps = self.smoothing()
        logp = torch.log_softmax(logits[:, -1, :].float(), -1)[:, self.ctx.option_token_ids]  # (N, K)
        present = torch.arange(logp.shape[1], device=logp.device)[None, :] < batch.n_options[:, None]
        spread = -(logp * present).sum(-1) / batch.n_options.to(logp.dtype)
        return (1 - eps) * scoring.lm_loss(logits, batch) + eps * spread.mean()
