"""The bilevel problem (the checks on what its objectives return are in ``_internals``).

    min_α  F(α) = f(α, θ*(α); upper_batch)
    s.t.   θ*(α) ∈ argmin_θ g(α, θ; lower_batch)

``outer`` (α) and ``inner`` (θ) are pytrees of floating-point tensors; f is ``upper`` (e.g. a
validation loss) and g is ``lower`` (e.g. a training loss), both
``(outer, inner, batch) -> 0-dim tensor``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Objective", "Problem"]

Objective = Callable[[Any, Any, Any], torch.Tensor]


@dataclass(frozen=True)
class Problem:
    """A bilevel problem: ``upper`` = f(outer, inner, batch), ``lower`` = g(outer, inner, batch).

    An ``nn.Module`` enters an objective through :func:`bilevel.functional`::

        f = bilevel.functional(model, trainable=lambda name: "lora" in name)
        def lower(alpha, lora, batch):                    # lora: a dict like f.params
            logits = f(lora, batch["x"])
            return cross_entropy(logits, batch["y"]) + alpha["wd"] * tree.sq_norm(lora)

    Only the tensors passed as ``inner`` are inner variables; every other model parameter
    is a constant for the solvers (they never write ``.grad`` anywhere).
    """

    upper: Objective
    lower: Objective

    def __post_init__(self) -> None:
        for name in ("upper", "lower"):
            if not callable(getattr(self, name)):
                raise TypeError(
                    f"Problem: {name} must be a callable (outer, inner, batch) -> scalar tensor, "
                    f"got {type(getattr(self, name)).__name__}"
                )
