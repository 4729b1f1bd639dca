"""``python -m apps.calm_llm [--config FILE] [--methods ...] [--out DIR] [--resume DIR] ...``

``--resume DIR`` continues a killed run with the configuration saved in ``DIR/config.json``
(flags given next to it override that file and must not change the results-relevant options).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from .config import ConfigError, parse_args


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
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .train import NonFiniteLoss, run  # heavy imports only after the config is valid

    # transformers 5 deprecates a name that peft still calls on every LoRA load: noise, not news
    warnings.filterwarnings(
        "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )

    if cfg.task == "open_qa":
        from .open_qa.run import run  # the free-form answer protocol (docs/open_qa.md)
    try:
        run(cfg)
    except (NonFiniteLoss, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
