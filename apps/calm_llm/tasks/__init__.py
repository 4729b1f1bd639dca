"""The tasks a run can do (``--task``): the table of `TaskInfo` (`apps.calm_llm.task_table`,
torch-free) and ``get(name)``, the task's code (a `base.Task`): multiple choice in `mcqa`, open
QA in `open_qa`, or a plugin's (docs/extending.md, "Tasks").

``python -m apps.calm_llm`` runs ``runner.run.run(cfg, tasks.get(cfg.task))``: the runner's
stages call the task and never name one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..task_table import TASKS, TaskInfo, applies, info, names, register, registered, unregister

if TYPE_CHECKING:
    from .base import Task


def get(name: str) -> Task:
    """The task registered under `name`, ready to run (its class, built with its entry)."""
    entry = info(name)
    return entry.load()(entry)


__all__ = ["TASKS", "TaskInfo", "applies", "get", "info", "names", "register", "registered",
           "unregister"]
