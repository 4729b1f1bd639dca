"""The one table of calibration losses by name, without torch: what a calibration parameter
(α, a temperature) can be fitted to, and what each loss acts on.

`calibration.objectives` holds the loss functions (they need torch); this module holds the
table of them, `LOSSES` (a `calibration.registry.Registry` of `CalibrationLoss`), whose
functions are named ``"module:function"`` and imported on first use, so that a CLI can offer
and check the names before torch loads. Each entry names up to two forms of its loss:

* ``on_options(logits (N, K), labels (N,)) -> scalar``: of the distribution over each row's K
  classes (a question's answer options); calibration's built-ins all have it;
* ``on_answer_tokens(logits (B, L, V), batch) -> scalar``: of next-token distributions at the
  answer tokens of a sequence batch. The batch is an application's type, so calibration
  defines none: an application adds its form to an entry (`add_form`; apps.calm_llm adds
  entropy's and nll's) and reads the table as it is then.

What an entry leaves out it cannot act on: a caller refuses that objective by `acts_on`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from calibration.registry import Registry

__all__ = ["OBJECTIVES", "CalibrationLoss", "LOSSES", "add_form"]

OBJECTIVES: tuple[str, ...] = ("options", "answer_tokens")
"""What a loss may act on (apps.calm_llm: the values of ``--upper-objective``)."""


@dataclass(frozen=True)
class CalibrationLoss:
    """One calibration loss.

    Attributes:
        name: its name in `LOSSES` (apps.calm_llm: the ``--upper-loss`` value).
        on_options: ``"module:function"`` or a callable ``f(logits (N, K), labels (N,))``, or
            None when the loss has no class-level form.
        on_answer_tokens: ``"module:function"`` or a callable ``f(logits, batch)``, or None.
        summary: one line for the docs.
        options: a dataclass of the loss's own options, or None (apps.calm_llm: flags
            ``--<name>-<field>``, read as ``cfg.options_of(name)``).
    """

    name: str
    on_options: str | Callable[..., Any] | None = None
    on_answer_tokens: str | Callable[..., Any] | None = None
    summary: str = ""
    options: type | None = None

    @property
    def acts_on(self) -> tuple[str, ...]:
        """The `OBJECTIVES` this loss can be computed on."""
        return tuple(o for o, f in zip(OBJECTIVES, (self.on_options, self.on_answer_tokens))
                     if f is not None)

    def function(self, objective: str) -> Callable[..., Any]:
        """The loss on ``objective`` ("options" or "answer_tokens"), imported on first use."""
        f = {"options": self.on_options, "answer_tokens": self.on_answer_tokens}[objective]
        if f is None:
            raise ValueError(f"calibration loss {self.name!r} acts on {list(self.acts_on)} "
                             f"only, not on {objective!r}")
        if callable(f):
            return f
        module, _, attr = f.partition(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def fn(self) -> Callable[..., Any]:
        """The class-level form ``f(logits (N, K), labels (N,))`` (``function("options")``)."""
        return self.function("options")


def _check(info: CalibrationLoss) -> None:
    if not isinstance(info, CalibrationLoss):
        raise TypeError(f"the calibration-loss table takes a CalibrationLoss, got "
                        f"{type(info).__name__}")
    if not info.acts_on:
        raise ValueError(f"calibration loss {info.name!r}: give on_options, on_answer_tokens "
                         "or both")


LOSSES: Registry[CalibrationLoss] = Registry("calibration loss", check=_check)
"""The calibration losses by name (``entropy``, ``nll``, ``soft_ece``; a plugin may add more)."""

_OBJ = "calibration.objectives:"
LOSSES.register(CalibrationLoss(
    "entropy", _OBJ + "neg_entropy", None,
    "−mean entropy (label-free; optimum at the uniform distribution)"))
LOSSES.register(CalibrationLoss(
    "nll", _OBJ + "label_nll", None, "mean cross-entropy of the labels (optimum at calibration)"))
LOSSES.register(CalibrationLoss(
    "soft_ece", _OBJ + "soft_binned_ece", None,
    "soft-binned ECE, Karandikar et al. 2021 (optimum at calibration)"))


def add_form(name: str, *, on_answer_tokens: str | Callable[..., Any],
             summary: str | None = None) -> CalibrationLoss:
    """The entry ``name`` with its answer-token form set (and its summary, when given), put
    back in `LOSSES` in its place: how an application that defines answer tokens completes a
    loss of this table. Registering the same form again is a no-op."""
    info = LOSSES.get(name)
    new = dataclasses.replace(info, on_answer_tokens=on_answer_tokens,
                              summary=info.summary if summary is None else summary)
    return LOSSES.register(new, replace=True)
