"""`Registry[Info]`: the one shape of every table of named choices in the project.

α parameterizations and calibration losses (here, in ``calibration``), and in ``apps`` the
methods, data sources, bilevel and linear solvers and upper-level losses are each one
`Registry` of frozen ``Info`` records. Imports nothing but the standard library, so a command
line can list and check names before torch loads.

    METHODS = Registry[MethodInfo]("method")
    METHODS.register(MethodInfo("sft", ...))         # a taken name: DuplicateName
    METHODS.register(other, replace=True)            # unless replacing is asked for
    METHODS.get("sft")                               # unknown: UnknownName listing the choices
    parser.add_argument("--methods", choices=METHODS.names())   # live: later entries appear

An ``Info`` is any object with a ``name`` (a ``str``: the only place the name is given) and,
optionally, ``options``: a dataclass type of the entry's own options, which the CLI of `apps`
turns into ``--<name>-<field>`` flags validated like its built-in ones. Registration order is
kept (the built-ins first), which is the order names are listed in.

Registries are process-global: an entry registered by a plugin module stays until it is
unregistered (``with registry.registered(info):`` scopes it to a block, as tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

__all__ = ["DuplicateName", "Names", "Registry", "UnknownName"]

Info = TypeVar("Info")


class UnknownName(KeyError, ValueError):
    """A name no entry of the registry has; the message lists the registered ones.

    A `KeyError` (it is a failed lookup) and a `ValueError` (it is a bad value of an option),
    so callers written against either keep working.
    """

    def __str__(self) -> str:  # KeyError would print the message's repr, quotes and all
        return str(self.args[0]) if self.args else ""


class DuplicateName(ValueError):
    """A name that is already registered to another entry (and ``replace=True`` was not asked)."""


class Names(Sequence[str]):
    """The registered names of a `Registry`, read on every use, optionally filtered by a
    predicate on the entry. Usable wherever a tuple of choices is (``in``, iteration, ``len``,
    argparse ``choices``): an entry registered after this view was made is in it."""

    def __init__(self, registry: Registry[Any], where: Callable[[Any], bool] | None = None):
        self.registry, self.where = registry, where

    def _names(self) -> tuple[str, ...]:
        where = self.where
        return tuple(n for n, i in self.registry.items() if where is None or where(i))

    def __getitem__(self, i: Any) -> Any:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        return self._names() == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


class Registry(Mapping[str, Info], Generic[Info]):
    """A table of ``Info`` records by their ``name``: a read-only mapping plus `register`.

    Args:
        kind: what an entry is, in words ("method", "linear solver"): it names the table in
            every error message.
        check: ``check(info)`` raises for an entry that cannot work (a wrong type, a bad
            field), before it is added (and before the name is checked, so it may not assume
            one); the registry itself checks only the name.
    Cost: ``register``/``get`` are dict operations; `names` builds a tuple per use.
    """

    def __init__(self, kind: str, *, check: Callable[[Info], None] | None = None) -> None:
        self.kind = kind
        self._check = check
        self._entries: dict[str, Info] = {}

    # -- the mapping ----------------------------------------------------------------------
    def __getitem__(self, name: str) -> Info:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"

    # -- the table ------------------------------------------------------------------------
    def register(self, info: Info, *, replace: bool = False) -> Info:
        """Add ``info`` under ``info.name`` and return it (so it can be kept: ``X = reg.register(...)``).

        Registering an entry equal to the one already there is a no-op (a module imported
        twice registers twice). A different entry under a taken name is a `DuplicateName`
        unless ``replace=True``.
        """
        if self._check is not None:  # first: it says when `info` is not an Info at all
            self._check(info)
        name = getattr(info, "name", None)
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r} "
                             f"(in {info!r})")
        old = self._entries.get(name)
        if old is not None and old != info and not replace:
            raise DuplicateName(
                f"{self.kind} {name!r} is already registered ({old!r}); choose another name, or "
                "pass replace=True to replace it")
        self._entries[name] = info
        return info

    def unregister(self, name: str) -> None:
        """Remove ``name`` (no error when it is not there: cleanup after a test or plugin)."""
        self._entries.pop(name, None)

    @contextmanager
    def registered(self, info: Info, *, replace: bool = False) -> Iterator[Info]:
        """``with reg.registered(info):`` the entry is in the table inside the block only (an
        entry it replaced is put back afterwards)."""
        name = getattr(info, "name", None)
        before = self._entries.get(name) if isinstance(name, str) else None
        self.register(info, replace=replace)
        try:
            yield info
        finally:  # ignored attr-defined: Info is unbounded; register() checked info.name
            self.unregister(info.name)  # type: ignore[attr-defined]
            if before is not None:
                self._entries[info.name] = before  # type: ignore[attr-defined]

    def get(self, name: str, default: Any = ...) -> Info:
        """The entry registered as ``name``; an unknown name is an `UnknownName` listing the
        registered ones (or ``default`` when one is given)."""
        if name in self._entries:
            return self._entries[name]
        if default is not ...:
            return default
        raise UnknownName(f"unknown {self.kind} {name!r}; registered: {list(self._entries)}")

    def names(self, where: Callable[[Info], bool] | None = None) -> Names:
        """A live view of the registered names (those whose entry satisfies ``where``)."""
        return Names(self, where)

    def options_of(self, name: str) -> type | None:
        """The options dataclass the entry declares (its ``options`` attribute), or None."""
        return getattr(self.get(name), "options", None)
