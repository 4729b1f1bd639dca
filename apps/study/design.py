"""What a study is, as data: a `Study` (a grid of ordinary ``apps.calm_llm`` runs: variants ×
seeds, the costs ``--dry-run`` estimates from), its `Variant` settings, the primary
`Comparison` s its claims are decided by, the `FlopScale` of a GPU study, and the roles its
splits play (`SPLIT_KINDS`, `ROLES`, `DEVELOPMENT`). The named studies are in `catalogue`.

A ``Study`` is data only; ``runner`` turns it into cells, ``summary`` into tables. A comparison
in ``Study.primary`` is one of the few the study's claims rest on: the summary tests them as
one family with Holm's correction (``calibration.stats.holm``); every other interval it prints
is exploratory (docs/results.md, "How the intervals are computed").
"""

from __future__ import annotations

import dataclasses


def family(method: str) -> str:
    """The method family whose step cost stands in for ``method``'s: ``calm`` for every CALM
    variant (ablations, other solvers), else the method itself."""
    return "calm" if method.startswith("calm") else method


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A primary comparison: ``row`` minus ``baseline`` (both "variant/row") on ``dataset`` in
    ``metric`` ("error": conf-ECE, or Semantic-ECE in open QA; or "accuracy"), for ``claim``."""

    row: str
    baseline: str
    dataset: str
    metric: str
    claim: str

    def __post_init__(self) -> None:
        if self.metric not in ("error", "accuracy"):
            raise ValueError(f"Comparison metric must be 'error' or 'accuracy', got {self.metric!r}")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One setting of a study: the rows it trains (``--methods``) and its extra options."""

    name: str
    methods: tuple[str, ...]
    args: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None  # None: the study's seeds
    note: str = ""


@dataclasses.dataclass(frozen=True)
class FlopScale:
    """GPU seconds of a study that has not been run on a GPU, from FLOPs.

    An SFT optimizer step reads ``questions_per_step`` questions of ``train_tokens`` tokens
    each. Per token: 2N FLOPs forward, 2N backward (gradients of the activations only: the base
    is frozen; LoRA's own FLOPs are left out), and 2N more to recompute the forward when
    gradient checkpointing is on: 6N·tokens per SFT step. Another method's step is its
    measured step-time ratio to SFT (``step_ratio``, from ``bench/gpu_smoke.py`` on the CPU)
    times that. Scoring a question is one forward: 2N·tokens. Seconds = FLOPs /
    (``peak_flops`` × ``utilization``), one GPU; N GPUs under DDP divide it by about N.
    """

    params: float  # N, parameters of the base model
    questions_per_step: int  # the effective batch: --batch-size × --grad-accum
    train_tokens: float  # mean tokens of a training question (prompt + answer letter)
    eval_tokens: dict[str, tuple[int, float]]  # scored set -> (questions, mean tokens)
    step_ratio: dict[str, float]  # method -> its step time / SFT's, measured
    peak_flops: float = 989e12  # H100 SXM, dense bf16
    utilization: float = 0.3  # model-FLOPs utilization assumed for LoRA fine-tuning
    checkpointing: bool = True

    def _seconds(self, flops: float) -> float:
        return flops / (self.peak_flops * self.utilization)

    def step_s(self, method: str) -> float:
        per_token = 6.0 if self.checkpointing else 4.0
        sft = self._seconds(per_token * self.params * self.questions_per_step * self.train_tokens)
        return self.step_ratio.get(method, self.step_ratio.get(family(method), 0.0)) * sft

    def prediction_s(self) -> float:
        """One prediction: every scored question once."""
        return self._seconds(2.0 * self.params * sum(n * t for n, t in self.eval_tokens.values()))


# the kinds of split a cell carves (data.splits.Splits.named: train, calib, test/<set>, ood/<set>)
SPLIT_KINDS = ("train", "calib", "test", "ood")
# what a split's questions are to a study (apps.study.discipline): fitted on; read by a choice;
# or a final test no choice reads
ROLES = ("training", "development", "test")
# every study so far made choices from what it evaluated (defaults, η, which sets to keep)
DEVELOPMENT = {"train": "training", "calib": "development", "test": "development",
               "ood": "development"}


@dataclasses.dataclass(frozen=True)
class Study:
    """A grid: options shared by every cell, variants, seeds, and measured costs for --dry-run."""

    name: str
    common: tuple[str, ...]
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...]
    # seconds, measured on the project's 2-core CPU machine (docs/calm.md): per optimizer step
    # of each method family, per scored question, and per run (model load)
    step_s: dict[str, float]
    question_s: float
    run_s: float
    questions: int  # questions scored per prediction of a trained method (test + OOD + calib)
    description: str = ""
    # rows every other row is compared with, question by question ("variant/row";
    # "{variant}/row" is the row of the compared row's own variant)
    baselines: tuple[str, ...] = ()
    # add a table of each set's accuracy against chance (a screen of which sets to keep)
    chance_table: bool = False
    # a GPU study: estimates are GPU seconds scaled by FLOPs instead of the CPU costs above
    flops: FlopScale | None = None
    # run every variant's first seed before any second seed: a study stopped early then has
    # every row at fewer seeds rather than the first rows complete and the last ones missing
    seed_major: bool = False
    # rows ("variant/row") drawn in the study's pooled reliability diagrams (--figures)
    figure_rows: tuple[str, ...] = ()
    # the comparisons the study's claims are decided by, one Holm family (see Comparison)
    primary: tuple[Comparison, ...] = ()
    # each split kind's role (SPLIT_KINDS -> ROLES): a study refuses to test on questions another
    # study used for development, and to develop on another's test questions (apps.study.discipline)
    roles: dict[str, str] = dataclasses.field(default_factory=lambda: dict(DEVELOPMENT))
    # shared questions found after the study ran, acknowledged by name so the check still
    # guards against any more: "other study: this study's split" -> how many (discipline.check)
    acknowledged_shared: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if set(self.roles) != set(SPLIT_KINDS) or not set(self.roles.values()) <= set(ROLES):
            raise ValueError(f"study {self.name}: roles must give each split kind {SPLIT_KINDS} one "
                             f"of {ROLES}, got {self.roles}; e.g. {DEVELOPMENT}")

