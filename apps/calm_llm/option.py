"""``opt``: how every option of the project is declared, a dataclass field with its CLI help.

Lives below `config` (which builds the parser from these fields) so that the torch-free tables
of methods, solvers and losses can declare their entries' own options dataclasses without an
import circle. Imports nothing from the project.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(
    default: Any, help: str, *, choices: tuple | None = None, flag: str | None = None,
    names: Any = None,
) -> Any:
    """A dataclass field carrying its CLI help text, allowed values and (optional) flag name.

    ``names``: for a list option, a function giving the names its entries may take, read when
    help is shown (a registry that plugins extend: the help lists what is registered then).
    ``flag``: the flag when it is not the field's name with dashes (an entry's own option is
    ``--<entry>-<field>`` by default).
    """
    meta = {"help": help, "choices": choices, "flag": flag, "names": names}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)
