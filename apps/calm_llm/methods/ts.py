"""`ts`: post-hoc temperature scaling of the untouched model's option scores.

T minimizes the NLL of softmax(option_logits / T) on the in-domain calibration split
(`calibration.posthoc.fit_temperature`); the same T is applied to every evaluation set, in-domain
and out-of-domain. ``at_boundary`` in the results says the fit ran to the edge of its search
range (no finite optimum: the NLL keeps falling as the distribution flattens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from calibration import posthoc

from . import spec
from .base import Method, present_columns


class TemperatureScaling(Method):
    info = spec.info("ts")

    def after_training(self, predict: Callable[[list], tuple[torch.Tensor, torch.Tensor]]) -> None:
        option_logits, labels = predict(self.ctx.calib_examples)
        fit = posthoc.fit_temperature(present_columns(option_logits), labels)
        self.temperature = float(fit.temperature)
        self.extras = {
            "temperature": self.temperature,
            "at_boundary": bool(fit.at_boundary),
            "nll_before": float(fit.nll_before),
            "nll_after": float(fit.nll_after),
        }

    def option_transform(self, option_logits: torch.Tensor) -> torch.Tensor:
        return option_logits / self.temperature

