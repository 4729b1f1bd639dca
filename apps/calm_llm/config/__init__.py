"""The configuration of `python -m apps.calm_llm`, settable from the CLI and from files.

Three parts, one job each:

* `schema`: the dataclasses (``Config`` and its sections), ``opt`` to declare an option, and
  what is derived from a configuration (``hash``, ``comparable``, ``--select`` row names);
* `cli`: the parser (one flag per field; the registered entries' own options as
  ``--<name>-<field>``), config files and presets, ``--plugins``; ``parse_args`` is
  defaults < ``--config FILE`` < flags, then validation;
* `validate`: every check, before any model loads, raising `ConfigError` naming the option.

The names below are the public surface; import them from here.
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError, PluginError
from .. import methods
from .cli import (
    build_parser,
    from_dict,
    load_file,
    load_plugins,
    options_markdown,
    parse_args,
    resolve_config_file,
)
from .schema import (
    CONFIG_DIR,
    EVAL_ONLY,
    MCQA_SOURCES,
    RUN_ONLY,
    SECTIONS,
    CalmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OpenQAConfig,
    TrainConfig,
    calib_batch_size,
    data_files,
    data_hub,
    differences,
    flag_of,
    leaf_fields,
    opt,
    split_seed,
    variant_name,
    with_overrides,
)
from .validate import needs_second_order, select_grid, trained, validate

__all__ = [
    "CONFIG_DIR", "EVAL_ONLY", "MCQA_SOURCES", "RUN_ONLY", "SECTIONS", "CalmConfig", "Config",
    "ConfigError", "DataConfig", "ModelConfig", "OpenQAConfig", "PluginError", "TrainConfig",
    "build_parser", "calib_batch_size", "data_files", "data_hub", "differences", "from_dict",
    "load_file", "load_plugins", "needs_second_order", "opt", "options_markdown", "parse_args",
    "resolve_config_file", "select_grid", "split_seed", "trained", "validate", "variant_name",
    "with_overrides", "flag_of", "leaf_fields",
]


def __getattr__(name: str) -> Any:
    if name == "METHODS":  # every registered method, in order; plugins add to it
        return methods.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
