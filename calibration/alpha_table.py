"""The table of α parameterizations by name, and each one's options, without torch.

`calibration.alpha` holds the transforms themselves (they need torch); this module holds what a
command line needs to list and check them (their names, options, allowed values and defaults),
so that a CLI can offer the registered names and validate a choice before torch is imported.
`calibration.alpha.register` writes both at once, so they cannot disagree.

    spec = SPECS["affine"]                      # Spec(name, options, learns)
    resolve("affine", {"form": "z/tau+l"})      # {"form": "scale_shift", "positivity": "log",
                                                #  "tau_max": 20.0}: aliases mapped, defaults filled
    "temperature" in NAMES                      # a live view: later registrations appear
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NAMES", "POSITIVITIES", "Names", "Option", "SPECS", "Spec", "add", "resolve"]

POSITIVITIES: tuple[str, ...] = ("log", "softplus", "bounded")


@dataclass(frozen=True)
class Option:
    """One option of a parameterization.

    ``choices`` (when given) are the allowed values; ``aliases`` map other spellings onto a
    choice (the CLI's ``"z/tau+l"`` for ``"scale_shift"``); ``check(value)`` returns the value
    to use (converted) or raises ValueError; ``describe`` says what a choice means in errors.
    """

    default: Any
    choices: tuple[Any, ...] | None = None
    aliases: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[Any], Any] | None = None
    describe: Mapping[Any, str] = field(default_factory=dict)

    def normalize(self, name: str, value: Any) -> Any:
        """The value to construct with: an alias mapped to its choice, then checked."""
        if isinstance(value, str) and value in self.aliases:
            value = self.aliases[value]
        if self.choices is not None and value not in self.choices:
            allowed = " or ".join(
                f"{c!r}" + (f" ({self.describe[c]})" if c in self.describe else "")
                for c in self.choices
            )
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        return self.check(value) if self.check is not None else value


@dataclass(frozen=True)
class Spec:
    """A parameterization's name, its options (name → `Option`) and whether it has parameters
    to learn (the identity has none, so a CLI that trains α does not offer it)."""

    name: str
    options: Mapping[str, Option] = field(default_factory=dict)
    learns: bool = True


def _tau_max(value: Any) -> float:
    if isinstance(value, bool) or not (
        isinstance(value, int | float) and math.isfinite(value) and value > 1.0
    ):
        raise ValueError(f"tau_max must be a finite number > 1, got {value!r}")
    return float(value)


POSITIVITY = Option("log", choices=POSITIVITIES)
TAU_MAX = Option(20.0, check=_tau_max)
FORM = Option(
    "scale_shift",
    choices=("scale_shift", "shift_scale"),
    aliases={"z/tau+l": "scale_shift", "(z+l)/tau": "shift_scale"},
    describe={"scale_shift": "z/τ + l", "shift_scale": "(z + l)/τ"},
)
TEMPERATURE_OPTIONS: Mapping[str, Option] = {"positivity": POSITIVITY, "tau_max": TAU_MAX}

# The default of a CLI that learns α first: the CLI lists the names in this order.
SPECS: dict[str, Spec] = {
    s.name: s
    for s in (
        Spec("affine", {"form": FORM, **TEMPERATURE_OPTIONS}),
        Spec("temperature", TEMPERATURE_OPTIONS),
        Spec("class_temperature", TEMPERATURE_OPTIONS),
        Spec("shift"),
        Spec("identity", learns=False),
    )
}


class Names(Sequence[str]):
    """The registered names, read from `SPECS` on every use (a registration made after this
    view was created is in it); ``learns_only`` leaves out the parameterizations without
    parameters. Usable wherever a tuple of choices is (``in``, iteration, ``len``)."""

    def __init__(self, *, learns_only: bool = False):
        self.learns_only = learns_only

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, s in SPECS.items() if s.learns or not self.learns_only)

    def __getitem__(self, i: Any) -> Any:
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


NAMES = Names()


def add(spec: Spec) -> None:
    """Put ``spec`` in the table (replacing one of the same name)."""
    if not isinstance(spec, Spec):
        raise TypeError(f"expected a Spec, got {type(spec).__name__}")
    SPECS[spec.name] = spec


def resolve(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of ``name``: the given ones normalized (`Option.normalize`), the others
    at their default. Raises ValueError for an unknown name, an option the parameterization
    does not take, or a value its option refuses."""
    if name not in SPECS:
        raise ValueError(f"unknown alpha parameterization {name!r}; choose one of {list(NAMES)}")
    declared = SPECS[name].options
    unknown = set(options) - set(declared)
    if unknown:
        raise ValueError(
            f"alpha {name!r} takes options {sorted(declared) or 'none'}; got {sorted(unknown)}"
        )
    return {
        key: opt.normalize(key, options[key]) if key in options else opt.normalize(key, opt.default)
        for key, opt in declared.items()
    }
