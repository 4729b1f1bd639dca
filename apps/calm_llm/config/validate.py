"""Every check of a configuration, flags and files alike, before any model loads: each value
alone (type, choices, finite, sign), each section, each registered method's own ``validate``,
``--select``, the combinations that cannot work, then the paths. Raises `ConfigError` naming
the option, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import re
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .. import methods, solvers, task_table
from ..data import open_qa, sources
from .entry_options import plugin_fields, plugin_flag, selectable_options
from .schema import (
    Config,
    ModelConfig,
    data_files,
    data_hub,
    flag_of,
    leaf_fields,
    require,
    type_of,
    with_overrides,
)


def validate(cfg: Config) -> None:
    """Raise ConfigError for any value or combination that cannot work. Loads nothing heavy.

    Each value alone (`_check_fields`), each section (run, model, data, train), each method's
    own options (``MethodInfo.validate``), then what only a combination of sections rules out.
    """
    _check_fields(cfg)
    _check_run(cfg)
    _check_model(cfg.model)
    _check_data(cfg)
    _check_train(cfg)
    for check in dict.fromkeys(i.validate for i in methods.METHODS.values() if i.validate):
        check(cfg)
    # each solver's and linear solver's own options (`SolverInfo.validate`), a plugin's alike
    for table in (solvers.SOLVERS, solvers.LINEAR_SOLVERS):
        for info in table.values():
            if getattr(info, "validate", None) is not None:
                info.validate(cfg)
    select_grid(cfg)  # raises ConfigError for a bad --select
    _check_combinations(cfg)
    _check_paths(cfg)  # last: a combination that cannot work is worth saying before a typo'd path


def trained(cfg: Config) -> list[str]:
    """The methods of ``--methods`` that take optimizer steps."""
    table = methods.METHODS
    return [m for m in cfg.methods if m in table and table[m].trains]


def _check_fields(cfg: Config) -> None:
    """Every option alone (the methods' own too): one of its choices, finite, and (but
    --split-seed) not negative."""
    every = [(getattr(cfg, sec) if sec else cfg, f, flag_of(f), False) for sec, f in leaf_fields()]
    # a method's own options may be negative: its `validate` says what they may not be
    every += [(obj, f, plugin_flag(m, f), True) for m, obj, f in plugin_fields(cfg)]
    for obj, f, name, sign_free in every:
        value = getattr(obj, f.name)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {list(choices)}")
        if isinstance(value, float) and not math.isfinite(value):
            # nan compares false with everything, so it would slip through every check below
            raise ConfigError(f"{name}: must be a finite number, got {value}")
        negative_ok = sign_free or f.name == "split_seed"  # -1 = follow --seed
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0 \
                and not negative_ok:
            raise ConfigError(f"{name}: must be >= 0, got {value}")


def _check_run(cfg: Config) -> None:
    """The run's own options: known methods, seeds, bins, device, optional packages."""
    known = methods.names()
    require(len(cfg.methods) > 0, "--methods: give at least one method")
    for m in cfg.methods:
        require(m in known, f"--methods: unknown method {m!r} (known: {list(known)})")
    require(len(set(cfg.methods)) == len(cfg.methods), "--methods: a method is listed twice")
    require(cfg.split_seed >= -1, f"--split-seed: must be >= 0, or -1 to follow --seed, got "
           f"{cfg.split_seed}")
    require(cfg.n_bins >= 1, f"--n-bins: must be at least 1, got {cfg.n_bins}")
    require(cfg.n_bins <= MAX_BINS, f"--n-bins: at most {MAX_BINS:,}, got {cfg.n_bins:,} (each "
           "ECE holds n_bins·K float64 sums per evaluation set)")
    # one resample has no spread: the interval's quantiles need at least two
    require(cfg.n_boot != 1, "--n-boot: must be 0 (no intervals) or at least 2, got 1")
    require(cfg.n_boot <= MAX_BOOT, f"--n-boot: at most {MAX_BOOT:,} resamples, got "
           f"{cfg.n_boot:,} (each is one metric evaluation per metric and evaluation set)")
    require(DEVICE.fullmatch(cfg.device) is not None,
           f"--device: {cfg.device!r} is not one of auto, cpu, mps, cuda, cuda:N")
    _check_device_present(cfg.device)
    if cfg.report_to == "tensorboard":
        require(importlib.util.find_spec("tensorboard") is not None,
               "--report-to tensorboard: needs the tensorboard package (pip install tensorboard)")


# sizes beyond any use that would only fail later in the allocator (or run for days): 10⁵ bins
# are finer than any confidence a test set of this size resolves; 10⁶ resamples put a 95%
# interval's ends within ±0.1% of the exact bootstrap quantiles
MAX_BINS = 100_000
MAX_BOOT = 1_000_000


def _check_device_present(device: str) -> None:
    """``--device cuda``/``mps`` on a machine without one: named now, not torch's assertion at
    model load (torch is imported only when such a device is asked for)."""
    if not device.startswith(("cuda", "mps")):
        return
    import torch

    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        require(index < n, f"--device {device}: this machine has "
               f"{'no CUDA device' if n == 0 else f'{n} CUDA device(s) (0..{n - 1})'}"
               " (or torch was built without CUDA); use --device cpu or auto")
    else:
        require(torch.backends.mps.is_available(),
               f"--device {device}: MPS is not available here; use --device cpu or auto")


def _check_model(m: ModelConfig) -> None:
    require(m.max_length >= 8, "--max-length: must be at least 8")
    require(m.lora_r >= 1, "--lora-r: must be at least 1")
    require(m.lora_alpha > 0, "--lora-alpha: must be positive")
    require(m.lora_dropout < 1, "--lora-dropout: must be < 1")
    require(len(m.lora_target_modules) > 0, "--lora-target-modules: give at least one module")
    require(m.tiny_hidden >= 8 and m.tiny_layers >= 1, "--tiny-hidden/--tiny-layers too small")
    # the tiny model has 4 attention heads of even size (rotary embeddings pair the dimensions)
    require(m.tiny_hidden % 8 == 0,
           f"--tiny-hidden: must be a multiple of 8 (4 heads of even size), got {m.tiny_hidden}")
    if m.quantization != "none":
        require(
            importlib.util.find_spec("bitsandbytes") is not None,
            f"--quantization {m.quantization}: needs the bitsandbytes package "
            "(pip install bitsandbytes; CUDA only)",
        )


def _check_data(cfg: Config) -> None:
    """Sources are known (or given a file / hub name), split sizes can be drawn."""
    d = cfg.data
    # the collator letters options A..J
    require(2 <= d.max_options <= 10, f"--max-options: must be in 2..10, got {d.max_options}")
    require(len(d.in_domain) > 0, "--in-domain: give at least one source")
    both = sorted(set(d.in_domain) & set(d.out_of_domain))
    require(not both, f"--in-domain and --out-of-domain share {both}: a set is one or the other")
    if d.out_of_domain:
        require(d.n_ood >= 1, "--n-ood: need at least 1 question per out-of-domain source "
               "(or give no --out-of-domain sources)")
    files, hub = data_files(cfg), data_hub(cfg)
    _check_methods_apply(cfg)
    if task_table.info(cfg.task).source_kind == "open_qa":  # the task reads open-QA sources
        _check_open_qa(cfg, files, hub)
        return
    for src in [*d.in_domain, *d.out_of_domain]:
        require(
            src in sources.source_names("mcqa") or src in files or src in hub,
            f"unknown MCQA source {src!r}: one of {list(sources.source_names())}, or give its file with "
            f"--data-files {src}=PATH or its hub name with --data-hub {src}=ORG/NAME",
        )
    if d.instruction_data:
        require(
            d.instruction_data in files or d.instruction_data in hub
            # a registered instruction source with an offline copy (e.g. trivia_qa_sft)
            or d.instruction_data in open_qa.offline_instruction_sources(),
            f"--instruction-data {d.instruction_data!r}: give its file with --data-files "
            f"{d.instruction_data}=PATH or its hub name with --data-hub, or name an offline "
            f"instruction source: {list(open_qa.offline_instruction_sources())}",
        )
    require(d.n_calib >= 2, "--n-calib: need at least 2 calibration questions")
    require(d.n_test >= 1, "--n-test: need at least 1 test question per in-domain source")


def _check_methods_apply(cfg: Config) -> None:
    """Every --methods entry applies to --task (its ``MethodInfo.tasks``)."""
    table = methods.METHODS
    for m in cfg.methods:
        require(m not in table or task_table.applies(table[m].tasks, cfg.task),
               f"--methods {m}: does not apply to --task {cfg.task} ({m} runs under --task "
               f"{' / '.join(table[m].tasks or ())}); methods of --task {cfg.task}: "
               f"{[n for n, i in table.items() if task_table.applies(i.tasks, cfg.task)]}")


def _check_open_qa(cfg: Config, files: dict[str, str], hub: dict[str, str]) -> None:
    """``--task open_qa``: open-QA sources, sampling options, methods that apply."""

    d, q = cfg.data, cfg.open_qa
    for src in [*d.in_domain, *d.out_of_domain]:
        require(
            src in open_qa.open_qa_source_names(offline=True) or src in files or src in hub,
            f"--task open_qa: {src!r} is not an open-QA source available offline (offline: "
            f"{list(open_qa.open_qa_source_names(offline=True))}); give its file with "
            f"--data-files {src}=PATH or its hub name with --data-hub {src}=ORG/NAME",
        )
    require(not d.instruction_data, "--task open_qa trains on the open-QA questions themselves; "
           "drop --instruction-data")
    require(d.n_calib >= 2, "--n-calib: need at least 2 calibration questions")
    require(d.n_test >= 1, "--n-test: need at least 1 test question per in-domain source")
    require(q.n_samples >= 2, f"--n-samples: need at least 2 samples per question, got {q.n_samples}")
    require(q.sample_temperature > 0, "--sample-temperature: must be positive")
    require(0 < q.top_p <= 1, f"--top-p: must be in (0, 1], got {q.top_p}")
    require(q.max_new_tokens >= 1 and q.gen_batch_size >= 1,
           "--max-new-tokens and --gen-batch-size: must be at least 1")
    require(0 < q.cluster_threshold <= 1, "--cluster-threshold: must be in (0, 1]")
    require(q.split_half_splits >= 1, "--split-half-splits: must be at least 1")
    require((q.match == "judge") == bool(q.judge_model),
           "--match judge needs --judge-model NAME (a hub name, folder, smollm2 or tiny)"
           if q.match == "judge" else
           f"--judge-model is read only with --match judge (got --match {q.match})")


def _check_train(cfg: Config) -> None:
    """The shared training options (each method's own are its ``MethodInfo.validate``)."""
    t = cfg.train
    trains = trained(cfg)
    if trains:
        require(t.steps >= 1, f"--steps: must be >= 1 to train {trains}")
        require(cfg.data.n_train >= 1, f"--n-train: must be >= 1 to train {trains}")
    require(t.lr > 0, f"--lr: must be positive, got {t.lr}")
    require(t.batch_size >= 1 and t.eval_batch_size >= 1, "batch sizes must be at least 1")
    require(t.eval_tokens >= 1, f"--eval-tokens: must be at least 1, got {t.eval_tokens}")
    require(t.grad_accum >= 1, "--grad-accum: must be at least 1")
    require(t.warmup_ratio < 1, "--warmup-ratio: must be < 1")


def _check_combinations(cfg: Config) -> None:
    """What no section rules out alone: sharding with quantized weights or second order."""
    if cfg.fsdp:
        require(cfg.model.quantization == "none",
               f"--fsdp with --quantization {cfg.model.quantization}: quantized base weights "
               "cannot be sharded; use --fsdp in bf16, or DDP (no --fsdp) with --quantization 4bit")
        require(not needs_second_order(cfg),
               f"--fsdp with --solver {cfg.calm.solver}: the second-order solvers run "
               "single-process only")


DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


# a local folder is named like a path; anything else must look like a hub name ORG/NAME
_PATH_LIKE = ("/", "./", "../", "~", ".\\")


_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


def _check_paths(cfg: Config) -> None:
    """Files and folders named by the options exist (and are the right kind) before any loading."""
    for e in cfg.data.data_files:
        if "=" in e:
            name, path = e.split("=", 1)
            require(Path(path).is_file(), f"--data-files {e}: no such file {path!r} for {name!r}")
    model = cfg.model.name_or_path
    if model not in ("smollm2", "tiny") and not model.startswith("random:"):  # random: synthetic.py
        if model.startswith(_PATH_LIKE) or Path(model).exists():
            require(Path(model).expanduser().is_dir(),
                   f"--model {model}: no such folder (give a model folder, a hub name ORG/NAME, "
                   "'smollm2' or 'tiny')")
        else:
            require(_HUB_NAME.fullmatch(model) is not None,
                   f"--model {model!r}: neither a folder nor a hub name of the form ORG/NAME")
    for flag, value in (("--out", cfg.out), ("--resume", cfg.resume)):
        require(not value or not Path(value).exists() or Path(value).is_dir(),
               f"{flag} {value}: a file is there, not a run directory; choose another path")
    require(not cfg.force_resume or bool(cfg.resume), "--force-resume: only with --resume DIR")


def needs_second_order(cfg: Config) -> bool:
    """True when some method differentiates through gradients (eager attention required)."""
    table = methods.METHODS
    return any(table[m].second_order(cfg) for m in cfg.methods if m in table)


def select_grid(cfg: Config) -> list[dict[str, Any]]:
    """``--select KEY=V1,V2 ...`` as the list of ``{section.field: value}`` points of the grid
    (the cartesian product of the entries); ``[]`` without --select.

    Keys are option names as in the CLI without dashes (``eta``, ``alpha_lr``, ``alpha-decay``;
    a solver's own options by their flag, ``eta``, ``itd_truncate``: ``calm.eta`` in a point);
    values are parsed with the option's type and validated like the option itself.
    """
    if not cfg.select:
        return []
    by_name = {f.name: (sec, f) for sec, f in leaf_fields() if sec}
    # the solvers' own options, which were calm options: ``eta``, ``itd_truncate``, ``cg_maxiter``
    by_name.update({k: ("calm", f) for k, (_, f) in selectable_options().items()
                    if k not in by_name})
    axes: list[list[tuple[str, Any]]] = []
    seen: set[str] = set()
    for entry in cfg.select:
        require("=" in entry, f"--select: expected KEY=V1,V2,..., got {entry!r}")
        key, values = entry.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        require(key in by_name and by_name[key][0] in ("train", "calm"),
               f"--select {entry}: {key!r} is not a train or calm option")
        require(key not in seen, f"--select: {key!r} is given twice")
        seen.add(key)
        sec, f = by_name[key]
        t = type_of(f)
        require(t in (int, float, str), f"--select {entry}: {key} is not a number or choice option")
        parsed = []
        for v in (x.strip() for x in values.split(",")):
            try:
                parsed.append(t(v))
            except ValueError:
                raise ConfigError(f"--select {entry}: {v!r} is not a valid {t.__name__}") from None
        require(len(parsed) >= 2 and len(set(parsed)) == len(parsed),
               f"--select {entry}: give at least two distinct values")
        axes.append([(f"{sec}.{key}", v) for v in parsed])
    require(bool(trained(cfg)),
           "--select: no trained method in --methods to select for")

    points = [dict(p) for p in itertools.product(*axes)]
    for point in points:  # each value must pass the option's own validation
        try:
            validate(dataclasses.replace(with_overrides(cfg, point), select=[]))
        except ConfigError as e:
            raise ConfigError(f"--select {point}: {e}") from None
    return points
