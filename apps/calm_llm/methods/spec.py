"""The table of methods: one `MethodInfo` per method, by name. Imports no torch.

Everything that asks "which methods train / learn α / need second order / read the calm
options" reads this table: the CLI choices and validation (`config`), the runner (`train`),
export (``info.learns_alpha``: the method holds a calibration α) and the docs' options table.
A method's class is imported only when a run needs it (``info.load()``), so ``--help`` and
validation stay instant.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from calibration.registry import Registry

from .. import solvers


def never(cfg: Any) -> bool:
    """``second_order`` of a method that only ever takes first-order gradients."""
    return False


def solver_is_second_order(cfg: Any) -> bool:
    """``second_order`` of a method solved by ``--solver``: ITD and AID differentiate twice."""
    return solvers.is_second_order(cfg.calm.solver)


@dataclass(frozen=True)
class MethodInfo:
    """What the rest of the project may know about a method without importing it.

    Attributes:
        name: the ``--methods`` value, the results row and the checkpoint/export folder name.
        target: ``"package.module:Class"`` of its `base.Method` subclass (imported on use).
        trains: takes optimizer steps (``Method.step``); else it is evaluated as given, after
            its ``after_training`` fit (e.g. temperature scaling).
        learns_alpha: holds a calibration α (``method.alpha``): evaluated also without it
            (``row:no_alpha``), exported with ``alpha.safetensors``.
        second_order: ``second_order(cfg)`` is True when, under ``cfg``, it differentiates
            through gradients (the model then loads eager attention).
        sections: option groups it reads beyond the shared ``train`` options (``"calm"``:
            every ``calm.*`` option, so ``--select`` of a calm option applies to it).
        validate: ``validate(cfg)`` raises ``config.ConfigError`` for values of its own
            options that cannot work; runs on every configuration, like every other check.
        tasks: the ``--task`` values it applies to (``"mcqa"``, ``"open_qa"``, a plugin's);
            None (the default) is every task, a plugin's too; a method that reads answer
            options (RCFT's regularizer) is ``("mcqa",)``.
        options: a dataclass of the method's own options, each field declared with
            ``config.opt(default, help)``: every field becomes a flag ``--<name>-<field>``
            (or the field's own ``flag``)
            (a config file's ``plugin_options: {<name>: {<field>: value}}``), is validated
            like every option (type, choices, finite), recorded in ``config.json`` and
            compared on resume when the method runs; the method reads it as
            ``cfg.options_of(<name>)``.
        summary: one line for the docs.
    """

    name: str
    target: str
    trains: bool
    learns_alpha: bool = False
    second_order: Callable[[Any], bool] = never
    sections: tuple[str, ...] = ()
    validate: Callable[[Any], None] | None = None
    tasks: tuple[str, ...] | None = None
    summary: str = ""
    options: type | None = None

    def load(self) -> type:
        """The method's class."""
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


def _check_info(info: MethodInfo) -> None:
    if not isinstance(info, MethodInfo):
        raise TypeError(f"the method table takes a MethodInfo, got {type(info).__name__}")
    if not isinstance(info.name, str) or not info.name.isidentifier():
        raise ValueError(f"method name {info.name!r}: use letters, digits and underscores")


# every method, in registration order (the built-ins first)
METHODS: Registry[MethodInfo] = Registry("method", check=_check_info)
TABLE = METHODS  # the name the rest of the project has read the table under


def register(info: MethodInfo, *, replace: bool = False) -> MethodInfo:
    """Add a method to the table (a taken name is refused unless ``replace``); returns `info`."""
    return METHODS.register(info, replace=replace)


def unregister(name: str) -> None:
    """Remove a method from the table (plugins under test clean up after themselves)."""
    METHODS.unregister(name)


def registered(info: MethodInfo) -> AbstractContextManager[MethodInfo]:
    """``with registered(info):`` the method is in the table inside the block only."""
    return METHODS.registered(info)


def info(name: str) -> MethodInfo:
    """The table's entry for `name` (an unknown name lists the registered ones)."""
    return METHODS.get(name)


def names() -> tuple[str, ...]:
    """Every registered method, in registration order (the built-ins first)."""
    return tuple(METHODS)
