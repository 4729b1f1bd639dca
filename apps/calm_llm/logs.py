"""The run's progress messages, through `logging` (logger ``"apps.calm_llm"``), as `bilevel`
logs through ``"bilevel"``; the tqdm progress bars stay as they are.

`log` writes on the main process only (every rank runs the same code). Unless the logger has
been given handlers already (``logging.getLogger("apps.calm_llm").addHandler(...)`` by a caller
that wants the messages elsewhere), the first message installs one that writes the bare message
to the *current* ``sys.stderr`` at INFO, which is what the command line has always printed.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("apps.calm_llm")


class _CurrentStderr(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is at each message (a test's capture, a
    redirect made after the first message), not the stream of the moment it was made."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it; sys.stderr wins
        pass


def _ensure_handler() -> None:
    if not logger.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # one line per message, whatever the root logger has


def log(msg: str, d: Any = None, *, level: int = logging.INFO) -> None:
    """Log ``msg`` from the main process (``d``: the run's `distributed.Dist`, or None)."""
    if d is None or d.main:
        _ensure_handler()
        logger.log(level, msg)
