"""The table of CALM's upper-level losses (``--upper-loss``), each declaring what it acts on.

Torch-free (validation reads the table before anything heavy loads). An `UpperLoss` names up to
two functions, imported on first use:

* ``on_options(option_logits (N, K), labels (N,)) -> scalar``: the loss of the α-adjusted
  distribution over each question's answer options (``--upper-objective options``);
* ``on_answer_tokens(logits (B, L, V), batch) -> scalar``: the loss of the α-adjusted
  next-token distributions at the answer tokens (``--upper-objective answer_tokens``, cloze
  multiple choice; and every open-QA run, whose answers have no options).

What an entry leaves out it cannot act on: the configuration is refused (naming the loss and
what it acts on) instead of training on some other loss. A plugin module adds one with
``UPPER_LOSSES.register(UpperLoss(...))`` (docs/extending.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from calibration.registry import Registry

OBJECTIVES = ("options", "answer_tokens")  # the values of --upper-objective


@dataclass(frozen=True)
class UpperLoss:
    """One upper-level loss of CALM.

    Attributes:
        name: the ``--upper-loss`` value.
        on_options: ``"module:function"`` or a callable ``f(option_logits, labels)``, or None
            when the loss has no option-level form.
        on_answer_tokens: ``"module:function"`` or a callable ``f(logits, batch)``, or None.
        summary: one line for the docs.
        options: a dataclass of the loss's own options (``config.opt`` fields), or None:
            flags ``--<name>-<field>``, read as ``cfg.options_of(name)``.
    """

    name: str
    on_options: str | Callable[..., Any] | None = None
    on_answer_tokens: str | Callable[..., Any] | None = None
    summary: str = ""
    options: type | None = None

    @property
    def acts_on(self) -> tuple[str, ...]:
        """The ``--upper-objective`` values this loss can be computed on."""
        return tuple(o for o, f in zip(OBJECTIVES, (self.on_options, self.on_answer_tokens))
                     if f is not None)

    def function(self, objective: str) -> Callable[..., Any]:
        """The loss on ``objective`` ("options" or "answer_tokens"), imported on first use."""
        f = {"options": self.on_options, "answer_tokens": self.on_answer_tokens}[objective]
        if f is None:
            raise ValueError(f"upper loss {self.name!r} acts on {list(self.acts_on)} only, "
                             f"not on {objective!r}")
        if callable(f):
            return f
        module, _, attr = f.partition(":")
        return getattr(importlib.import_module(module), attr)


def _check(info: UpperLoss) -> None:
    if not isinstance(info, UpperLoss):
        raise TypeError(f"the upper-loss table takes an UpperLoss, got {type(info).__name__}")
    if not info.acts_on:
        raise ValueError(f"upper loss {info.name!r}: give on_options, on_answer_tokens or both")


UPPER_LOSSES: Registry[UpperLoss] = Registry("upper loss", check=_check)

_OBJ, _CALM = "calibration.objectives:", "apps.calm_llm.methods.calm:"
UPPER_LOSSES.register(UpperLoss(
    "entropy", _OBJ + "neg_entropy", _CALM + "neg_entropy_at_answer_tokens",
    "−mean entropy (the paper's): of the option distribution, or of the next-token "
    "distributions at every answer token"))
UPPER_LOSSES.register(UpperLoss(
    "nll", _OBJ + "label_nll", _CALM + "nll_at_answer_tokens",
    "calibration-set NLL: of the gold option, or of the gold answer's tokens"))
UPPER_LOSSES.register(UpperLoss(
    "soft_ece", _OBJ + "soft_binned_ece", None,
    "soft-binned ECE of the option distribution (Karandikar et al. 2021); options only"))
