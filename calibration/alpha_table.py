"""The table of α parameterizations by name, and each one's options, without torch.

`calibration.alpha` holds the transforms themselves (they need torch); this module holds the
one table of them, `SPECS` (a `calibration.registry.Registry` of `Spec`): each entry's name
(given once: a transform's ``name`` is read from here), its options, allowed values and
defaults, and its factory (``"module:attr"``, imported on first use), so that a CLI can offer
the registered names and validate a choice before torch is imported.
`calibration.alpha.register` adds an entry.

    spec = SPECS["affine"]                      # Spec(name, options, learns, factory)
    resolve("affine", {"form": "z/tau+l"})      # {"form": "scale_shift", "positivity": "log",
                                                #  "tau_max": 20.0}: aliases mapped, defaults filled
    "temperature" in NAMES                      # a live view: later registrations appear
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from calibration.registry import Names, Registry

__all__ = ["NAMES", "POSITIVITIES", "Names", "Option", "SPECS", "Spec", "add", "name_of", "resolve"]

POSITIVITIES: tuple[str, ...] = ("log", "softplus", "bounded")
"""The maps of an unconstrained parameter to a temperature τ > 0 (option ``positivity``)."""


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
    """A parameterization's name, its options (name → `Option`), whether it has parameters
    to learn (the identity has none, so a CLI that trains α does not offer it) and its factory:
    ``factory(**options) -> Parameterization``, a callable or ``"module:attr"``."""

    name: str
    options: Mapping[str, Option] = field(default_factory=dict)
    learns: bool = True
    factory: str | Callable[..., Any] = ""

    def load(self) -> Callable[..., Any]:
        """The factory (imported on first use when given as ``"module:attr"``)."""
        if callable(self.factory):
            return self.factory
        module, _, attr = self.factory.partition(":")
        return getattr(importlib.import_module(module), attr)

    def made_by(self, factory: Any) -> bool:
        """Whether ``factory`` (a class, usually) is this entry's factory, without importing."""
        if callable(self.factory):
            return self.factory is factory
        where = f"{getattr(factory, '__module__', '')}:{getattr(factory, '__qualname__', '')}"
        return self.factory == where


def _check_spec(spec: Spec) -> None:
    if not isinstance(spec, Spec):
        raise TypeError(f"expected a Spec, got {type(spec).__name__}")
    if not (callable(spec.factory) or ":" in str(spec.factory)):
        raise TypeError(f"alpha {spec.name!r}: the factory must be callable or 'module:attr', "
                        f"got {spec.factory!r}")


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
"""The options of every parameterization with a temperature: ``positivity``, ``tau_max``."""

# The default of a CLI that learns α first: the CLI lists the names in this order.
SPECS: Registry[Spec] = Registry("alpha parameterization", check=_check_spec)
"""The registered α parameterizations, one `Spec` each (``add`` registers one more)."""
_ALPHA = "calibration.alpha:"
for _spec in (
    Spec("affine", {"form": FORM, **TEMPERATURE_OPTIONS}, factory=_ALPHA + "Affine"),
    Spec("temperature", TEMPERATURE_OPTIONS, factory=_ALPHA + "Temperature"),
    Spec("class_temperature", TEMPERATURE_OPTIONS, factory=_ALPHA + "ClassTemperature"),
    Spec("shift", factory=_ALPHA + "Shift"),
    Spec("identity", learns=False, factory=_ALPHA + "Identity"),
):
    SPECS.register(_spec)
del _spec

NAMES = SPECS.names()
"""The names in ``SPECS`` (a live view: a parameterization added later is in it)."""


def learned_names() -> Names:
    """The live names of the parameterizations with parameters to learn (a CLI's choices)."""
    return SPECS.names(lambda s: s.learns)


def add(spec: Spec, *, replace: bool = False) -> Spec:
    """Put ``spec`` in the table; a taken name is refused unless ``replace``."""
    return SPECS.register(spec, replace=replace)


def name_of(factory: Any) -> str | None:
    """The registered name whose factory is ``factory`` (a `calibration.alpha.Transform`
    subclass reads its ``name`` here), or None when it is not registered."""
    return next((n for n, s in SPECS.items() if s.made_by(factory)), None)


def resolve(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of ``name``: the given ones normalized (`Option.normalize`), the others
    at their default. Raises ValueError for an unknown name, an option the parameterization
    does not take, or a value its option refuses."""
    declared = SPECS.get(name).options  # an unknown name: a ValueError listing the names
    unknown = set(options) - set(declared)
    if unknown:
        raise ValueError(
            f"alpha {name!r} takes options {sorted(declared) or 'none'}; got {sorted(unknown)}"
        )
    return {
        key: opt.normalize(key, options[key]) if key in options else opt.normalize(key, opt.default)
        for key, opt in declared.items()
    }
