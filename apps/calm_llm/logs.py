"""The run's progress messages, through `logging` (logger ``"apps.calm_llm"``), as `bilevel`
logs through ``"bilevel"``; the tqdm progress bars stay as they are.

`log` writes on the main process only (every rank runs the same code). Unless the logger has
been given handlers already (``logging.getLogger("apps.calm_llm").addHandler(...)`` by a caller
that wants the messages elsewhere), the first message installs one that writes the bare message
to the *current* ``sys.stderr`` at INFO, which is what the command line has always printed.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
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


_APPS = Path(__file__).resolve().parents[1]  # the `apps` package: warnings raised by its code


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[None]:
    """While active, a warning that the app's own code raises (not a deprecation: those are
    for developers) is printed as one ``warning: <message>`` line, instead of Python's
    ``file:line: UserWarning: ...`` with the source line under it: what the command line says
    about the data it dropped or the options it adjusted reads like the rest of its output.
    Only the format changes (`warnings.formatwarning`): which warnings are shown, and a caller
    that records them (``warnings.catch_warnings(record=True)``, ``pytest.warns``), are as
    before. The previous format is put back on exit."""
    previous = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):  # noqa: ANN001
        if (not issubclass(category, DeprecationWarning)
                and Path(filename).resolve().is_relative_to(_APPS)):
            return f"warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = fmt
    try:
        yield
    finally:
        warnings.formatwarning = previous
