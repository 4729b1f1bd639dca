"""`sft` (= CFT, calibration-aware fine-tuning's plain variant) and `label_smoothing`.

Both minimize the completion-only cross-entropy over the full vocabulary on the answer tokens
(letter mode: the answer letter; cloze mode: the gold option's text), with AdamW on the LoRA
tensors under the warmup + cosine schedule; `label_smoothing` smooths the targets by ε.
"""

from __future__ import annotations

from .. import scoring
from .base import Context, Method


class SFT(Method):
    name = "sft"
    trains = True

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.theta_optimizer()
        self.streams = {"train": ctx.stream("train")}

    def smoothing(self) -> float:
        return 0.0

    def step(self, k: int) -> dict[str, float]:
        params = self.ctx.lm.inner()
        accum = self.ctx.cfg.train.grad_accum
        total = 0.0
        for _ in range(accum):
            logits, batch = self.ctx.forward(params, self.streams["train"].next())
            loss = scoring.lm_loss(logits, batch, label_smoothing=self.smoothing())
            (loss / accum).backward()
            total += float(loss.detach()) / accum
        self.apply_step()
        return {"loss": total}


class LabelSmoothing(SFT):
    name = "label_smoothing"

    def smoothing(self) -> float:
        return self.ctx.cfg.train.label_smoothing
