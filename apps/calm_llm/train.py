"""Deprecated: the multiple-choice run moved into the task table (issue 38).

``python -m apps.calm_llm`` runs ``runner.run.run(cfg, tasks.get(cfg.task))``; the
multiple-choice task's own code (the zero-shot probe, ``--select``, re-exporting a kept row) is
`apps.calm_llm.tasks.mcqa`. The names below still work, with a DeprecationWarning.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import tasks
from .config import Config
from .runner import run as _runner
from .tasks import mcqa

_MOVED = ("selects", "choose_variant", "row_seed", "run_selection", "reexport_kept")


def run(cfg: Config) -> dict[str, Any]:
    """Deprecated: ``runner.run.run(cfg, tasks.get(cfg.task))``."""
    warnings.warn("apps.calm_llm.train.run is deprecated: use "
                  "apps.calm_llm.runner.run.run(cfg, apps.calm_llm.tasks.get(cfg.task))",
                  DeprecationWarning, stacklevel=2)
    return _runner.run(cfg, tasks.get(cfg.task))


def prepare_run_dir(cfg: Config, dist: Any) -> tuple[Any, Any]:
    """Deprecated: ``runner.run.prepare(cfg, dist, tasks.get("mcqa"))``."""
    warnings.warn("apps.calm_llm.train.prepare_run_dir is deprecated: use "
                  "apps.calm_llm.runner.run.prepare(cfg, dist, apps.calm_llm.tasks.get('mcqa'))",
                  DeprecationWarning, stacklevel=2)
    return _runner.prepare(cfg, dist, tasks.get("mcqa"))


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"apps.calm_llm.train.{name} is deprecated: use "
                      f"apps.calm_llm.tasks.mcqa.{name}", DeprecationWarning, stacklevel=2)
        return getattr(mcqa, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
