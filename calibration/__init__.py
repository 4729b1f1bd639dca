"""Calibration metrics, objectives, α parameterizations, post-hoc scaling and plots.

Knows nothing about solvers or LLMs: imports torch and numpy only (matplotlib lazily, inside
the plotting functions). See docs/calibration.md.
"""

from calibration import alpha, metrics, objectives, plots, posthoc

__version__ = "0.1.0"

__all__ = ["__version__", "alpha", "metrics", "objectives", "plots", "posthoc"]
