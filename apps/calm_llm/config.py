"""One configuration dataclass for `python -m apps.calm_llm`, settable from the CLI and from files.

Precedence: dataclass defaults < ``--config FILE`` (YAML or JSON, nested by section, or a preset
name such as ``tiny``) < explicit command-line flags. Every field becomes one flag whose name is
the field name with dashes (``alpha_support`` -> ``--alpha-support``); flag names are unique across
sections so the CLI stays flat while files and ``config.json`` stay nested.

`validate` checks every value (and the combinations that cannot work) before any model is loaded,
and raises `ConfigError` naming the option.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from calibration import alpha_table  # torch-free: the α names and options

from ..errors import ConfigError, PluginError
from . import methods, solvers  # torch-free: the method and solver tables
from .data import sources  # torch-free: the data source table
from .methods.upper import UPPER_LOSSES  # torch-free: the upper-loss table

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# The built-in names of the source table (data.sources imports without torch, so validation stays
# instant); validation reads the live table, which includes sources a user registered.
MCQA_SOURCES = sources.MCQA_SOURCES



def opt(
    default: Any, help: str, *, choices: tuple | None = None, flag: str | None = None,
    names: Any = None,
) -> Any:
    """A dataclass field carrying its CLI help text, allowed values and (optional) flag name.

    ``names``: for a list option, a function giving the names its entries may take, read when
    help is shown (a registry that plugins extend: the help lists what is registered then).
    """
    meta = {"help": help, "choices": choices, "flag": flag, "names": names}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name_or_path: str = opt(
        "smollm2",
        "model: 'smollm2' (offline SmolLM2-135M-Instruct, converted once and cached), "
        "'tiny' (random test model), a Hugging Face hub name or a local folder",
        flag="--model",
    )
    dtype: str = opt("fp32", "weights/compute dtype of the base model", choices=("fp32", "bf16"))
    quantization: str = opt(
        "none", "load the base model in 4/8 bit (QLoRA; needs bitsandbytes)",
        choices=("none", "4bit", "8bit"),
    )
    attn_implementation: str = opt(
        "auto",
        "attention kernel; 'auto' = the library default, forced to 'eager' for the "
        "second-order solvers itd/aid (fused SDPA has no double backward)",
        choices=("auto", "eager", "sdpa"),
    )
    gradient_checkpointing: bool = opt(False, "recompute activations in the backward pass")
    max_length: int = opt(256, "maximum tokens per sequence (longer prompts are truncated)")
    tiny_hidden: int = opt(32, "hidden size of the 'tiny' random model")
    tiny_layers: int = opt(2, "layers of the 'tiny' random model")
    lora_r: int = opt(8, "LoRA rank")
    lora_alpha: int = opt(16, "LoRA scaling numerator (scale = lora_alpha / lora_r)")
    lora_dropout: float = opt(0.0, "dropout on the LoRA input")
    lora_target_modules: list[str] = opt(
        ["q_proj", "v_proj"], "modules that get LoRA adapters; 'all-linear' for every linear layer"
    )


@dataclass
class DataConfig:
    mode: str = opt(
        "cloze",
        "answer scoring: 'letter' (softmax over option-letter logits, the papers') or 'cloze' "
        "(softmax over each option text's log-likelihood)",
        choices=("letter", "cloze"),
    )
    prompt_style: str = opt("paper", "prompt format", choices=("paper", "chat"))
    cloze_norm: str = opt(
        "sum", "cloze option score: summed, per-token mean or per-character log-likelihood",
        choices=("sum", "mean", "char"),
    )
    max_options: int = opt(5, "most answer options a question may have")
    share_prefix: bool = opt(
        True,
        "cloze: encode each question's context once and score its options against it (packed "
        "under a block mask, or against its KV cache where the attention kernel or FSDP needs "
        "it; off: every option repeats the question; same scores, slower)",
    )
    in_domain: list[str] = opt(["sciq"], f"in-domain MCQA sources, from {MCQA_SOURCES}")
    out_of_domain: list[str] = opt(["arc_easy"], "out-of-domain MCQA sources (test only)")
    n_train: int = opt(400, "training questions (pooled over the in-domain sources)")
    n_calib: int = opt(100, "calibration questions (TS fit, CALM upper level)")
    n_test: int = opt(120, "test questions per in-domain source")
    n_ood: int = opt(120, "test questions per out-of-domain source")
    data_files: list[str] = opt(
        [], "local files for sources, as NAME=PATH (.jsonl/.json/.csv/.parquet)"
    )
    data_hub: list[str] = opt([], "hub datasets for sources, as NAME=ORG/DATASET")
    instruction_data: str = opt(
        "",
        "instruction-style training source (Alpaca format): 'alpaca' with a local file in "
        "--data-files alpaca=PATH or --data-hub alpaca=ORG/NAME; replaces MCQA training data",
    )
    source_limit: int = opt(0, "read at most this many rows per source (0 = all)")


@dataclass
class TrainConfig:
    steps: int = opt(24, "optimizer steps per trained method")
    batch_size: int = opt(8, "training questions per micro-batch")
    calib_batch_size: int = opt(
        0, "calibration questions per upper-level batch (0 = --batch-size: a 4-question "
        "upper batch was measured too noisy to move α)"
    )
    eval_batch_size: int = opt(64, "most questions per evaluation batch")
    eval_tokens: int = opt(
        2048, "token budget of an evaluation batch (padded prefix + continuation tokens; "
        "questions are batched longest first)"
    )
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    lr: float = opt(1e-3, "learning rate of the LoRA parameters (θ)")
    weight_decay: float = opt(0.0, "decoupled weight decay of θ (AdamW)")
    optimizer: str = opt("adamw", "optimizer of θ", choices=("adamw", "adam", "sgd"))
    schedule: str = opt(
        "cosine", "learning-rate schedule after warmup", choices=("cosine", "linear", "constant")
    )
    warmup_ratio: float = opt(0.1, "fraction of the steps spent in linear warmup")
    max_grad_norm: float = opt(1.0, "clip the θ gradient norm (0 = off)")
    label_smoothing: float = opt(0.1, "smoothing of the label_smoothing baseline")
    label_smoothing_scope: str = opt(
        "vocab",
        "label_smoothing spreads ε over the whole vocabulary (as Hugging Face's Trainer does) or "
        "(letter mode) over the question's option letters, which is what smooths the answer "
        "distribution",
        choices=("vocab", "options"),
    )
    rcft_weight: float = opt(0.5, "RCFT: total = (1-w)·SFT + w·s·Σ_k L_k")
    rcft_scale: float = opt(
        1e-3, "RCFT: s, the regularizer's scale (1e-3 as released; with AdamW it leaves short "
        "runs indistinguishable from SFT)"
    )
    rcft_bins: int = opt(10, "RCFT: confidence bins of the ECE regularizer")
    rcft_reestimate_every: int = opt(
        0, "RCFT: re-run the E-step (bin accuracies) every k steps (0 = once, as released)"
    )
    rcft_include_top_bin: bool = opt(
        True, "RCFT: regularize the top bin [0.9, 1] too (the released code skips it)"
    )


@dataclass
class CalmConfig:
    solver: str = opt("bome", "bilevel solver of the CALM problem (apps.calm_llm.solvers table)",
                      choices=solvers.SOLVERS.names())
    alpha_param: str = opt(
        "affine",
        "α parameterization (calm_scalar always uses 'temperature')",
        choices=alpha_table.learned_names(),  # live: a registered one is offered too
    )
    alpha_form: str = opt(
        "z/tau+l",
        "algebraic form of the affine α (reconstruction: the paper does not say)",
        choices=tuple(alpha_table.FORM.aliases),
    )
    alpha_support: str = opt(
        "answer_tokens",
        "vocabulary entries α may change: the tokens at answer positions of the training and "
        "calibration data (the rest stay at identity), the full vocabulary, or (letter mode) "
        "the option letters",
        choices=("answer_tokens", "vocab", "options"),
    )
    alpha_positivity: str = opt(
        "bounded",
        "τ from its raw parameter: exp (unbounded), softplus, or exp(b·tanh(raw/b)) with "
        "b = log(--alpha-tau-max) (τ cannot leave (1/τmax, τmax))",
        choices=alpha_table.POSITIVITIES,
    )
    alpha_tau_max: float = opt(20.0, "bound of τ for --alpha-positivity bounded (> 1)")
    alpha_decay: float = opt(
        0.0, "prior pulling α to identity: f + δ·½‖α − identity‖² (raw parameters)"
    )
    alpha_grad_clip: float = opt(
        0.0, "clip every entry of α's direction to [−c, c] before its optimizer (0 = off)"
    )
    alpha_acts: str = opt(
        "lower_and_inference",
        "where α acts: on the vocabulary logits in the lower CE, the upper objective and at "
        "inference (reconstruction of the paper); in the upper objective and at inference only "
        "(extension: θ sees α only through the coupling); or on the option scores in the upper "
        "objective and at inference (extension: a bilevel-trained option temperature/shift)",
        choices=("lower_and_inference", "upper_and_inference", "options"),
    )
    alpha_at_inference: bool = opt(True, "apply the learned α when predicting")
    eval_without_alpha: bool = opt(
        True, "also evaluate each trained CALM variant without α (row METHOD:no_alpha)"
    )
    alpha_lr: float = opt(1e-2, "learning rate of α")
    alpha_optimizer: str = opt("adam", "optimizer of α", choices=("adam", "sgd", "adamw"))
    bome_optimizer: str = opt(
        "separate",
        "how CALM's directions are applied: θ by --optimizer and α by --alpha-optimizer "
        "(separate), or plain SGD on the joint direction u ← u − ξ·(∇f + λ∇q̂) as BOME's "
        "analysis assumes (sgd; ξ = --bome-lr with the schedule, no clipping)",
        choices=("separate", "sgd"),
    )
    bome_lr: float = opt(0.05, "ξ, the step size of --bome-optimizer sgd")
    upper_objective: str = opt(
        "options",
        "what the upper loss reads: the α-adjusted option distribution, or (cloze) the "
        "next-token distributions at the answer tokens",
        choices=("options", "answer_tokens"),
    )
    upper_loss: str = opt(
        "entropy",
        "upper-level loss: −entropy (the paper's), or, as extensions with their optimum at "
        "calibration rather than at uniform, the calibration-set NLL or a soft-binned ECE "
        "(the methods.upper table; a plugin may add one)",
        choices=UPPER_LOSSES.names(),
    )
    inner_steps: int = opt(2, "inner (lower-level) gradient steps per outer step (T)")
    inner_lr: float = opt(0.05, "inner step size β on θ")
    eta: float = opt(0.5, "BOME: φ = η‖∇q‖² (phi=grad_norm)")
    phi: str = opt("grad_norm", "BOME control φ", choices=("grad_norm", "value_gap"))
    c: float = opt(0.5, "BOME: φ = c·q (phi=value_gap)")
    gamma: float = opt(1.0, "calm_regularization: loss = CE − γ·entropy")
    linear_solver: str = opt(
        "cg", "AID: linear solver of ∇²g·v = ∇f (apps.calm_llm.solvers table; a plugin may add one)",
        choices=solvers.LINEAR_SOLVERS.names(),
    )
    cg_maxiter: int = opt(5, "AID: iterations of the linear solver (CG; Neumann terms)")
    cg_tol: float = opt(1e-6, "AID: tolerance of the linear solver (relative residual)")
    itd_truncate: int = opt(0, "ITD: back-propagate through the last k inner steps (0 = all)")


@dataclass
class OpenQAConfig:
    """``--task open_qa``: how answers are sampled, clustered and matched (docs/open_qa.md)."""

    n_samples: int = opt(20, "open QA: answers sampled per question (confidence = share of the "
                             "largest semantic cluster)")
    sample_temperature: float = opt(0.7, "open QA: sampling temperature (the protocol's 0.7)")
    top_p: float = opt(1.0, "open QA: nucleus-sampling mass (1 = off)")
    max_new_tokens: int = opt(16, "open QA: most tokens of one answer (an answer also ends at a "
                                  "newline or EOS)")
    gen_batch_size: int = opt(8, "open QA: questions per generate call (all their samples at once)")
    cluster: str = opt("exact", "open QA: semantic equivalence of answers",
                       choices=("exact", "embedding", "nli"))
    cluster_threshold: float = opt(0.75, "open QA: cosine similarity that merges two answers "
                                         "(--cluster embedding)")
    nli_model: str = opt("microsoft/deberta-large-mnli",
                         "open QA: NLI classifier for --cluster nli (hub name or folder)")
    match: str = opt("contains", "open QA: an answer is right when its normalized form contains "
                                 "a gold alias as whole words (contains; untrained small models "
                                 "answer in sentences) or equals one (exact, TriviaQA's); judge: "
                                 "an LLM (--judge-model) decides what exact match does not",
                     choices=("exact", "contains", "judge"))
    judge_model: str = opt("", "open QA: the causal LM that judges answers for --match judge "
                               "(hub name, folder, or smollm2/tiny offline)")
    split_half_splits: int = opt(10, "open QA: random half-splits of the split-half confidence")
    verbalized: bool = opt(True, "open QA: also ask the model for a 0-100 confidence in its "
                                 "greedy answer (a baseline)")


@dataclass
class Config:
    task: str = opt("mcqa", "'mcqa' (multiple choice) or 'open_qa' (free-form answers, "
                    "Semantic-ECE; its own embedded default, docs/open_qa.md)",
                    choices=("mcqa", "open_qa"))
    methods: list[str] = opt(["none", "ts", "sft", "calm"], "methods to run",
                             names=lambda: methods.names())
    plugins: list[str] = opt(
        [], "modules imported before validation, e.g. to register methods (docs/extending.md); "
        "kept in config.json, so a resume imports them again"
    )
    out: str = opt("", "run directory (default: a fresh folder under runs/)")
    resume: str = opt("", "continue the killed run in this directory")
    force_resume: bool = opt(
        False,
        "with --resume: continue even though the data no longer give the splits recorded in "
        "splits.json (methods evaluated before and after would mix the two)",
    )
    seed: int = opt(0, "seed of LoRA init, batch order and dropout, and of the splits unless "
                       "--split-seed is given")
    split_seed: int = opt(
        -1,
        "seed of the data splits and source subsampling alone (-1: follow --seed); fix it to "
        "compare seeds of training on the same questions",
    )
    device: str = opt("auto", "'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ...")
    fsdp: bool = opt(
        False,
        "under accelerate launch/torchrun, shard the frozen base weights over the processes "
        "with FSDP2 (LoRA stays replicated); on by itself under an accelerate FSDP config",
    )
    checkpoint_every: int = opt(10, "save a checkpoint every k optimizer steps (0 = off)")
    n_bins: int = opt(10, "bins of the ECE metrics and reliability diagrams")
    n_boot: int = opt(200, "bootstrap resamples for the ECE intervals")
    zero_shot: bool = opt(
        True,
        "score the untrained model on every test set first and print its accuracy against "
        "chance (--no-zero-shot skips it in runs of trained methods only)",
    )
    eval_calib: bool = opt(
        False,
        "also score the calibration split and record calib_nll, calib_conf_ece and "
        "calib_accuracy for every method (the numbers a choice of settings may read; ts was "
        "fitted on that split; always on for --select variants)",
    )
    select: list[str] = opt(
        [],
        "choose an option by the calibration split: KEY=V1,V2,... (e.g. eta=0.1,0.5,0.9) trains "
        "each value of every trained method, keeps the one with the lowest calibration-split "
        "NLL and reports all (several KEY=... entries form a grid)",
    )
    report_to: str = opt(
        "none", "also log each training step to TensorBoard (runs/<dir>/tensorboard)",
        choices=("none", "tensorboard"),
    )
    # {name: its options} of every registered entry (method, solver, linear solver, upper loss)
    # that declares an options dataclass (``Info.options``, e.g. a plugin's); flags
    # ``--<name>-<field>``, file/config.json section ``plugin_options: {name: {field: value}}``
    plugin_options: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    calm: CalmConfig = field(default_factory=CalmConfig)
    open_qa: OpenQAConfig = field(default_factory=OpenQAConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def options_of(self, name: str) -> Any:
        """The options of a registered entry (method, solver, linear solver, upper loss) that
        declares an options dataclass (``Info.options``)."""
        if name not in self.plugin_options:
            raise ConfigError(f"{name!r} declares no options (registered with options: "
                              f"{sorted(self.plugin_options)})")
        return self.plugin_options[name]

    def method_options(self, method: str) -> Any:
        """`options_of` for a method (the name methods have read their options with)."""
        return self.options_of(method)

    def hash(self) -> str:
        """sha256 of everything that changes what is trained and predicted (not where results go,
        the resume flags, sharding, or the evaluation-only options: see `comparable`)."""
        d = self.comparable()
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def comparable(self) -> dict[str, Any]:
        """The flat ``{--flag: value}`` of every option a resumed run must share with its run.

        Left out: where results go and how often checkpoints are written, the resume flags,
        sharding (``--fsdp``: the same math as DDP) and `EVAL_ONLY` options, which a resume may
        change because the saved predictions are re-evaluated with them.
        """
        out: dict[str, Any] = {}
        for sec, f in _leaf_fields():
            if f.name in RUN_ONLY or f.name in EVAL_ONLY:
                continue
            # multiple-choice runs ignore the open-QA options: their hashes stay what they were
            if self.task == "mcqa" and (sec == "open_qa" or f.name == "task"):
                continue
            out[_flag(f)] = getattr(getattr(self, sec) if sec else self, f.name)
        # an entry's own options change results only when it is used (other runs keep their hash)
        used = {name for table, in_use in _option_tables() for name in table if in_use(self, name)}
        for name, obj, f in _plugin_fields(self):
            if name in used:
                out[_plugin_flag(name, f)] = getattr(obj, f.name)
        return out

    def save(self, run_dir: str | Path) -> Path:
        from .io import atomic_write_text  # a killed write must not leave a cut config.json

        path = Path(run_dir) / "config.json"
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path


# top-level options that do not change results (`Config.comparable` leaves them out)
# (``plugins`` only makes names available: the ``--methods`` that use them are compared)
RUN_ONLY = ("out", "resume", "force_resume", "checkpoint_every", "fsdp", "report_to", "zero_shot",
            "plugins")
# options read only when metrics are computed from predictions: a resume may change them
EVAL_ONLY = ("n_bins", "n_boot")


def differences(saved: Config, now: Config) -> list[str]:
    """``"--flag: saved -> now"`` for each option that differs in a way that changes results."""
    a, b = saved.comparable(), now.comparable()
    return [f"{k}: {a[k]!r} (the run's) vs {b[k]!r} (now)" for k in a if a[k] != b[k]]


SECTIONS = ("model", "data", "train", "calm", "open_qa")


def _leaf_fields() -> list[tuple[str | None, dataclasses.Field]]:
    """(section or None, field) for every built-in option, sections flattened (the methods' own
    options are `_plugin_fields`)."""
    out: list[tuple[str | None, dataclasses.Field]] = []
    for f in fields(Config):
        if f.name == "plugin_options":
            continue
        if f.name in SECTIONS:
            out.extend((f.name, g) for g in fields(f.default_factory))  # type: ignore[misc]
        else:
            out.append((None, f))
    return out


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _option_tables() -> tuple[tuple[Any, Any], ...]:
    """(registry, in_use(cfg, name)) of every table whose entries may declare options: an
    entry's options are compared on resume (and hashed) only when ``in_use``."""
    return (
        (methods.METHODS, lambda cfg, name: name in cfg.methods),
        (solvers.SOLVERS, lambda cfg, name: cfg.calm.solver == name),
        (solvers.LINEAR_SOLVERS, lambda cfg, name: cfg.calm.linear_solver == name),
        (UPPER_LOSSES, lambda cfg, name: cfg.calm.upper_loss == name),
    )


def _option_classes() -> dict[str, type]:
    """{name: options dataclass} of every registered entry that declares one."""
    out: dict[str, type] = {}
    for table, _ in _option_tables():
        for name, info in table.items():
            cls = getattr(info, "options", None)
            if cls is None:
                continue
            if name in out and out[name] is not cls:  # one flag namespace: --<name>-<field>
                raise ConfigError(f"{table.kind} {name!r} declares options, and so does another "
                                  "entry of that name: rename one (flags are --<name>-<field>)")
            out[name] = cls
    return out


def _plugin_flag(method: str, f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f"--{method}-{f.name}".replace("_", "-")


def _plugin_fields(cfg: Config) -> list[tuple[str, Any, dataclasses.Field]]:
    """(method, its options object, field) for every option of a method's own options."""
    return [(m, obj, f) for m, obj in cfg.plugin_options.items() for f in fields(obj)]


def _with_method_defaults(cfg: Config) -> Config:
    """Add the defaults of every registered method's options that `cfg` does not hold yet."""
    for method, cls in _option_classes().items():
        if method not in cfg.plugin_options:
            cfg.plugin_options[method] = cls()
    return cfg


def _set_method_options(cfg: Config, value: Any) -> None:
    """Apply a ``plugin_options: {method: {field: value}}`` mapping (a file, config.json, flags)."""
    if not isinstance(value, dict):
        raise ConfigError(f"plugin_options: expected a mapping of methods, got {value!r}")
    classes = _option_classes()
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


def _type_of(f: dataclasses.Field) -> type:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return type(default)


def _add_flag(group: Any, flag: str, f: dataclasses.Field, dest: str) -> None:
    """One option's flag: its type, choices and help with the default; absent unless given."""
    t = _type_of(f)
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
    for sec, f in _leaf_fields():
        flag = _flag(f)
        if flag in seen:  # a programming error: flat CLI needs unique names
            raise RuntimeError(f"duplicate flag {flag}")
        seen.add(flag)
        _add_flag(groups[sec], flag, f, f"{sec}.{f.name}" if sec else f.name)
    plugin_cfg = _with_method_defaults(Config())
    for method, _obj, f in _plugin_fields(plugin_cfg):
        flag = _plugin_flag(method, f)
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


def load_file(path: str | Path) -> dict:
    """Read a YAML or JSON config file into a (nested) dict."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--config {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
            ) from e
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"--config {path}: not valid YAML ({problem}{at})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of options")
    return data


def _coerce(name: str, f: dataclasses.Field, value: Any) -> Any:
    t = _type_of(f)
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
    return _with_method_defaults(cfg)


def parse_args(argv: list[str] | None = None) -> Config:
    """defaults < --config FILE < CLI flags; then `validate`."""
    # plugins first: the choices they register (an α parameterization, a source) must exist
    # when argparse checks the other flags
    load_plugins(_plugins_in(sys.argv[1:] if argv is None else argv))
    ns = vars(build_parser().parse_args(argv))
    cfg = Config()
    config_file = ns.pop("config", None)
    if config_file is None and ns.get("task") == "open_qa":
        config_file = "open_qa"  # --task open_qa alone runs its own embedded default
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
        except Exception as e:  # any error of the plugin's code: its traceback is kept
            raise PluginError(f"--plugins {name}: cannot import it "
                              f"({type(e).__name__}: {e})") from e


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _kv(name: str, entries: list[str]) -> dict[str, str]:
    out = {}
    for e in entries:
        _check("=" in e, f"--{name}: expected NAME=VALUE, got {e!r}")
        k, v = e.split("=", 1)
        out[k] = v
    return out


def data_files(cfg: Config) -> dict[str, str]:
    """--data-files as {source: path}."""
    return _kv("data-files", cfg.data.data_files)


def data_hub(cfg: Config) -> dict[str, str]:
    """--data-hub as {source: hub name}."""
    return _kv("data-hub", cfg.data.data_hub)


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
    every = [(getattr(cfg, sec) if sec else cfg, f, _flag(f), False) for sec, f in _leaf_fields()]
    # a method's own options may be negative: its `validate` says what they may not be
    every += [(obj, f, _plugin_flag(m, f), True) for m, obj, f in _plugin_fields(cfg)]
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
    _check(len(cfg.methods) > 0, "--methods: give at least one method")
    for m in cfg.methods:
        _check(m in known, f"--methods: unknown method {m!r} (known: {list(known)})")
    _check(len(set(cfg.methods)) == len(cfg.methods), "--methods: a method is listed twice")
    _check(cfg.split_seed >= -1, f"--split-seed: must be >= 0, or -1 to follow --seed, got "
           f"{cfg.split_seed}")
    _check(cfg.n_bins >= 1, f"--n-bins: must be at least 1, got {cfg.n_bins}")
    # one resample has no spread: the interval's quantiles need at least two
    _check(cfg.n_boot != 1, "--n-boot: must be 0 (no intervals) or at least 2, got 1")
    _check(DEVICE.fullmatch(cfg.device) is not None,
           f"--device: {cfg.device!r} is not one of auto, cpu, mps, cuda, cuda:N")
    if cfg.report_to == "tensorboard":
        _check(importlib.util.find_spec("tensorboard") is not None,
               "--report-to tensorboard: needs the tensorboard package (pip install tensorboard)")


def _check_model(m: ModelConfig) -> None:
    _check(m.max_length >= 8, "--max-length: must be at least 8")
    _check(m.lora_r >= 1, "--lora-r: must be at least 1")
    _check(m.lora_alpha > 0, "--lora-alpha: must be positive")
    _check(m.lora_dropout < 1, "--lora-dropout: must be < 1")
    _check(len(m.lora_target_modules) > 0, "--lora-target-modules: give at least one module")
    _check(m.tiny_hidden >= 8 and m.tiny_layers >= 1, "--tiny-hidden/--tiny-layers too small")
    if m.quantization != "none":
        _check(
            importlib.util.find_spec("bitsandbytes") is not None,
            f"--quantization {m.quantization}: needs the bitsandbytes package "
            "(pip install bitsandbytes; CUDA only)",
        )


def _check_data(cfg: Config) -> None:
    """Sources are known (or given a file / hub name), split sizes can be drawn."""
    d = cfg.data
    # the collator letters options A..J
    _check(2 <= d.max_options <= 10, f"--max-options: must be in 2..10, got {d.max_options}")
    _check(len(d.in_domain) > 0, "--in-domain: give at least one source")
    both = sorted(set(d.in_domain) & set(d.out_of_domain))
    _check(not both, f"--in-domain and --out-of-domain share {both}: a set is one or the other")
    if d.out_of_domain:
        _check(d.n_ood >= 1, "--n-ood: need at least 1 question per out-of-domain source "
               "(or give no --out-of-domain sources)")
    files, hub = data_files(cfg), data_hub(cfg)
    if cfg.task == "open_qa":
        _check_open_qa(cfg, files, hub)
        return
    for src in [*d.in_domain, *d.out_of_domain]:
        _check(
            src in sources.source_names("mcqa") or src in files or src in hub,
            f"unknown MCQA source {src!r}: one of {list(sources.source_names())}, or give its file with "
            f"--data-files {src}=PATH or its hub name with --data-hub {src}=ORG/NAME",
        )
    if d.instruction_data:
        _check(
            d.instruction_data in files or d.instruction_data in hub,
            f"--instruction-data {d.instruction_data!r}: give its file with --data-files "
            f"{d.instruction_data}=PATH or its hub name with --data-hub",
        )
    _check(d.n_calib >= 2, "--n-calib: need at least 2 calibration questions")
    _check(d.n_test >= 1, "--n-test: need at least 1 test question per in-domain source")


def _check_open_qa(cfg: Config, files: dict[str, str], hub: dict[str, str]) -> None:
    """``--task open_qa``: open-QA sources, sampling options, methods that apply."""
    from .data import open_qa  # torch-free, like `sources`

    d, q = cfg.data, cfg.open_qa
    for src in [*d.in_domain, *d.out_of_domain]:
        _check(
            src in open_qa.open_qa_source_names(offline=True) or src in files or src in hub,
            f"--task open_qa: {src!r} is not an open-QA source available offline (offline: "
            f"{list(open_qa.open_qa_source_names(offline=True))}); give its file with "
            f"--data-files {src}=PATH or its hub name with --data-hub {src}=ORG/NAME",
        )
    _check(not d.instruction_data, "--task open_qa trains on the open-QA questions themselves; "
           "drop --instruction-data")
    _check(d.n_calib >= 2, "--n-calib: need at least 2 calibration questions")
    _check(d.n_test >= 1, "--n-test: need at least 1 test question per in-domain source")
    _check(q.n_samples >= 2, f"--n-samples: need at least 2 samples per question, got {q.n_samples}")
    _check(q.sample_temperature > 0, "--sample-temperature: must be positive")
    _check(0 < q.top_p <= 1, f"--top-p: must be in (0, 1], got {q.top_p}")
    _check(q.max_new_tokens >= 1 and q.gen_batch_size >= 1,
           "--max-new-tokens and --gen-batch-size: must be at least 1")
    _check(0 < q.cluster_threshold <= 1, "--cluster-threshold: must be in (0, 1]")
    _check(q.split_half_splits >= 1, "--split-half-splits: must be at least 1")
    _check((q.match == "judge") == bool(q.judge_model),
           "--match judge needs --judge-model NAME (a hub name, folder, smollm2 or tiny)"
           if q.match == "judge" else
           f"--judge-model is read only with --match judge (got --match {q.match})")
    table = methods.METHODS
    for m in cfg.methods:
        _check(m not in table or "open_qa" in table[m].tasks,
               f"--methods {m}: does not apply to --task open_qa ({table[m].name} needs answer "
               f"options); open-QA methods: {[n for n, i in table.items() if 'open_qa' in i.tasks]}")


def _check_train(cfg: Config) -> None:
    """The shared training options (each method's own are its ``MethodInfo.validate``)."""
    t = cfg.train
    trains = trained(cfg)
    if trains:
        _check(t.steps >= 1, f"--steps: must be >= 1 to train {trains}")
        _check(cfg.data.n_train >= 1, f"--n-train: must be >= 1 to train {trains}")
    _check(t.lr > 0, f"--lr: must be positive, got {t.lr}")
    _check(t.batch_size >= 1 and t.eval_batch_size >= 1, "batch sizes must be at least 1")
    _check(t.eval_tokens >= 1, f"--eval-tokens: must be at least 1, got {t.eval_tokens}")
    _check(t.grad_accum >= 1, "--grad-accum: must be at least 1")
    _check(t.warmup_ratio < 1, "--warmup-ratio: must be < 1")


def _check_combinations(cfg: Config) -> None:
    """What no section rules out alone: sharding with quantized weights or second order."""
    if cfg.fsdp:
        _check(cfg.model.quantization == "none",
               f"--fsdp with --quantization {cfg.model.quantization}: quantized base weights "
               "cannot be sharded; use --fsdp in bf16, or DDP (no --fsdp) with --quantization 4bit")
        _check(not needs_second_order(cfg),
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
            _check(Path(path).is_file(), f"--data-files {e}: no such file {path!r} for {name!r}")
    model = cfg.model.name_or_path
    if model not in ("smollm2", "tiny"):
        if model.startswith(_PATH_LIKE) or Path(model).exists():
            _check(Path(model).expanduser().is_dir(),
                   f"--model {model}: no such folder (give a model folder, a hub name ORG/NAME, "
                   "'smollm2' or 'tiny')")
        else:
            _check(_HUB_NAME.fullmatch(model) is not None,
                   f"--model {model!r}: neither a folder nor a hub name of the form ORG/NAME")
    for flag, value in (("--out", cfg.out), ("--resume", cfg.resume)):
        _check(not value or not Path(value).exists() or Path(value).is_dir(),
               f"{flag} {value}: a file is there, not a run directory; choose another path")
    _check(not cfg.force_resume or bool(cfg.resume), "--force-resume: only with --resume DIR")


def needs_second_order(cfg: Config) -> bool:
    """True when some method differentiates through gradients (eager attention required)."""
    table = methods.METHODS
    return any(table[m].second_order(cfg) for m in cfg.methods if m in table)


def split_seed(cfg: Config) -> int:
    """The seed of the data splits: --split-seed, or --seed when it is -1."""
    return cfg.seed if cfg.split_seed < 0 else cfg.split_seed


def calib_batch_size(cfg: Config) -> int:
    """Calibration questions per upper-level batch: --calib-batch-size, or --batch-size when 0."""
    return cfg.train.calib_batch_size or cfg.train.batch_size


def select_grid(cfg: Config) -> list[dict[str, Any]]:
    """``--select KEY=V1,V2 ...`` as the list of ``{section.field: value}`` points of the grid
    (the cartesian product of the entries); ``[]`` without --select.

    Keys are option names as in the CLI without dashes (``eta``, ``alpha_lr``, ``alpha-decay``);
    values are parsed with the option's type and validated like the option itself.
    """
    if not cfg.select:
        return []
    by_name = {f.name: (sec, f) for sec, f in _leaf_fields() if sec}
    axes: list[list[tuple[str, Any]]] = []
    seen: set[str] = set()
    for entry in cfg.select:
        _check("=" in entry, f"--select: expected KEY=V1,V2,..., got {entry!r}")
        key, values = entry.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        _check(key in by_name and by_name[key][0] in ("train", "calm"),
               f"--select {entry}: {key!r} is not a train or calm option")
        _check(key not in seen, f"--select: {key!r} is given twice")
        seen.add(key)
        sec, f = by_name[key]
        t = _type_of(f)
        _check(t in (int, float, str), f"--select {entry}: {key} is not a number or choice option")
        parsed = []
        for v in (x.strip() for x in values.split(",")):
            try:
                parsed.append(t(v))
            except ValueError:
                raise ConfigError(f"--select {entry}: {v!r} is not a valid {t.__name__}") from None
        _check(len(parsed) >= 2 and len(set(parsed)) == len(parsed),
               f"--select {entry}: give at least two distinct values")
        axes.append([(f"{sec}.{key}", v) for v in parsed])
    _check(bool(trained(cfg)),
           "--select: no trained method in --methods to select for")
    import itertools

    points = [dict(p) for p in itertools.product(*axes)]
    for point in points:  # each value must pass the option's own validation
        try:
            validate(dataclasses.replace(with_overrides(cfg, point), select=[]))
        except ConfigError as e:
            raise ConfigError(f"--select {point}: {e}") from None
    return points


def with_overrides(cfg: Config, point: dict[str, Any]) -> Config:
    """A copy of `cfg` with ``{section.field: value}`` applied."""
    out = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s)) for s in SECTIONS})
    for key, value in point.items():
        sec, name = key.split(".")
        setattr(getattr(out, sec), name, value)
    return out


def variant_name(method: str, point: dict[str, Any]) -> str:
    """The row name of one --select point, e.g. ``calm@eta=0.1``."""
    return method + "@" + ",".join(f"{k.split('.')[1]}={v}" for k, v in point.items())


def options_markdown() -> str:
    """The options tables of docs/calm.md, from the fields (a test keeps the doc equal to it)."""
    blocks = []
    for sec in (None, *SECTIONS):
        rows = ["| flag | default | meaning |", "|---|---|---|"]
        for s, f in _leaf_fields():
            if s != sec:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meaning = _help(f)
            if f.metadata.get("choices"):
                meaning += f" ({' / '.join(f.metadata['choices'])})"
            rows.append(f"| `{_flag(f)}` | `{default!r}` | {meaning.replace('|', '/')} |")
        blocks.append(f"**{sec or 'run'}**\n\n" + "\n".join(rows))
    return "\n\n".join(blocks) + "\n"


def __getattr__(name: str) -> Any:
    if name == "METHODS":  # every registered method, in order; plugins add to it
        return methods.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
