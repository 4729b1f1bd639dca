"""`rcft`: SFT plus the EM-style ECE regularizer of calibration-aware fine-tuning (its released code; docs/calm.md).

E-step: one pass over the training set gives each confidence bin's accuracy acc_k
(`calibration.objectives.estimate_bin_accuracy`). M-step per batch:
loss = (1 − w)·L_SFT + w·s·R, R = `calibration.objectives.ece_regularizer(probs, acc_k)`, s = 1e-3
as released (``--rcft-scale``)
(pulls p_max towards acc_k and the other options towards targets summing to 1 − acc_k).
Fixes to the released code, both options: ``--rcft-reestimate-every k`` re-runs the E-step
(the released code never does), ``--rcft-include-top-bin`` (it skips [0.9, 1]).
In cloze mode the option probabilities need every option's sequence, so training batches hold all
options and the SFT term keeps only the gold continuation's targets.
"""

from __future__ import annotations

import torch

from calibration import objectives

from ...errors import ConfigError
from .. import scoring
from . import spec
from .base import Context, Method, gold_only, present_columns


class RCFT(Method):
    info = spec.info("rcft")

    def __init__(self, ctx: Context, *, name: str | None = None) -> None:
        super().__init__(ctx, name=name)
        if ctx.instruction:
            raise ConfigError("rcft needs MCQA training data (its regularizer uses option probabilities)")
        self.theta_optimizer()
        self.streams = {"train": ctx.stream("train", options="all")}
        self.bin_accuracy: torch.Tensor | None = None

    def e_step(self) -> None:
        """acc_k of each confidence bin, from this method's predictions on the training set."""
        option_logits, labels = self.predict(self.ctx.train_examples)
        probs = torch.softmax(present_columns(option_logits), -1)
        self.bin_accuracy = objectives.estimate_bin_accuracy(
            probs, labels, n_bins=self.ctx.cfg.options_of("rcft").bins
        ).to(self.ctx.lm.device)

    def step(self, k: int) -> dict[str, float]:
        o = self.ctx.cfg.options_of("rcft")
        every = o.reestimate_every
        if self.bin_accuracy is None or (every and k % every == 0):
            self.e_step()
        params = self.ctx.lm.inner()

        def micro_step() -> dict[str, torch.Tensor]:
            logits, batch = self.ctx.forward(params, self.streams["train"].next())
            sft = scoring.lm_loss(logits, batch if self.ctx.letter else gold_only(batch))
            probs = torch.softmax(present_columns(self.ctx.option_logits(logits, batch)), -1)
            reg = objectives.ece_regularizer(
                probs, self.bin_accuracy, n_bins=o.bins, include_top_bin=o.include_top_bin
            )
            loss = (1 - o.weight) * sft + o.weight * o.scale * reg
            return {"objective": loss, "loss": loss, "sft_loss": sft}

        info = self.accumulate(micro_step)
        self.apply_step()
        return info

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.bin_accuracy is None else {"bin_accuracy": self.bin_accuracy}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.bin_accuracy = tensors.get("bin_accuracy")
