"""The methods compared by `python -m apps.calm_llm`: a table of `MethodInfo`, one line each.

A method is a `base.Method` subclass in its own module plus one `register` line below (or in a
plugin module loaded with ``--plugins``, see docs/extending.md). The table is torch-free: the
classes are imported only when a run needs them (``get(name)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .options import (
    LabelSmoothingOptions,
    RCFTOptions,
    validate_calm,
    validate_label_smoothing,
    validate_rcft,
)
from .spec import (
    METHODS,
    TABLE,
    MethodInfo,
    info,
    names,
    register,
    registered,
    solver_is_second_order,
    unregister,
)

if TYPE_CHECKING:
    from .base import Context, Method

_CALM = {"learns_alpha": True, "sections": ("calm",), "validate": validate_calm}

register(MethodInfo("none", f"{__name__}.none:NoTraining", trains=False,
                    summary="the model as given"))
register(MethodInfo("ts", f"{__name__}.ts:TemperatureScaling", trains=False,
                    summary="post-hoc temperature scaling on the calibration split"))
register(MethodInfo("sft", f"{__name__}.sft:SFT", trains=True,
                    summary="completion-only cross-entropy (CFT)"))
register(MethodInfo("label_smoothing", f"{__name__}.sft:LabelSmoothing", trains=True,
                    options=LabelSmoothingOptions, validate=validate_label_smoothing,
                    summary="SFT with smoothed targets"))
register(MethodInfo("rcft", f"{__name__}.rcft:RCFT", trains=True, options=RCFTOptions,
                    validate=validate_rcft, tasks=("mcqa",), summary="SFT plus the EM-style ECE regularizer"))
register(MethodInfo("calm", f"{__name__}.calm:Calm", trains=True,
                    second_order=solver_is_second_order, **_CALM,
                    summary="bilevel calibration of (α, LoRA)"))
register(MethodInfo("calm_iterate", f"{__name__}.calm:CalmIterate", trains=True, **_CALM,
                    summary="ablation: alternate α and θ steps"))
register(MethodInfo("calm_regularization", f"{__name__}.calm:CalmRegularization", trains=True,
                    **_CALM, summary="ablation: CE − γ·entropy, jointly"))
register(MethodInfo("calm_scalar", f"{__name__}.calm:CalmScalar", trains=True,
                    second_order=solver_is_second_order, **_CALM,
                    summary="ablation: α is one temperature"))


def get(name: str) -> type[Method]:
    """The method class registered under `name`."""
    return info(name).load()


def __getattr__(name: str) -> Any:
    # Context and Method import torch: only on first use, so the table stays torch-free
    if name in ("Context", "Method"):
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["METHODS", "TABLE", "Context", "Method", "MethodInfo", "get", "info", "names", "register",
           "registered", "unregister"]
