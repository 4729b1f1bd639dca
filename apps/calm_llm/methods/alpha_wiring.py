"""α: the calibration parameters of CALM, wired to the model's vocabulary logits.

α = calibration.alpha parameters acting on the logits z (S, L', V):
``alpha_scope="vocab"``: K = V, every vocabulary logit has its own (l, τ);
``alpha_scope="options"`` (letter mode): K = number of option slots and only the option-letter
columns ``class_ids`` are transformed (the others do not enter the option softmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# config spelling -> calibration.alpha's name for the algebraic form of the affine transform
FORMS = {"z/tau+l": "scale_shift", "(z+l)/tau": "shift_scale"}


@dataclass
class Alpha:
    """A parameterization plus the columns it acts on.

    ``params`` are leaf tensors (requires_grad) — the outer variables of the bilevel problem.
    """

    param: Any
    params: dict[str, torch.Tensor]
    class_ids: torch.Tensor | None

    def apply(self, params: dict[str, torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """α-adjusted logits, same shape as ``logits``."""
        return self.param.apply(params, logits, class_ids=self.class_ids)


def make_alpha(
    name: str, form: str, scope: str, *, vocab_size: int, option_token_ids: torch.Tensor | None,
    device: torch.device,
) -> Alpha:
    """Initialize α at the identity transform (l = 0, τ = 1)."""
    from calibration import alpha as calibration_alpha

    kwargs: dict[str, Any] = {}
    if name == "affine":
        kwargs["form"] = FORMS[form]
    param = calibration_alpha.get(name, **kwargs)
    if scope == "options":
        if option_token_ids is None:
            raise ValueError("alpha_scope='options' needs the option-letter ids (letter mode)")
        class_ids = option_token_ids.to(device)
        k = int(class_ids.numel())
    else:
        class_ids, k = None, vocab_size
    params = param.init(k, dtype=torch.float32, device=device)
    params = {n: t.detach().clone().requires_grad_(True) for n, t in params.items()}
    return Alpha(param=param, params=params, class_ids=class_ids)
