"""One module per library; each has ``build(problem, method, steps, lr) -> run | None``.

``run()`` returns dF/dα as a tensor shaped like ``problem.alpha``. Peers are imported only
inside their module's functions, and ``unavailable()`` turns a missing peer into a note.
"""

from __future__ import annotations

import importlib
from types import ModuleType

LIBRARIES = ("plain_torch", "bilevel", "torchopt", "higher", "betty")
_MODULES = {
    "plain_torch": "plain_torch",
    "bilevel": "toolkit",
    "torchopt": "torchopt_lib",
    "higher": "higher_lib",
    "betty": "betty_lib",
    "boat": "boat_lib",  # bench/peers.py only (bench/hypergrad.py iterates LIBRARIES)
}


def module(library: str) -> ModuleType:
    """The bench module wrapping ``library``."""
    return importlib.import_module(f"{__name__}.{_MODULES[library]}")


def unavailable(library: str) -> str | None:
    """None if ``library`` can run here, else why not."""
    mod = module(library)
    check = getattr(mod, "unavailable", None)
    return check() if check is not None else None
