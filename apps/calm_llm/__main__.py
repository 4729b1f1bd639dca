"""``python -m apps.calm_llm [--config FILE] [--methods ...] [--out DIR] [--resume DIR] ...``

``--resume DIR`` continues a killed run with the configuration saved in ``DIR/config.json``
(flags given next to it override that file and must not change the results-relevant options).

Errors: a `apps.errors.CalmError` (raised on purpose; its message names the option or file and
the fix) is printed in one line, exit status 2 before the run starts (the configuration) and 1
after; a plugin that fails to import is one line naming it, then its own traceback; anything
else is a bug and propagates with its traceback.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

from ..errors import CalmError, ConfigError, PluginError
from .config import parse_args  # torch-free, like everything imported above
from .logs import warnings_as_lines
from .threads import apply_threads, set_wait_policy

# libgomp reads OMP_WAIT_POLICY once, when torch loads it: set before the first torch import
# (the imports above load no torch), so idle OpenMP workers sleep instead of spinning on cores
# that another process needs (docs/performance.md, "Under contention")
set_wait_policy()


def _with_resume_config(argv: list[str]) -> list[str]:
    """Insert ``--config RUN/config.json`` when resuming without an explicit --config."""
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        return argv
    for i, a in enumerate(argv):
        run = argv[i + 1] if a == "--resume" and i + 1 < len(argv) else None
        if a.startswith("--resume="):
            run = a.split("=", 1)[1]
        if run:
            saved = Path(run) / "config.json"
            if not saved.is_file():
                raise ConfigError(f"--resume {run}: no config.json there (not a run directory)")
            return ["--config", str(saved), *argv]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(_with_resume_config(argv))
    except PluginError as e:
        # the bug is in the plugin's code: its own traceback, under one line naming the module
        print(f"error: {e}", file=sys.stderr)
        traceback.print_exception(e.__cause__ or e, file=sys.stderr)
        return 2
    except CalmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from . import tasks
    from .runner.run import run  # heavy imports only after the config is valid

    apply_threads(cfg.threads)

    # transformers 5 deprecates a name that peft still calls on every LoRA load: noise, not news
    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )

    try:
        with warnings_as_lines():  # the app's own warnings read as its other lines
            run(cfg, tasks.get(cfg.task))  # the task table: multiple choice, open QA, a plugin's
    except CalmError as e:  # anything else is a bug: its traceback is what finds it
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full or read-only disk is the machine's state, not a bug
        from .io import WRITE_FIXES, unwritable

        if e.errno not in WRITE_FIXES:
            raise
        print(f"error: {unwritable(None, e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
