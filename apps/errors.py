"""The errors this project raises on purpose, all under one base class, `CalmError`.

A `CalmError` is an answer, not a bug: its message names the value, the option (or file) and the
fix, so ``python -m apps.calm_llm`` prints it in one line and exits. Anything else that escapes a
run is a bug (in the project or in a plugin) and keeps its traceback. Each subclass also derives
from the built-in exception it replaced (``ValueError``, ``RuntimeError``), so ``except
ValueError`` in callers and tests keeps working.

Imports nothing: every layer of ``apps`` may raise these without an import circle.
"""

from __future__ import annotations

__all__ = ["CalmError", "ConfigError", "DataError", "Diverged", "NonFiniteLoss", "PluginError",
           "RunRefused"]


class CalmError(Exception):
    """Base of every error the project raises on purpose (printed by the CLI in one line)."""


class ConfigError(CalmError, ValueError):
    """A configuration value that cannot work; the message names the option."""


class DataError(CalmError, ValueError):
    """A data file, row or source that cannot be read as the schema asks; the message names
    the file and the line (or row)."""


class PluginError(ConfigError):
    """A ``--plugins`` module that fails to import (missing, or raising while it runs). The CLI
    prints one line naming the module, then the plugin's own traceback (``__cause__``): the bug
    is in the plugin's code, and its traceback is what finds it."""


class RunRefused(CalmError, ValueError):
    """The run directory, a checkpoint or the resume would mix or overwrite results; the
    message says why and what to do instead."""


class NonFiniteLoss(CalmError, RuntimeError):
    """Training produced a NaN/inf loss; the message names the step and the last good checkpoint."""


class Diverged(NonFiniteLoss):
    """An optimizer step left a NaN/inf in the trained tensors or their gradients (a too large
    learning rate, usually); the message names the method, the step and the fix. Raised before
    that state can be checkpointed, so the last checkpoint stays the last finite state."""
