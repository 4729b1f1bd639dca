"""The methods compared by `python -m apps.calm_llm`: one class per method, looked up by name.

Adding a method: subclass `base.Method` (set ``name``, ``trains``; implement ``step`` and, if it
changes predictions, ``vocab_transform`` / ``option_transform``), add ``name: "module:Class"`` to
`REGISTRY` and the name to ``config.METHODS``. Modules are imported on first use.
"""

from __future__ import annotations

import importlib

from .base import Context, Method

REGISTRY: dict[str, str] = {
    "none": "none:NoTraining",
    "ts": "ts:TemperatureScaling",
    "sft": "sft:SFT",
    "label_smoothing": "sft:LabelSmoothing",
    "rcft": "rcft:RCFT",
    "calm": "calm:Calm",
    "calm_iterate": "calm:CalmIterate",
    "calm_regularization": "calm:CalmRegularization",
    "calm_scalar": "calm:CalmScalar",
}


def get(name: str) -> type[Method]:
    """The method class registered under `name`."""
    if name not in REGISTRY:
        raise KeyError(f"unknown method {name!r} (known: {sorted(REGISTRY)})")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = ["REGISTRY", "Context", "Method", "get"]
