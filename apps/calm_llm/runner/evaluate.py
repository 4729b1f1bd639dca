"""Stage 4 of a run, for any task: the passes a trained (and fitted) method is evaluated in —
as one row, and (for a trained method that learns α, with --eval-without-alpha) again without
α as ``row:no_alpha``. How a pass is evaluated and scored is the task's ``evaluate``
(`apps.calm_llm.tasks`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .. import methods as method_registry
from ..methods.base import Method
from .report import RunState


def passes(state: RunState, info: method_registry.MethodInfo, method: Method,
           row: str) -> list[tuple[str, Any]]:
    """The rows one trained method is evaluated as: ``row`` as it predicts, and, for a trained
    method that learns α and uses it (with --eval-without-alpha), ``row:no_alpha`` with α
    switched off; each with the context manager that sets the method up for it."""
    out: list[tuple[str, Any]] = [(row, contextlib.nullcontext())]
    if info.trains and info.learns_alpha and state.cfg.calm.eval_without_alpha \
            and method.alpha_in_use:
        out.append((f"{row}:no_alpha", method.without_alpha()))
    return out
