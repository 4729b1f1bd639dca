"""The table of CALM's upper-level losses (``--upper-loss``), each declaring what it acts on.

Torch-free (validation reads the table before anything heavy loads). An `UpperLoss` names up to
two functions, imported on first use:

* ``on_options(option_logits (N, K), labels (N,)) -> scalar``: the loss of the α-adjusted
  distribution over each question's answer options (``--upper-objective options``);
* ``on_answer_tokens(logits (B, L, V), batch) -> scalar``: the loss of the α-adjusted
  next-token distributions at the answer tokens (``--upper-objective answer_tokens``, cloze
  multiple choice; and every open-QA run, whose answers have no options).

The table is `calibration.loss_table.LOSSES` (``UPPER_LOSSES`` here, ``UpperLoss`` its
`calibration.loss_table.CalibrationLoss`): this module adds the answer-token forms of the
app's batches to its entropy and nll. What an entry leaves out it cannot act on: the configuration is refused (naming the loss and
what it acts on) instead of training on some other loss. A plugin module adds one with
``UPPER_LOSSES.register(UpperLoss(...))`` (docs/extending.md).
"""

from __future__ import annotations

from calibration.loss_table import LOSSES, OBJECTIVES, CalibrationLoss, add_form
from calibration.registry import Registry

__all__ = ["OBJECTIVES", "UPPER_LOSSES", "UpperLoss"]

# one table: calibration's (the names entropy, nll, soft_ece and their option-level forms);
# this app adds the answer-token forms of its batches. The old names stay for plugins.
UpperLoss = CalibrationLoss
UPPER_LOSSES: Registry[CalibrationLoss] = LOSSES

_CALM = "apps.calm_llm.methods.calm:"
add_form("entropy", on_answer_tokens=_CALM + "neg_entropy_at_answer_tokens",
         summary="−mean entropy (the paper's): of the option distribution, or of the next-token "
                 "distributions at every answer token")
add_form("nll", on_answer_tokens=_CALM + "nll_at_answer_tokens",
         summary="calibration-set NLL: of the gold option, or of the gold answer's tokens")
