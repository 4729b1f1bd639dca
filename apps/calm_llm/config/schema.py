"""The configuration of `python -m apps.calm_llm` as dataclasses: one section per concern
(model, data, train, calm, open_qa) and the run options, each field declared with `opt`
(default, help, choices, flag), plus what is derived from a configuration without checking it
(its hash, the options a resume compares, the ``--select`` row names).

Every field becomes one flag whose name is the field name with dashes (``alpha_support`` ->
``--alpha-support``); flag names are unique across sections so the CLI stays flat while files
and ``config.json`` stay nested. A registered entry (method, solver, linear solver, upper loss)
may declare its own options dataclass (``Info.options``): its fields are the flags
``--<name>-<field>``, held in ``Config.plugin_options[name]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from calibration import alpha_table  # torch-free: the α names and options

from ...errors import ConfigError
from .. import methods, solvers, task_table  # torch-free: the method, solver and task tables
from ..data import (
    open_qa,  # noqa: F401 - torch-free: registers the open-QA sources
    sources,  # torch-free: the one source table
)
from ..methods.upper import UPPER_LOSSES  # torch-free: the upper-loss table
from ..option import opt
from .entry_options import compared_entry_options, selectable_options

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


# The built-in names of the source table (data.sources imports without torch, so validation stays
# instant); validation reads the live table, which includes sources a user registered.
MCQA_SOURCES = sources.MCQA_SOURCES


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
    dedup: str = opt(
        "drop",
        "questions repeated within a set, shared between sets or unanswerable (gold text repeated "
        "as a distractor): 'drop' them before splitting (counted in splits.json) or 'refuse' the "
        "data naming their ids",
        choices=("drop", "refuse"),
    )


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
    train_layout: str = opt(
        "packed",
        "training batches (cloze, instruction): right-padded, or their sequences packed into "
        "rows without padding under a per-sequence block mask (same loss and gradients up to "
        "rounding; falls back to padded where the model's attention cannot take the mask, as "
        "the shared prefix does; letter batches stay padded)",
        choices=("padded", "packed"),
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

    @property
    def calib_questions(self) -> int:
        """Calibration questions per upper-level batch: --calib-batch-size, or --batch-size
        when 0 (a property, so that `methods` reads it without importing `config`)."""
        return self.calib_batch_size or self.batch_size


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
    gamma: float = opt(1.0, "calm_regularization: loss = CE − γ·entropy")
    linear_solver: str = opt(
        "cg", "AID: linear solver of ∇²g·v = ∇f (apps.calm_llm.solvers table; a plugin may add one)",
        choices=solvers.LINEAR_SOLVERS.names(),
    )


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
                    "Semantic-ECE; its own embedded default, docs/open_qa.md), or a task a "
                    "plugin registers (the task table, docs/extending.md)",
                    choices=task_table.TASKS.names())
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
    threads: int = opt(
        0,
        "torch CPU threads (intra- and inter-op), set by python -m apps.calm_llm at start; 0 = "
        "torch's own (OMP_NUM_THREADS if exported, else one per CPU). On a machine shared with "
        "other busy work fewer threads slow less "
        "(docs/performance.md, 'Under contention'); the OpenMP wait policy is PASSIVE unless "
        "OMP_WAIT_POLICY is exported",
    )
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
        for sec, f in leaf_fields():
            if f.name in RUN_ONLY or f.name in EVAL_ONLY or f.name in SPLIT_ONLY \
                    or f.name in LAYOUT_ONLY:
                continue
            # multiple-choice runs ignore the open-QA options: their hashes stay what they were
            if self.task == "mcqa" and (sec == "open_qa" or f.name == "task"):
                continue
            out[flag_of(f)] = getattr(getattr(self, sec) if sec else self, f.name)
        # an entry's own options change results only when it is used (other runs keep their
        # hash); those that were section options are compared as they were (`entry_options`)
        out.update(compared_entry_options(self))
        return out

    def save(self, run_dir: str | Path) -> Path:
        from ..io import atomic_write_text  # a killed write must not leave a cut config.json

        path = Path(run_dir) / "config.json"
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path


# top-level options that do not change results (`Config.comparable` leaves them out)
# (``plugins`` only makes names available: the ``--methods`` that use them are compared;
# ``threads`` changes the order of float sums only, and in the hash it would move every saved
# run's hash: a resume on a busier or larger machine may pick another count)
RUN_ONLY = ("out", "resume", "force_resume", "checkpoint_every", "fsdp", "report_to", "zero_shot",
            "plugins", "threads")


# options read only when metrics are computed from predictions: a resume may change them
EVAL_ONLY = ("n_bins", "n_boot")

# options whose effect is the splits, which splits.json records and a resume checks (a changed
# split is refused there): outside the hash, so adding one moved no run's hash or checkpoint
SPLIT_ONLY = ("dedup",)

# options that change how the same numbers are laid out in memory, not the math (the losses and
# gradients agree to rounding, tests/apps/test_train_packing.py): outside the hash like --fsdp,
# so adding one moved no run's hash and a resume may switch it
LAYOUT_ONLY = ("train_layout",)


def differences(saved: Config, now: Config) -> list[str]:
    """``"--flag: saved -> now"`` for each option that differs in a way that changes results."""
    a, b = saved.comparable(), now.comparable()
    return [f"{k}: {a[k]!r} (the run's) vs {b[k]!r} (now)" for k in a if a[k] != b[k]]


SECTIONS = ("model", "data", "train", "calm", "open_qa")


def leaf_fields() -> list[tuple[str | None, dataclasses.Field]]:
    """(section or None, field) for every built-in option, sections flattened (the methods' own
    options are `plugin_fields`)."""
    out: list[tuple[str | None, dataclasses.Field]] = []
    for f in fields(Config):
        if f.name == "plugin_options":
            continue
        if f.name in SECTIONS:
            out.extend((f.name, g) for g in fields(f.default_factory))  # type: ignore[misc]
        else:
            out.append((None, f))
    return out


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def type_of(f: dataclasses.Field) -> type:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return type(default)


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _kv(name: str, entries: list[str]) -> dict[str, str]:
    out = {}
    for e in entries:
        require("=" in e, f"--{name}: expected NAME=VALUE, got {e!r}")
        k, v = e.split("=", 1)
        out[k] = v
    return out


def data_files(cfg: Config) -> dict[str, str]:
    """--data-files as {source: path}."""
    return _kv("data-files", cfg.data.data_files)


def data_hub(cfg: Config) -> dict[str, str]:
    """--data-hub as {source: hub name}."""
    return _kv("data-hub", cfg.data.data_hub)


def split_seed(cfg: Config) -> int:
    """The seed of the data splits: --split-seed, or --seed when it is -1."""
    return cfg.seed if cfg.split_seed < 0 else cfg.split_seed


def calib_batch_size(cfg: Config) -> int:
    """Calibration questions per upper-level batch: --calib-batch-size, or --batch-size when 0."""
    return cfg.train.calib_questions


def with_overrides(cfg: Config, point: dict[str, Any]) -> Config:
    """A copy of `cfg` with ``{section.field: value}`` applied; ``calm.<name>`` may also name a
    solver's or linear solver's own option by its select name (``calm.eta``, `--select`)."""
    out = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s)) for s in SECTIONS},
                              plugin_options=dict(cfg.plugin_options))
    entries = selectable_options()
    for key, value in point.items():
        sec, name = key.split(".")
        if sec == "calm" and name not in CalmConfig.__dataclass_fields__ and name in entries:
            entry, f = entries[name]
            out.plugin_options[entry] = dataclasses.replace(out.plugin_options[entry],
                                                            **{f.name: value})
        else:
            setattr(getattr(out, sec), name, value)
    return out


def variant_name(method: str, point: dict[str, Any]) -> str:
    """The row name of one --select point, e.g. ``calm@eta=0.1``."""
    return method + "@" + ",".join(f"{k.split('.')[1]}={v}" for k, v in point.items())
