"""The methods compared by `python -m apps.calm_llm`: one class per method, looked up by name.

Adding a method: subclass `base.Method` (set ``name``, ``trains``; implement ``step`` and, if it
changes predictions, ``vocab_transform`` / ``option_transform``), then add it to `REGISTRY` and
to ``config.METHODS``.
"""

from __future__ import annotations

from .base import Context, Method
from .calm import Calm, CalmIterate, CalmRegularization, CalmScalar
from .none import NoTraining
from .rcft import RCFT
from .sft import SFT, LabelSmoothing
from .ts import TemperatureScaling

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (NoTraining, TemperatureScaling, SFT, LabelSmoothing, RCFT, Calm, CalmIterate,
                CalmRegularization, CalmScalar)
}


def get(name: str) -> type[Method]:
    """The method class registered under `name`."""
    if name not in REGISTRY:
        raise KeyError(f"unknown method {name!r} (known: {sorted(REGISTRY)})")
    return REGISTRY[name]


__all__ = ["REGISTRY", "Context", "Method", "get"]
