"""The table of tasks (``--task``): one `TaskInfo` per task, by name. Imports no torch.

A task is what a run asks of the model and how its answers are scored: multiple choice
(``mcqa``: option scoring, conf-ECE) or open QA (``open_qa``: sampled free-form answers,
Semantic-ECE), or one a plugin registers (docs/extending.md, "Tasks"). Everything that asks
"what does this task read, score and report" without running it reads this table: the CLI
choices and validation (`config`), the method options' checks (`methods.options`), export (what
a fitted temperature acts on) and the study's split carving. The task's code, a
`apps.calm_llm.tasks.base.Task` subclass that owns its loading, evaluation, metrics and report,
is imported only when a run needs it (``info.load()``, or `apps.calm_llm.tasks.get`).

The table lives outside the `tasks` package so that `config` can read it while the tasks'
code imports `config`: no two-way package dependency.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass

from calibration.registry import Registry

ANSWER_KINDS = ("options", "free_form")


@dataclass(frozen=True)
class TaskInfo:
    """What the rest of the project may know about a task without importing its code.

    Attributes:
        name: the ``--task`` value, and ``metrics.json``'s ``"task"``.
        target: ``"package.module:Class"`` of its `tasks.base.Task` subclass (imported on use).
        answers: ``"options"`` (each question's K answer options are scored: α and a fitted
            temperature may act on the (N, K) option scores, ``--upper-objective options``
            and ``--mode letter`` apply) or ``"free_form"`` (answers are generated: α and T act
            on the next-token logits (B, V) only).
        ece_name: the ``metrics.json`` key of the calibration error a row's summary line
            reports; ``ece_label`` is how that line names it.
        source_kind: the kind of data source it reads (`data.sources.KINDS`): what
            ``--in-domain`` / ``--out-of-domain`` are checked against.
        default_config: the configuration file ``--task NAME`` alone runs ("" = the defaults).
        single_process: refuses ``accelerate launch`` / ``torchrun`` (sampling is not sharded).
        supports_select: ``--select`` applies (its choice reads this task's predictions).
        summary: one line for the docs.
    """

    name: str
    target: str
    answers: str = "options"
    ece_name: str = "conf_ece"
    ece_label: str = "ece"
    source_kind: str = "mcqa"
    default_config: str = ""
    single_process: bool = False
    supports_select: bool = False
    summary: str = ""

    @property
    def has_options(self) -> bool:
        """Whether its questions come with answer options that are scored."""
        return self.answers == "options"

    def load(self) -> type:
        """The task's class."""
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


def _check_info(info: TaskInfo) -> None:
    if not isinstance(info, TaskInfo):
        raise TypeError(f"the task table takes a TaskInfo, got {type(info).__name__}")
    if not isinstance(info.name, str) or not info.name.isidentifier():
        raise ValueError(f"task name {info.name!r}: use letters, digits and underscores")
    if info.answers not in ANSWER_KINDS:
        raise ValueError(f"task {info.name!r}: answers={info.answers!r}, not one of {ANSWER_KINDS}")


# every task, in registration order (the built-ins first)
TASKS: Registry[TaskInfo] = Registry("task", check=_check_info)


def register(info: TaskInfo, *, replace: bool = False) -> TaskInfo:
    """Add a task to the table (a taken name is refused unless ``replace``); returns `info`."""
    return TASKS.register(info, replace=replace)


def unregister(name: str) -> None:
    """Remove a task from the table (plugins under test clean up after themselves)."""
    TASKS.unregister(name)


def registered(info: TaskInfo) -> AbstractContextManager[TaskInfo]:
    """``with registered(info):`` the task is in the table inside the block only."""
    return TASKS.registered(info)


def info(name: str) -> TaskInfo:
    """The table's entry for `name` (an unknown name lists the registered ones)."""
    return TASKS.get(name)


def names() -> tuple[str, ...]:
    """Every registered task, in registration order (the built-ins first)."""
    return tuple(TASKS)


def applies(method_tasks: tuple[str, ...] | None, task: str) -> bool:
    """Whether a method declaring ``tasks=method_tasks`` (None: every task) runs under ``task``."""
    return method_tasks is None or task in method_tasks


_TASKS = "apps.calm_llm.tasks"
register(TaskInfo("mcqa", f"{_TASKS}.mcqa:MultipleChoice", supports_select=True,
                  summary="multiple choice: option scoring, conf-ECE (the default)"))
register(TaskInfo("open_qa", f"{_TASKS}.open_qa:OpenQA", answers="free_form",
                  ece_name="semantic_ece", ece_label="sem-ECE", source_kind="open_qa",
                  default_config="open_qa", single_process=True,
                  summary="open QA: sampled free-form answers, Semantic-ECE (docs/open_qa.md)"))

__all__ = ["TASKS", "TaskInfo", "applies", "info", "names", "register", "registered",
           "unregister"]
