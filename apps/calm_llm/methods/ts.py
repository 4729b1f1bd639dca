"""`ts`: post-hoc temperature scaling of the untouched model's option scores.

In open QA (``--task open_qa``) the runner's ``predict`` gives the calibration split's gold-answer
next-token logits (M, V) and their target tokens (M,) instead, so the same fit makes T minimize
the gold answers' token NLL, and T divides the next-token scores while sampling.

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

    def generation_processors(self) -> list:
        """Open QA: T was fitted to the gold answers' next-token distributions, so it divides
        the next-token scores while generating."""
        return [ScoreTemperature(self.temperature)]


class ScoreTemperature:
    """A transformers-style logits processor: ``scores / T`` (B, V). (transformers' own
    TemperatureLogitsWarper refuses nothing but is a sampling warper that greedy decoding
    drops; this one applies in every decoding mode.)"""

    def __init__(self, temperature: float) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature

