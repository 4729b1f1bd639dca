"""The command line and config files: the argparse parser built from the dataclasses of
`schema` (the registered entries' own options included), YAML/JSON files and presets, plugins.

Precedence: dataclass defaults < ``--config FILE`` (YAML or JSON, nested by section, or a preset
name such as ``tiny``) < explicit command-line flags; `parse_args` then runs `validate.validate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Hashable
from dataclasses import fields
from pathlib import Path
from typing import Any

from ...errors import ConfigError, PluginError
from .. import task_table
from .entry_options import (
    legacy_flags,
    moved_options,
    option_classes,
    plugin_fields,
    plugin_flag,
    with_method_defaults,
)
from .schema import (
    CONFIG_DIR,
    SECTIONS,
    Config,
    flag_of,
    leaf_fields,
    type_of,
)
from .validate import validate


def _set_method_options(cfg: Config, value: Any) -> None:
    """Apply a ``plugin_options: {method: {field: value}}`` mapping (a file, config.json, flags)."""
    if not isinstance(value, dict):
        raise ConfigError(f"plugin_options: expected a mapping of methods, got {value!r}")
    classes = option_classes()
    for method, values in value.items():
        if method not in classes:
            raise ConfigError(f"plugin_options.{method}: no registered method, solver, linear "
                              f"solver or upper loss {method!r} declares options (with options: "
                              f"{sorted(classes)}; a plugin's module is loaded by --plugins)")
        if not isinstance(values, dict):
            raise ConfigError(f"plugin_options.{method}: expected a mapping of options, got {values!r}")
        obj = dataclasses.replace(cfg.plugin_options.get(method) or classes[method]())
        sub = {f.name: f for f in fields(obj)}
        for k, v in values.items():
            if k not in sub:
                raise ConfigError(f"unknown option plugin_options.{method}.{k!r} (known: {sorted(sub)})")
            setattr(obj, k, _coerce(f"plugin_options.{method}.{k}", sub[k], v))
        cfg.plugin_options[method] = obj


def _help(f: dataclasses.Field) -> str:
    """The option's help text, with the names its entries may take when it has ``names``."""
    names = f.metadata.get("names")
    return f.metadata["help"] + (f", from {', '.join(names())}" if names else "")


def _add_flag(group: Any, flag: str, f: dataclasses.Field, dest: str) -> None:
    """One option's flag: its type, choices and help with the default; absent unless given."""
    t = type_of(f)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    kw: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS,
                          "help": f"{_help(f)} (default: {default!r})"}
    if t is not bool and not f.metadata.get("choices"):
        kw["metavar"] = f.name.upper()
    if f.metadata.get("choices"):
        kw["choices"] = f.metadata["choices"]
    if t is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif t is list:
        kw["nargs"] = "*"
    else:
        kw["type"] = t
    group.add_argument(flag, **kw)


def build_parser() -> argparse.ArgumentParser:
    """argparse parser with one flag per field; help shows the default. Unset flags are absent."""
    p = argparse.ArgumentParser(
        prog="python -m apps.calm_llm",
        description="CALM: bilevel calibration of an LLM, with baselines and ablations, "
        "evaluated in-domain and out-of-domain.",
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML/JSON file (nested by section) or preset name "
        "(default, tiny, paper-7b); command-line flags override it",
    )
    seen: set[str] = set()
    groups: dict[str | None, Any] = {None: p.add_argument_group("run")}
    for sec in SECTIONS:
        groups[sec] = p.add_argument_group(sec)
    for sec, f in leaf_fields():
        flag = flag_of(f)
        if flag in seen:  # a programming error: flat CLI needs unique names
            raise RuntimeError(f"duplicate flag {flag}")
        seen.add(flag)
        _add_flag(groups[sec], flag, f, f"{sec}.{f.name}" if sec else f.name)
    plugin_cfg = with_method_defaults(Config())
    for method, _obj, f in plugin_fields(plugin_cfg):
        flag = plugin_flag(method, f)
        if flag in seen:
            raise ConfigError(f"method {method!r}: its option flag {flag} is taken")
        seen.add(flag)
        if method not in groups:
            groups[method] = p.add_argument_group(f"{method} (its own options)")
        _add_flag(groups[method], flag, f, f"plugin_options.{method}.{f.name}")
    return p


def resolve_config_file(name: str) -> Path:
    """A path, or a preset name from apps/calm_llm/configs/."""
    path = Path(name)
    if path.is_file():
        return path
    for cand in (CONFIG_DIR / f"{name}.yaml", CONFIG_DIR / f"{name}.json"):
        if cand.is_file():
            return cand
    presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if not p.stem.startswith("accelerate"))
    raise ConfigError(f"--config: no file {name!r} and no preset of that name (presets: {presets})")


def _object_key_lines(text: str, start: int, key: str) -> list[int]:
    """The 1-based lines where ``key`` is a key of the JSON object whose body starts at
    ``text[start]`` (its own keys only: nested objects and strings are skipped)."""
    depth, i, lines = 0, start, []
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if depth == 0 and text[j + 1:].lstrip().startswith(":") and json.loads(text[i:j + 1]) == key:
                lines.append(text.count("\n", 0, i) + 1)
            i = j + 1
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            if depth == 0:
                break
            depth -= 1
        i += 1
    return lines


def _strict_json(text: str) -> Any:
    """`json.loads` refusing a key given twice in one object, with its two lines: json's pairs
    hook gives no position, so each object's parse is wrapped to know where it starts."""
    import json.decoder
    import json.scanner

    decoder = json.JSONDecoder(object_pairs_hook=_json_pairs)

    def parse_object(s_and_end: tuple[str, int], *args: Any) -> Any:
        try:
            return json.decoder.JSONObject(s_and_end, *args)
        except _DuplicateKey as e:
            if e.first is None:  # the innermost object with the repeat names the lines
                e.first, e.second = _object_key_lines(*s_and_end, e.key)[:2]
            raise

    decoder.parse_object = parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)  # the one that calls parse_object
    return decoder.decode(text)


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    """json's ``object_pairs_hook``: one object never names a key twice."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k, None, None)
        out[k] = v
    return out


class _DuplicateKey(Exception):
    """A key given twice in one mapping: its name, its first and second line (1-based)."""

    def __init__(self, key: Any, first: int | None, second: int | None) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _strict_yaml_loader() -> type:
    """A `yaml.SafeLoader` whose mappings refuse a key given twice (PyYAML keeps the last one
    silently, so ``train: {steps: 4}`` then ``train: {steps: 8}`` would run 8 steps)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:  # the keys written here ("<<" merges may be
                    if key_node.tag == "tag:yaml.org,2002:merge":  # overridden: YAML's rule)
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    if isinstance(key, Hashable) and key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    if isinstance(key, Hashable):
                        seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _parse_text(path: Path, text: str) -> Any:
    """JSON (by suffix) or YAML; a syntax error or a key given twice names the line."""
    fix = "keep one of them (the file would otherwise silently use the last)"
    if path.suffix == ".json":
        try:
            return _strict_json(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--config {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
            ) from e
        except _DuplicateKey as e:
            raise ConfigError(f"--config {path}: key {e.key!r} given twice in one object (line "
                              f"{e.first} and line {e.second}); {fix}") from None
    import yaml

    try:
        return yaml.load(text, Loader=_strict_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as e:
        raise ConfigError(f"--config {path}: key {e.key!r} given twice in one mapping (line "
                          f"{e.first} and line {e.second}); {fix}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"--config {path}: not valid YAML ({problem}{at})") from e


def load_file(path: str | Path) -> dict:
    """Read a YAML or JSON config file into a (nested) dict; a key given twice in one mapping
    (at any depth) is refused with the key and its lines."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    data = _parse_text(path, text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of options")
    return data


def _coerce(name: str, f: dataclasses.Field, value: Any) -> Any:
    t = type_of(f)
    if t is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [str(v) for v in value]
    if t is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true/false, got {value!r}")
        return value
    if t is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if t is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if t is str and isinstance(value, str):
        return value
    raise ConfigError(f"{name}: expected {t.__name__}, got {value!r}")


def from_dict(data: dict, base: Config | None = None) -> Config:
    """Apply a nested dict (as in config.json / YAML presets) on top of `base` (default: defaults)."""
    cfg = base if base is not None else Config()
    cfg = dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s)) for s in SECTIONS},
        plugin_options=dict(cfg.plugin_options),
    )
    if isinstance(data.get("plugins"), list):  # they register the methods plugin_options names
        load_plugins([str(m) for m in data["plugins"]])
    data = moved_options(data)  # an older config.json: options since moved into entries
    top = {f.name: f for f in fields(Config)}
    for key, value in data.items():
        if key not in top:
            raise ConfigError(f"unknown option {key!r} (known: {sorted(top)})")
        if key == "plugin_options":
            _set_method_options(cfg, value)
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of options, got {value!r}")
            sec = getattr(cfg, key)
            sub = {f.name: f for f in fields(sec)}
            for k, v in value.items():
                if k not in sub:
                    raise ConfigError(f"unknown option {key}.{k!r} (known: {sorted(sub)})")
                setattr(sec, k, _coerce(f"{key}.{k}", sub[k], v))
        else:
            setattr(cfg, key, _coerce(key, top[key], value))
    return with_method_defaults(cfg)


def parse_args(argv: list[str] | None = None) -> Config:
    """defaults < --config FILE < CLI flags; then `validate`."""
    # plugins first: the choices they register (an α parameterization, a source) must exist
    # when argparse checks the other flags
    load_plugins(_plugins_in(sys.argv[1:] if argv is None else argv))
    ns = vars(build_parser().parse_args(argv))
    cfg = Config()
    config_file = ns.pop("config", None)
    if config_file is None and ns.get("task"):
        # --task NAME alone runs the task's own default configuration (open QA's: open_qa)
        config_file = task_table.info(ns["task"]).default_config or None
    if config_file:
        cfg = from_dict(load_file(resolve_config_file(config_file)), cfg)
    nested: dict[str, Any] = {}
    for dest, value in ns.items():
        if dest.startswith("plugin_options."):
            _, method, name = dest.split(".", 2)
            nested.setdefault("plugin_options", {}).setdefault(method, {})[name] = value
        elif "." in dest:
            sec, name = dest.split(".", 1)
            nested.setdefault(sec, {})[name] = value
        else:
            nested[dest] = value
    cfg = from_dict(nested, cfg)
    # an old command line's --cg-maxiter with --linear-solver neumann: Neumann's, as it was
    cfg = legacy_flags(cfg, nested.get("plugin_options", {}))
    load_plugins(cfg.plugins)
    validate(cfg)
    return cfg


def _plugins_in(argv: list[str]) -> list[str]:
    """The module names after ``--plugins`` (or ``--plugins=M``) in a raw argument list."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a.startswith("--plugins="):
            out.append(a.split("=", 1)[1])
        elif a == "--plugins":
            out += [x for x in itertools.takewhile(lambda x: not x.startswith("-"), argv[i + 1:])]
    return out


def load_plugins(modules: list[str]) -> None:
    """Import each ``--plugins`` module (once): importing it registers what it defines, e.g.
    ``methods.register(MethodInfo(...))``. A module that cannot be imported, or that raises
    while it runs, is a `PluginError` naming it, with the plugin's own error as its cause
    (the CLI shows that traceback: the bug is in the plugin)."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                # the plugin itself is not there (a typo, a deleted file, a folder not on the
                # path): nothing of the user's code ran, so one line and no traceback
                raise ConfigError(
                    f"--plugins {name}: no module {name!r} can be imported (a run resumed "
                    "from its config.json imports the plugins it was started with); check the "
                    "name, and that its folder is on PYTHONPATH or the current directory"
                ) from None
            raise PluginError(f"--plugins {name}: cannot import it, it needs a module that is "
                              f"missing ({type(e).__name__}: {e})") from e
        except Exception as e:  # any error of the plugin's code: its traceback is kept
            raise PluginError(f"--plugins {name}: cannot import it "
                              f"({type(e).__name__}: {e})") from e


def options_markdown() -> str:
    """The options tables of docs/calm.md, from the fields (a test keeps the doc equal to it):
    one per section, then one per registered entry that declares its own options."""
    groups: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for sec, f in leaf_fields():
        groups.setdefault(sec or "run", []).append((flag_of(f), f))
    for name, _obj, f in plugin_fields(with_method_defaults(Config())):
        groups.setdefault(f"{name} (its own options)", []).append((plugin_flag(name, f), f))
    blocks = []
    for title, entries in groups.items():
        rows = ["| flag | default | meaning |", "|---|---|---|"]
        for flag, f in entries:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meaning = _help(f)
            if f.metadata.get("choices"):
                meaning += f" ({' / '.join(f.metadata['choices'])})"
            rows.append(f"| `{flag}` | `{default!r}` | {meaning.replace('|', '/')} |")
        blocks.append(f"**{title}**\n\n" + "\n".join(rows))
    return "\n\n".join(blocks) + "\n"
