"""The table of methods: one `MethodInfo` per method, by name. Imports no torch.

Everything that asks "which methods train / learn α / need second order / read the calm
options" reads this table: the CLI choices and validation (`config`), the runner (`train`),
export (``info.learns_alpha``: the method holds a calibration α) and the docs' options table.
A method's class is imported only when a run needs it (``info.load()``), so ``--help`` and
validation stay instant.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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
            every ``calm.*`` option, so ``--select`` of a calm option applies to it;
            ``"rcft"``, ``"label_smoothing"``: those ``train.*`` options).
        validate: ``validate(cfg)`` raises ``config.ConfigError`` for values of its own
            options that cannot work; runs on every configuration, like every other check.
        tasks: the ``--task`` values it applies to (``"mcqa"``, ``"open_qa"``); a method
            that reads answer options (RCFT's regularizer) is ``("mcqa",)``.
        options: a dataclass of the method's own options, each field declared with
            ``config.opt(default, help)``: every field becomes a flag ``--<name>-<field>``
            (a config file's ``plugin_options: {<name>: {<field>: value}}``), is validated
            like every option (type, choices, finite), recorded in ``config.json`` and
            compared on resume when the method runs; the method reads it as
            ``cfg.method_options(<name>)``.
        summary: one line for the docs.
    """

    name: str
    target: str
    trains: bool
    learns_alpha: bool = False
    second_order: Callable[[Any], bool] = never
    sections: tuple[str, ...] = ()
    validate: Callable[[Any], None] | None = None
    tasks: tuple[str, ...] = ("mcqa", "open_qa")
    summary: str = ""
    options: type | None = None

    def load(self) -> type:
        """The method's class."""
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


TABLE: dict[str, MethodInfo] = {}


def register(info: MethodInfo) -> MethodInfo:
    """Add a method to the table (a name may be registered once); returns `info`."""
    if info.name in TABLE and TABLE[info.name] != info:
        raise ValueError(f"method {info.name!r} is already registered as {TABLE[info.name].target}")
    if not info.name.isidentifier():
        raise ValueError(f"method name {info.name!r}: use letters, digits and underscores")
    TABLE[info.name] = info
    return info


def unregister(name: str) -> None:
    """Remove a method from the table (plugins under test clean up after themselves)."""
    TABLE.pop(name, None)


@contextmanager
def registered(info: MethodInfo) -> Iterator[MethodInfo]:
    """``with registered(info):`` the method is in the table inside the block only."""
    register(info)
    try:
        yield info
    finally:
        unregister(info.name)


def info(name: str) -> MethodInfo:
    """The table's entry for `name`."""
    if name not in TABLE:
        raise KeyError(f"unknown method {name!r} (known: {list(TABLE)})")
    return TABLE[name]


def names() -> tuple[str, ...]:
    """Every registered method, in registration order (the built-ins first)."""
    return tuple(TABLE)
