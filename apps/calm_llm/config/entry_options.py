"""The registered entries' own options: every table whose entries may declare an options
dataclass (methods, solvers, linear solvers, upper losses, α parameterizations), which entry's
options a run uses (and so compares and hashes), and what keeps the configurations written
before an option moved into its entry loading, resuming and hashing as they did.

An entry declares ``Info.options`` (a dataclass of `opt` fields); its fields are the flags
``--<name>-<field>`` (or the field's ``flag``), held in ``Config.plugin_options[name]``. The
built-in entries declare theirs exactly as a plugin does: `bome` (``--eta``, ``--phi``,
``--c``), `itd` (``--itd-truncate``), `cg` (``--cg-maxiter``, ``--cg-tol``), `neumann`
(``--neumann-terms``, ``--neumann-tol``), `label_smoothing`, `rcft`.

Torch-free (the tables are); `schema` (the hash) and `cli` (flags, files) read this module.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import fields
from typing import Any

from calibration import alpha_table  # torch-free: the α names and options

from ...errors import ConfigError
from .. import methods, solvers  # torch-free: the method and solver tables
from ..methods.upper import UPPER_LOSSES  # torch-free: the upper-loss table
from ..option import opt

# Entries whose options were section fields before they moved into the entry: they are
# compared (and hashed) in every run, as they were, so that no run's hash changed. The
# methods' moved out of `train` in issue 27; the solvers' out of `calm` (their flags kept).
ALWAYS_COMPARED = ("label_smoothing", "rcft", "bome", "itd", "cg")

# An entry option hashed under another flag than its own: ``neumann`` read ``--cg-maxiter`` and
# ``--cg-tol`` before it had ``--neumann-terms`` and ``--neumann-tol``, so a Neumann run hashes
# its own values under those names (they replace cg's, which such a run does not use), and an
# old Neumann run's hash and checkpoints stay valid. {(entry, field): flag in the hash}
HASHED_AS: dict[tuple[str, str], str] = {
    ("neumann", "terms"): "--cg-maxiter",
    ("neumann", "tol"): "--cg-tol",
}

# A configuration (config.json, a file) written before an option moved into its entry names it
# in its section: {section: {old field: [(entry, field), ...]}}. ``cg_maxiter``/``cg_tol`` were
# read by both cg and Neumann, so each old value goes to both (what each read then).
MOVED_OPTIONS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "train": {
        "label_smoothing": [("label_smoothing", "epsilon")],
        "label_smoothing_scope": [("label_smoothing", "scope")],
        "rcft_weight": [("rcft", "weight")],
        "rcft_scale": [("rcft", "scale")],
        "rcft_bins": [("rcft", "bins")],
        "rcft_reestimate_every": [("rcft", "reestimate_every")],
        "rcft_include_top_bin": [("rcft", "include_top_bin")],
    },
    "calm": {
        "eta": [("bome", "eta")],
        "phi": [("bome", "phi")],
        "c": [("bome", "c")],
        "itd_truncate": [("itd", "truncate")],
        "cg_maxiter": [("cg", "maxiter"), ("neumann", "terms")],
        "cg_tol": [("cg", "tol"), ("neumann", "tol")],
    },
}

# Flags of one entry that an old command line gave for another: ``--cg-maxiter``/``--cg-tol``
# with ``--linear-solver neumann`` set Neumann's terms and tolerance before it had its own
# flags. {entry in use: {other entry: {its field: this entry's field}}}
LEGACY_FLAGS: dict[str, dict[str, dict[str, str]]] = {
    "neumann": {"cg": {"maxiter": "terms", "tol": "tol"}},
}

# the entry tables whose options `--select` takes, as ``calm.<flag name>`` (they were `calm`
# options): the solvers' and linear solvers'
SELECTABLE_KINDS = ("solver", "linear solver")


def _declared(table: Any) -> dict[str, type]:
    """{name: options dataclass} of the entries of a registry that declare one."""
    return {n: i.options for n, i in table.items() if getattr(i, "options", None) is not None}


# the α options every run has (``--alpha-form``, ``--alpha-positivity``, ``--alpha-tau-max``)
ALPHA_RUN_OPTIONS = ("form", "positivity", "tau_max")
_ALPHA_CLASSES: dict[tuple[str, int], type] = {}


def _alpha_options() -> dict[str, type]:
    """{name: options dataclass} of the α parameterizations that declare options beyond
    `ALPHA_RUN_OPTIONS` (a plugin's): one field per such `alpha_table.Option`, its default and
    choices, so it gets a ``--<name>-<option>`` flag like every entry's own option."""
    out: dict[str, type] = {}
    for name, spec in alpha_table.SPECS.items():
        extra = {k: o for k, o in spec.options.items() if k not in ALPHA_RUN_OPTIONS}
        if not extra:
            continue
        key = (name, id(spec))  # one class per registration: a replaced entry gets its own
        if key not in _ALPHA_CLASSES:
            _ALPHA_CLASSES[key] = dataclasses.make_dataclass(f"{name}_options", [
                (k, type(o.default), opt(o.default, f"α {name}: its option {k!r}",
                                         choices=tuple(o.choices) if o.choices else None))
                for k, o in extra.items()])
        out[name] = _ALPHA_CLASSES[key]
    return out


def _option_tables() -> tuple[tuple[str, dict[str, type], Any], ...]:
    """(kind, {name: options dataclass}, in_use(cfg, name)) of every table whose entries may
    declare options: an entry's options are compared on resume (and hashed) only when
    ``in_use`` (or always, `ALWAYS_COMPARED`)."""
    return (
        ("method", _declared(methods.METHODS), lambda cfg, name: name in cfg.methods),
        ("solver", _declared(solvers.SOLVERS), lambda cfg, name: cfg.calm.solver == name),
        ("linear solver", _declared(solvers.LINEAR_SOLVERS),
         lambda cfg, name: cfg.calm.linear_solver == name),
        ("upper loss", _declared(UPPER_LOSSES), lambda cfg, name: cfg.calm.upper_loss == name),
        ("alpha parameterization", _alpha_options(),
         lambda cfg, name: cfg.calm.alpha_param == name),
    )


def option_classes() -> dict[str, type]:
    """{name: options dataclass} of every registered entry that declares one."""
    out: dict[str, type] = {}
    for kind, classes, _ in _option_tables():
        for name, cls in classes.items():
            if name in out and out[name] is not cls:  # one flag namespace: --<name>-<field>
                raise ConfigError(f"{kind} {name!r} declares options, and so does another "
                                  "entry of that name: rename one (flags are --<name>-<field>)")
            out[name] = cls
    return out


def plugin_flag(entry: str, f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f"--{entry}-{f.name}".replace("_", "-")


def plugin_fields(cfg: Any) -> list[tuple[str, Any, dataclasses.Field]]:
    """(entry, its options object, field) for every option of an entry's own options."""
    return [(m, obj, f) for m, obj in cfg.plugin_options.items() for f in fields(obj)]


def with_method_defaults(cfg: Any) -> Any:
    """Add the defaults of every registered entry's options that `cfg` does not hold yet."""
    for entry, cls in option_classes().items():
        if entry not in cfg.plugin_options:
            cfg.plugin_options[entry] = cls()
    return cfg


def compared_entry_options(cfg: Any) -> dict[str, Any]:
    """``{flag: value}`` of the entries' own options that `cfg` uses (`Config.comparable`):
    an entry in use or in `ALWAYS_COMPARED`, each option under its flag or its `HASHED_AS`
    name; those renamed are written last, so they replace what the old name held."""
    used = {name for _, classes, in_use in _option_tables() for name in classes
            if in_use(cfg, name) or name in ALWAYS_COMPARED}
    out: dict[str, Any] = {}
    renamed: dict[str, Any] = {}
    for name, obj, f in plugin_fields(cfg):
        if name not in used:
            continue
        if (name, f.name) in HASHED_AS:
            renamed[HASHED_AS[name, f.name]] = getattr(obj, f.name)
        else:
            out[plugin_flag(name, f)] = getattr(obj, f.name)
    return {**out, **renamed}


def moved_options(data: dict) -> dict:
    """A configuration written before an option moved from its section into its entry's own
    options (`MOVED_OPTIONS`) read as if written after: ``train.rcft_weight`` is
    ``plugin_options.rcft.weight``, ``calm.eta`` ``plugin_options.bome.eta``, ``calm.cg_maxiter``
    both ``plugin_options.cg.maxiter`` and ``plugin_options.neumann.terms`` (so an older run's
    config.json still loads and resumes). A value given in the new place wins."""
    sections = {s: data[s] for s in MOVED_OPTIONS
                if isinstance(data.get(s), dict) and set(data[s]) & set(MOVED_OPTIONS[s])}
    if not sections:
        return data
    out = dict(data)
    plugin = {m: dict(o) for m, o in (data.get("plugin_options") or {}).items()}
    for sec, values in sections.items():
        table = MOVED_OPTIONS[sec]
        out[sec] = {k: v for k, v in values.items() if k not in table}
        for key, value in values.items():
            for entry, name in table.get(key, ()):
                plugin.setdefault(entry, {}).setdefault(name, value)
    out["plugin_options"] = plugin
    return out


def legacy_flags(cfg: Any, given: dict[str, dict[str, Any]]) -> Any:
    """Apply `LEGACY_FLAGS`: options an old command line set through another entry's flags
    (``--cg-maxiter 9 --linear-solver neumann``) go to the entry in use when its own flags
    were not given (``given``: ``{entry: {field: value}}`` of the flags given), with a
    `DeprecationWarning` naming the new flag. The run then trains and hashes as it did."""
    for entry, sources in LEGACY_FLAGS.items():
        if cfg.calm.linear_solver != entry and cfg.calm.solver != entry:
            continue
        own = given.get(entry, {})
        for other, mapping in sources.items():
            for theirs, ours in mapping.items():
                if theirs in given.get(other, {}) and ours not in own:
                    value = given[other][theirs]
                    cls = type(cfg.plugin_options[entry])
                    new = plugin_flag(entry, cls.__dataclass_fields__[ours])
                    old = plugin_flag(other, type(cfg.plugin_options[other])
                                       .__dataclass_fields__[theirs])
                    warnings.warn(f"{old} with {entry}: read as {new} {value} (its own flag "
                                  f"now; {old} is {other}'s)", DeprecationWarning, stacklevel=3)
                    cfg.plugin_options[entry] = dataclasses.replace(
                        cfg.plugin_options[entry], **{ours: value})
    return cfg


def selectable_options() -> dict[str, tuple[str, dataclasses.Field]]:
    """``{select name: (entry, field)}`` of the entry options `--select` takes: the solver and
    linear-solver entries' (`SELECTABLE_KINDS`), named by their flag without dashes
    (``eta``, ``itd_truncate``, ``cg_maxiter``), as when they were `calm` options."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for kind, classes, _ in _option_tables():
        if kind not in SELECTABLE_KINDS:
            continue
        for name, cls in classes.items():
            for f in fields(cls):
                out[plugin_flag(name, f).lstrip("-").replace("-", "_")] = (name, f)
    return out
