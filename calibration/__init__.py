"""Calibration metrics, objectives, α parameterizations, post-hoc scaling, plots, and the
Semantic-ECE protocol for free-form answers (``calibration.semantic``).

Knows nothing about solvers or LLMs: imports torch and numpy only (matplotlib lazily, inside
the plotting functions). See docs/calibration.md.

The submodules load on first use (``calibration.metrics``, ``from calibration import alpha``),
so that ``calibration.alpha_table`` — the names and options of the α parameterizations — can be
read by a command line without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "alpha", "alpha_table", "metrics", "objectives", "plots", "posthoc",
           "registry", "semantic", "stats"]

_SUBMODULES = frozenset(__all__) - {"__version__"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES)
