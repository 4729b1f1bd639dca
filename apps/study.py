"""Studies: named grids of ordinary ``apps.calm_llm`` runs (settings × seeds), run as resumable
cells and summarised over seeds.

    python -m apps.study calm-dynamics --dry-run      # the cells and their estimated time
    python -m apps.study calm-dynamics                # run (again: finished cells are skipped)
    python -m apps.study calm-dynamics --summarize    # study.json + study.md from finished cells
    python -m apps.study calm-dynamics --publish docs/results/calm-dynamics   # the small files

Each cell is a run directory ``<root>/<variant>-seed<k>`` made by ``python -m apps.calm_llm``
in a subprocess, so a study can be killed at any time: a cell that was interrupted is resumed
from its checkpoints (``--resume``), a finished one (every requested row in ``metrics.json``)
is skipped. Seeds vary training (LoRA init, batch order, dropout) while ``--split-seed`` keeps
the questions fixed, so the same questions are scored in every cell and the summary can pair
them.

The summary reports, per variant and row, the mean ± standard deviation over seeds of each
metric, and a 95 % bootstrap interval of conf-ECE pooled over seeds that resamples *questions*
(each drawn question brings its predictions from every seed), so seed noise and question noise
are both in it, and each row minus its baselines on the same questions. Open QA is summarised
the same way from each row's saved answers, with Semantic-ECE of the semantic-cluster
confidence in place of conf-ECE.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import lzma
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("accuracy", "conf_ece", "cw_ece", "brier", "nll", "mean_confidence")
CALIB = ("calib_nll", "calib_conf_ece", "calib_accuracy")
# open QA (metrics.json "task": "open_qa"): the modal answer's accuracy, the greedy answer's, and
# the semantic-cluster confidence's Semantic-ECE, Brier, AUROC, and the mean number of answer
# clusters per question (20 samples in 20 clusters: a confidence of 1/20 whatever the model
# knows); every confidence kind's Semantic-ECE is kept as "semantic_ece/<kind>"
OPEN_QA_METRICS = ("accuracy", "greedy_accuracy", "semantic_ece", "brier", "auroc",
                   "mean_confidence", "mean_clusters")


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
        return self.step_ratio.get(method, self.step_ratio.get(_family(method), 0.0)) * sft

    def prediction_s(self) -> float:
        """One prediction: every scored question once."""
        return self._seconds(2.0 * self.params * sum(n * t for n, t in self.eval_tokens.values()))


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


# the issue-9 comparison: CALM's old default, its new default, and the new settings beside SFT/TS
CALM_DYNAMICS = Study(
    name="calm-dynamics",
    description="SmolLM2-135M-Instruct, cloze, SciQ -> ARC-Easy, 60 steps, split seed 0",
    common=("--split-seed", "0", "--steps", "60", "--eval-calib", "--no-zero-shot"),
    seeds=(0, 1, 2),
    variants=(
        Variant("reference", ("none", "ts"), seeds=(0,), note="no training: one seed suffices"),
        Variant("default", ("sft", "calm"),
                note="calm as configured now: alpha on answer tokens, bounded tau, calib batch 8"),
        Variant("old", ("calm",), ("--alpha-support", "vocab", "--alpha-positivity", "log",
                                   "--calib-batch-size", "4"),
                note="calm's former default: alpha over the vocabulary, exp tau, calib batch 4"),
        Variant("nll", ("calm",), ("--upper-loss", "nll"),
                note="extension: upper loss = calibration-set NLL (optimum at calibration)"),
        # defined, not yet run (docs/calm.md says which cells the published tables hold)
        Variant("upper", ("calm",), ("--alpha-acts", "upper_and_inference"),
                note="extension: alpha kept out of the lower loss"),
        Variant("sgd", ("calm",), ("--bome-optimizer", "sgd"),
                note="BOME as analysed: plain SGD on the joint direction"),
        Variant("soft_ece", ("calm",), ("--upper-loss", "soft_ece", "--upper-objective", "options"),
                note="extension: soft-binned ECE of the option distribution as upper loss"),
        Variant("select_eta", ("calm",), ("--select", "eta=0.1,0.5,0.9"), seeds=(0,),
                note="eta chosen by calibration-split NLL among 0.1, 0.5, 0.9 (one seed: three "
                     "CALM trainings per cell)"),
    ),
    # measured in this study's cells (2026-12-03): sft 1.5 s, calm 6.8 s per step; 0.15 s per
    # scored question (SciQ 0.11, ARC-Easy 0.2)
    step_s={"sft": 1.5, "calm": 6.8, "none": 0.0, "ts": 0.0},
    question_s=0.15,
    run_s=15.0,
    questions=340,
    baselines=("default/sft", "reference/ts"),
)

# issue 13's first step: which sets the model is above chance on, zero-shot, before any training
SCREEN_SETS = ("arc_easy", "arc_challenge", "openbookqa", "commonsense_qa", "mmlu", "medmcqa")
LAPTOP_SCREEN = Study(
    name="laptop-screen",
    description="SmolLM2-135M-Instruct, cloze, zero-shot accuracy of every offline MCQA set "
                "(300 test questions each; SciQ in-domain), split seed 0",
    common=("--split-seed", "0", "--eval-calib", "--no-zero-shot", "--in-domain", "sciq",
            "--out-of-domain", *SCREEN_SETS, "--n-test", "300", "--n-ood", "300"),
    seeds=(0,),
    variants=(Variant("zero_shot", ("none",), note="the model as given: nothing is trained"),),
    # 0.11 s (SciQ) to ≈ 0.4 s (MMLU) per question; 7 sets × 300 + 100 calibration questions
    step_s={"none": 0.0}, question_s=0.2, run_s=15.0, questions=2200,
    chance_table=True,
)

# issue 13's laptop comparison. The screen (docs/results/laptop-screen) found SmolLM2-135M
# above chance zero-shot only on SciQ and ARC-Easy (z = +11, +12; ARC-Challenge, OpenBookQA,
# CommonsenseQA, MMLU, MedMCQA within or below chance), so ARC-Easy is the one OOD set; the
# calm-dynamics recipe (60 steps of 8 questions, calibration batch 8) with 300 test questions.
# CALM's "best setting" from calm-dynamics, by the calibration-split NLL among the settings
# whose upper level uses no labels: plain SGD (1.16 against the default's 1.25).
LAPTOP = Study(
    name="laptop",
    description="SmolLM2-135M-Instruct, cloze, SciQ -> ARC-Easy, 60 steps, 300 + 300 test "
                "questions, split seed 0",
    common=("--split-seed", "0", "--steps", "60", "--eval-calib", "--no-zero-shot",
            "--in-domain", "sciq", "--out-of-domain", "arc_easy", "--n-test", "300",
            "--n-ood", "300"),
    seeds=(0, 1, 2),
    variants=(
        Variant("reference", ("none", "ts"), seeds=(0,), note="no training: one seed suffices"),
        Variant("sft", ("sft", "label_smoothing")),
        Variant("rcft_released", ("rcft",), ("--no-rcft-include-top-bin",),
                note="the CFT paper's released regularizer: top bin skipped, E-step once"),
        Variant("rcft_fixed", ("rcft",), ("--rcft-reestimate-every", "10"),
                note="both defects fixed: every bin, E-step every 10 steps"),
        # added after the first two seeds: at the released scale s = 1e-3 both variants above
        # equal SFT to every printed decimal (AdamW absorbs the (1 - w) factor, and w·s·R is
        # ~1e-4 of the SFT term), so this one asks whether the regularizer does anything at all
        Variant("rcft_scaled", ("rcft",), ("--rcft-scale", "1", "--rcft-reestimate-every", "10"),
                note="fixed, and the regularizer at unit scale (s = 1 instead of 1e-3)"),
        Variant("calm", ("calm",), note="CALM as configured (BOME, AdamW)"),
        Variant("ablations", ("calm_iterate", "calm_regularization", "calm_scalar"),
                ("--no-eval-without-alpha",), note="the CALM paper's ablations"),
        Variant("calm_sgd", ("calm",), ("--bome-optimizer", "sgd", "--no-eval-without-alpha"),
                note="the best calm-dynamics setting by calibration NLL: BOME with plain SGD"),
        Variant("itd", ("calm",), ("--solver", "itd", "--no-eval-without-alpha"),
                note="the same bilevel problem through unrolled differentiation"),
        Variant("aid", ("calm",), ("--solver", "aid", "--no-eval-without-alpha"),
                note="the same bilevel problem through implicit differentiation (CG)"),
    ),
    # median seconds per step in this study's own histories (docs/results/laptop, 2 cores). SFT
    # and label smoothing train on the gold answer alone, so their steps predate and equal the
    # packed shared-prefix layout's (seed 0, 2026-12-04). The RCFT and CALM-family steps, whose
    # batches hold every option, are the seed-2 cells run with packed scoring (2026-12-05): rcft
    # 0.91 s, calm with plain-SGD BOME 2.94 s (taken for calm too: the same forward and backward
    # passes, AdamW's update is negligible), itd 4.27 s, aid 6.56 s. The three ablations were
    # only measured before packed scoring (seed 0); the others' steps fell to 0.54-0.80 of that,
    # so theirs are an upper bound. 0.06 s per scored question with packed scoring
    # (rcft_released-seed2: 120 s, of which 60 s training; 0.13 s before).
    step_s={"sft": 1.22, "label_smoothing": 1.11, "rcft": 0.91, "calm": 2.94, "calm_iterate": 2.0,
            "calm_regularization": 2.9, "calm_scalar": 3.9, "calm:itd": 4.27, "calm:aid": 6.56,
            "none": 0.0, "ts": 0.0},
    question_s=0.06, run_s=15.0, questions=700,
    # calm/calm too: the ablation claims compare each ablation with CALM itself
    baselines=("sft/sft", "reference/ts", "calm/calm"),
    seed_major=True,
    # rcft_released/rcft_fixed are left out: they draw sft/sft's curve again
    figure_rows=("reference/none", "reference/ts", "sft/sft", "sft/label_smoothing",
                 "rcft_scaled/rcft", "calm/calm", "calm/calm:no_alpha"),
)

# the open-QA cross-domain table: TriviaQA <-> NQ-open, the open-QA default's recipe with twice
# its test questions
LAPTOP_OPEN_QA = Study(
    name="laptop-open-qa",
    description="SmolLM2-135M-Instruct, open QA (20 sampled answers, exact-match clusters), "
                "TriviaQA <-> NQ-open, 24 steps, 60 + 60 test questions, split seed 0",
    common=("--config", "open_qa", "--split-seed", "0", "--n-test", "60", "--n-ood", "60"),
    seeds=(0, 1, 2),
    variants=(
        Variant("trivia_to_nq", ("none", "ts", "sft", "calm"),
                note="train TriviaQA; test TriviaQA (in-domain) and NQ-open"),
        Variant("nq_to_trivia", ("none", "ts", "sft", "calm"),
                ("--in-domain", "nq_open", "--out-of-domain", "trivia_qa"),
                note="train NQ-open; test NQ-open (in-domain) and TriviaQA"),
    ),
    # this study's own cells (2026-12-06, 2 cores): median 1.6 s per SFT step and 5.8 s per CALM
    # step, 1.1 s per question per row on average for sampling, greedy and verbalized answers
    # (0.6-0.9 s after SFT, whose answers are short, 1.4-1.5 s for the untrained model); its six
    # cells took 14-19 min each, 92 min in all
    step_s={"sft": 1.6, "calm": 5.8}, question_s=1.1, run_s=20.0, questions=120,
    # none too: the CALM paper's open-QA claim is against the model as given
    baselines=("{variant}/sft", "{variant}/ts", "{variant}/none"),
    # one direction per diagram, so each dataset's curves share a domain (in-domain TriviaQA,
    # out-of-domain NQ-open)
    figure_rows=("trivia_to_nq/none", "trivia_to_nq/ts", "trivia_to_nq/sft", "trivia_to_nq/calm",
                 "trivia_to_nq/calm:no_alpha"),
)

# The papers' 7B protocol (configs/paper-7b.yaml) on four aligned models. The CALM paper names
# Llama-3.1-Tulu-8B and Mistral-7B; the exact Mistral checkpoint and the other two models are
# this project's choice (docs/calm.md, "Studies").
PAPER_MODELS = {
    "tulu3-8b": "allenai/Llama-3.1-Tulu-3-8B-DPO",
    "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "olmo2-7b": "allenai/OLMo-2-1124-7B-Instruct",
}
# step time / SFT's step time per method: bench/gpu_smoke.py on the CPU (SmolLM2-135M, fp32,
# the paper-7b preset, 3 steps each, the median of steps 2-3). sft, calm and the three ablations
# from one run on the current code (2026-12-06, bench/results/gpu_smoke_cpu_smollm2_ablations.*);
# label_smoothing and rcft from the earlier run (2026-12-04, gpu_smoke_cpu_smollm2.*), whose calm
# ratio (7.22) predates the fix that runs forwards at parameters other than the live LoRA
# tensors unchecked, and whose ablations failed before it.
PAPER_STEP_RATIO = {"sft": 1.0, "label_smoothing": 1.07, "rcft": 1.02, "calm": 2.32,
                    "calm_iterate": 1.48, "calm_regularization": 2.12, "calm_scalar": 2.12}
PAPER_METHODS = ("none", "ts", "sft", "label_smoothing", "rcft", "calm", "calm_iterate",
                 "calm_regularization", "calm_scalar")
PAPER_7B = Study(
    name="paper-7b",
    description="the papers' protocol: letter mode, MMLU + MedMCQA + OpenBookQA -> ARC-Challenge, "
                "CommonsenseQA, SciQ; LoRA r = 128, bf16, 1,875 steps of 8 questions; GPUs",
    common=("--config", "paper-7b", "--steps", "1875", "--eval-calib", "--split-seed", "0"),
    seeds=(0, 1, 2),
    variants=tuple(Variant(short, PAPER_METHODS, ("--model", name), note=name)
                   for short, name in PAPER_MODELS.items()),
    step_s={}, question_s=0.0, questions=0,
    run_s=300.0,  # loading an 8B model and its tokenizer, building LoRA (assumed)
    baselines=("{variant}/sft", "{variant}/ts"),  # each model against its own SFT and TS
    flops=FlopScale(
        params=8.0e9,
        questions_per_step=8,
        # SmolLM2's tokenizer on the paper-7b prompts (the first 1,000 rows of each offline set):
        # 93 tokens per training question, 156 per question of a micro-batch of 4 padded to its
        # longest (MMLU's long tail; --max-length 512)
        train_tokens=156.0,
        eval_tokens={"mmlu": (1000, 128.0), "medmcqa": (1000, 74.4), "openbookqa": (500, 61.0),
                     "arc_challenge": (1000, 83.8), "commonsense_qa": (1000, 61.7),
                     "sciq": (1000, 57.8), "calib": (500, 93.0)},
        step_ratio=PAPER_STEP_RATIO,
    ),
)

STUDIES: dict[str, Study] = {s.name: s for s in (CALM_DYNAMICS, LAPTOP_SCREEN, LAPTOP,
                                                  LAPTOP_OPEN_QA, PAPER_7B)}


@dataclasses.dataclass(frozen=True)
class Cell:
    variant: Variant
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant.name}-seed{self.seed}"

    def argv(self, study: Study) -> list[str]:
        return [*study.common, "--seed", str(self.seed), "--methods", *self.variant.methods,
                *self.variant.args]


def cells(study: Study) -> list[Cell]:
    """Variant-major order (the first variants have every seed before later ones start), or
    seed-major with ``study.seed_major``."""
    out = [Cell(v, s) for v in study.variants for s in (v.seeds or study.seeds)]
    if study.seed_major:
        out.sort(key=lambda c: (c.seed, study.variants.index(c.variant)))  # stable, by seed
    return out


def _steps(study: Study) -> int:
    return int(_flag(study.common, "--steps", "24"))


def _flag(argv: Sequence[str], name: str, default: str) -> str:
    """The value given to ``name`` in ``argv`` (the last one, as argparse reads it), else
    ``default``."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else default


def _family(method: str) -> str:
    return "calm" if method.startswith("calm") else method


def estimate_s(study: Study, cell: Cell) -> float:
    """Estimated seconds of a cell: model load, every trained method's steps (each point of a
    ``--select`` grid trains once; RCFT's E-steps score the training set), and one prediction
    per row (CALM rows twice: with and without α). CPU costs from ``step_s`` (by method, else by family) and ``question_s``, or
    GPU seconds from ``flops``."""
    args = list(cell.variant.args)
    if study.flops is not None:
        step = study.flops.step_s
        prediction = study.flops.prediction_s()
    else:
        solver = _flag(args, "--solver", "")

        def step(m: str) -> float:  # "calm:itd" for calm through another solver
            for key in (f"{m}:{solver}", m, _family(m)):
                if key in study.step_s:
                    return study.step_s[key]
            return 0.0
        prediction = study.questions * study.question_s
    trains = [m for m in cell.variant.methods if step(m) > 0]
    grid = 1
    if "--select" in args:
        for entry in args[args.index("--select") + 1:]:
            if entry.startswith("--"):
                break
            grid *= len(entry.split("=", 1)[1].split(","))
    train = sum(step(m) * (grid if m in trains else 1) for m in cell.variant.methods) * _steps(study)
    if "rcft" in cell.variant.methods and study.flops is None:  # its E-steps score n_train
        argv = [*study.common, *args]
        every = int(_flag(argv, "--rcft-reestimate-every", "0"))
        n_train = int(_flag(argv, "--n-train", "400"))  # the config's default
        train += (1 + ((_steps(study) - 1) // every if every else 0)) * n_train * study.question_s
    twice = "--no-eval-without-alpha" not in (*study.common, *args)
    scored = sum((2 if twice and m.startswith("calm") else 1) * (grid if m in trains else 1)
                 for m in cell.variant.methods)
    return study.run_s + train + scored * prediction


def done(run_dir: Path, cell: Cell) -> bool:
    """Whether every requested method has its row in the cell's metrics.json."""
    f = run_dir / "metrics.json"
    if not f.is_file():
        return False
    try:
        results = json.loads(f.read_text())["results"]
    except (OSError, ValueError, KeyError):
        return False
    return all(m in results for m in cell.variant.methods)


def run(study: Study, root: Path, *, dry_run: bool = False, python: str = sys.executable) -> int:
    """Run every unfinished cell in order; one progress line per cell with the study's ETA."""
    todo = [c for c in cells(study) if not done(root / c.name, c)]
    est = {c.name: estimate_s(study, c) for c in todo}
    if study.flops is not None:
        f = study.flops
        print(f"study {study.name}: {len(cells(study))} cells, {len(todo)} to run, estimated "
              f"{sum(est.values()) / 3600:.0f} GPU-hours on one GPU at {f.utilization:.0%} of "
              f"{f.peak_flops / 1e12:.0f} TFLOP/s, scaled by FLOPs from CPU step ratios "
              f"({study.description})")
    else:
        print(f"study {study.name}: {len(cells(study))} cells, {len(todo)} to run, "
              f"estimated {sum(est.values()) / 60:.0f} min ({study.description})")
    if dry_run:
        for c in cells(study):
            unit = (3600, "GPU-h") if study.flops is not None else (60, "min")
            state = "done" if c not in todo else f"~{est[c.name] / unit[0]:.1f} {unit[1]}"
            print(f"  {c.name:<22} {state:<10} python -m apps.calm_llm {' '.join(c.argv(study))}")
        return 0
    root.mkdir(parents=True, exist_ok=True)
    log = root / "cells.jsonl"
    failures = 0
    t_start, spent, predicted = time.time(), 0.0, 0.0
    for i, c in enumerate(todo):
        run_dir = root / c.name
        where = ["--resume", str(run_dir)] if (run_dir / "config.json").is_file() else \
            ["--out", str(run_dir)]
        argv = [python, "-m", "apps.calm_llm", *(c.argv(study) if where[0] == "--out" else []), *where]
        # measured cells rescale the estimate of the rest
        scale = spent / predicted if predicted else 1.0
        eta = scale * sum(est[x.name] for x in todo[i:]) / 60
        print(f"[{i + 1}/{len(todo)}] {c.name}: started {time.strftime('%H:%M')}, study ETA "
              f"{eta:.0f} min", flush=True)
        t0 = time.time()
        with open(root / f"{c.name}.log", "a") as out:
            rc = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT)
        dt = time.time() - t0
        spent, predicted = spent + dt, predicted + est[c.name]
        with open(log, "a") as f:
            f.write(json.dumps({"cell": c.name, "rc": rc, "seconds": round(dt, 1),
                                "argv": argv[3:]}) + "\n")
        print(f"[{i + 1}/{len(todo)}] {c.name}: {'done' if rc == 0 else f'FAILED (rc {rc})'} in "
              f"{dt / 60:.1f} min (log {run_dir}.log)", flush=True)
        failures += rc != 0
    print(f"study {study.name}: {len(todo) - failures} cells run, {failures} failed, "
          f"{(time.time() - t_start) / 60:.0f} min")
    return 1 if failures else 0


# -- summary -------------------------------------------------------------------------------------
def _predictions(run_dir: Path) -> dict[str, Any]:
    """The cell's saved option probabilities, or ``{}`` for a published cell kept without them."""
    from safetensors.torch import load_file

    f = run_dir / "predictions.safetensors"
    return load_file(str(f)) if f.is_file() else {}


@dataclasses.dataclass(frozen=True, eq=False)  # holds arrays: no elementwise ==, no hash
class Questions:
    """One seed's predictions of one row on a dataset's N questions, as the question-level
    numbers (pooled intervals, paired differences) resample them.

    Multiple choice (``options``): ``x`` the option probabilities (N, K), ``y`` the labels (N,);
    the calibration error is conf-ECE. Open QA (``binary``): ``x`` the semantic-cluster
    confidence (N,), ``y`` whether the modal sampled answer is right (N,); the calibration error
    is Semantic-ECE (the same equal-width binning over a binary outcome). ``ids`` name the
    questions where the run saved them, so rows are only paired on the same questions; ``n_bins``
    is the run's ``--n-bins``, so the intervals bin as its ``metrics.json`` means do.
    """

    kind: str  # "options" | "binary"
    x: np.ndarray
    y: np.ndarray
    ids: tuple[str, ...] | None = None
    n_bins: int = 10

    @classmethod
    def options(cls, probs: np.ndarray, labels: np.ndarray, *, n_bins: int = 10) -> Questions:
        return cls("options", np.asarray(probs, dtype=np.float64), np.asarray(labels), n_bins=n_bins)

    @classmethod
    def binary(cls, confidence: np.ndarray, correct: np.ndarray,
               ids: Sequence[str] | None = None, *, n_bins: int = 10) -> Questions:
        return cls("binary", np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=bool),
                   None if ids is None else tuple(ids), n_bins)

    @property
    def n(self) -> int:
        return int(self.y.shape[0])

    @property
    def error_name(self) -> str:
        """The calibration error's key in ``study.json``: ``conf_ece`` or ``semantic_ece``."""
        return "conf_ece" if self.kind == "options" else "semantic_ece"

    def error(self, idx: np.ndarray) -> float:
        """conf-ECE (options) or Semantic-ECE (binary) of the questions ``idx`` (with repeats)."""
        import torch

        if self.kind == "options":
            from calibration.metrics import conf_ece

            return conf_ece(torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx]),
                            n_bins=self.n_bins)
        from calibration.semantic import semantic_ece

        return semantic_ece(torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx]), self.n_bins)

    def accuracy(self, idx: np.ndarray) -> float:
        """Top-option accuracy (options) or the modal answer's (binary) of the questions ``idx``."""
        if self.kind == "options":
            import torch

            from calibration.metrics import accuracy

            return accuracy(torch.from_numpy(self.x[idx]), torch.from_numpy(self.y[idx]))
        return float(np.mean(self.y[idx]))


def _aligned(*rows: list[Questions]) -> tuple[int, str]:
    """The common number of questions and calibration-error name of rows' seeds; a clear error
    when they are not predictions of the same kind on the same questions."""
    seeds = [q for row in rows for q in row]
    if not seeds:
        raise ValueError("no seeds to resample")
    first = seeds[0]
    for q in seeds[1:]:
        if q.kind != first.kind or q.n != first.n or q.n_bins != first.n_bins:
            raise ValueError(f"seeds disagree on the questions: {q.kind} N={q.n} n_bins={q.n_bins} "
                             f"vs {first.kind} N={first.n} n_bins={first.n_bins}")
        differ = (q.ids != first.ids if q.ids is not None and first.ids is not None else
                  q.kind == "options" and not np.array_equal(q.y, first.y))  # same labels
        if differ:
            raise ValueError("seeds answered different questions (their ids or labels differ); "
                             "run every cell with the same --split-seed")
    return first.n, first.error_name


def pooled_interval(seeds: list[Questions], *, n_boot: int = 1000,
                    seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean-over-seeds calibration error (conf-ECE or Semantic-ECE),
    resampling questions jointly across seeds (each drawn question brings every seed's
    prediction of it), so seed noise and question noise are both in it."""
    n, _ = _aligned(seeds)
    rng = np.random.default_rng(seed)
    values = np.empty(n_boot)
    for b in range(n_boot):
        idx = rng.integers(0, n, n)
        values[b] = np.mean([q.error(idx) for q in seeds])
    return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))


def paired_difference(a: list[Questions], b: list[Questions], *, n_boot: int = 1000,
                      seed: int = 0) -> dict[str, dict[str, float]]:
    """Row a minus row b on the same questions: the calibration error (key ``conf_ece`` or
    ``semantic_ece``) and accuracy, each averaged over the row's seeds, with a 95 % bootstrap
    interval that resamples questions once for both rows (so question difficulty cancels) and
    the share of resamples in which a is not better."""
    n, error_name = _aligned(a, b)
    rng = np.random.default_rng(seed)
    full = np.arange(n)
    draws = [rng.integers(0, n, n) for _ in range(n_boot)]
    out = {}
    for name, metric, lower_better in ((error_name, Questions.error, True),
                                       ("accuracy", Questions.accuracy, False)):
        def mean(row: list[Questions], idx: np.ndarray, metric: Any = metric) -> float:
            return float(np.mean([metric(q, idx) for q in row]))

        diff = mean(a, full) - mean(b, full)
        boot = np.array([mean(a, i) - mean(b, i) for i in draws])
        worse = boot >= 0 if lower_better else boot <= 0
        out[name] = {"diff": float(diff), "ci": [float(np.quantile(boot, 0.025)),
                                                 float(np.quantile(boot, 0.975))],
                     "p_not_better": float(worse.mean())}
    return out


def against_chance(probs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Accuracy of one prediction against picking an option uniformly at random.

    ``probs``: (N, K_max) option probabilities, zero-padded past each question's K_i options;
    ``labels``: (N,). Chance accuracy is mean_i 1/K_i; under chance the number right has mean
    Σ 1/K_i and variance Σ (1/K_i)(1 − 1/K_i), and ``z`` is the standardized number right. K_i
    counts the nonzero probabilities, so an option whose probability underflows to 0 in float32
    (≥ 100 nats below the best) is not counted: chance can only be overstated, never understated.
    """
    p = 1.0 / np.maximum((probs > 0).sum(axis=1), 1)
    right = float((probs.argmax(axis=1) == labels).sum())
    sd = float(np.sqrt(np.sum(p * (1 - p))))
    n = labels.shape[0]
    return {"n": n, "accuracy": right / n, "chance": float(p.mean()),
            "z": (right - float(p.sum())) / sd if sd > 0 else 0.0}


DYNAMICS_MEAN = ("lambda", "cos", "cos_outer", "cos_inner", "calib_entropy")
DYNAMICS_LAST = ("alpha_tau_min", "alpha_tau_max", "alpha_l_min", "alpha_l_max", "alpha_moved")


def dynamics(history: Path) -> dict[str, float]:
    """Over one trained row's steps: the mean of λ, the cosines and the calibration entropy, and
    α's range after the last step (keys a method does not record are left out)."""
    from apps.calm_llm.history import read_history  # a damaged line is named, with the fix

    steps = read_history(history)
    out = {f"mean_{k}": float(np.mean([h[k] for h in steps])) for k in DYNAMICS_MEAN
           if steps and all(k in h for h in steps)}
    out.update({f"last_{k}": float(steps[-1][k]) for k in DYNAMICS_LAST if steps and k in steps[-1]})
    return out


def _dynamics_table(summary: dict[str, Any]) -> list[str]:
    present = {k for e in summary["rows"].values() for k in e.get("dynamics", {})}
    keys = [k for k in (*(f"mean_{x}" for x in DYNAMICS_MEAN), *(f"last_{x}" for x in DYNAMICS_LAST))
            if k in present]
    if not keys:
        return []
    lines = ["| variant / row | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for key, e in summary["rows"].items():
        d = e.get("dynamics")
        if d:
            lines.append(f"| {key} | " + " | ".join(f"{d[k]:.3g}" if k in d else "–" for k in keys) + " |")
    return lines


def _carry_forward(rows: dict[str, dict[str, Any]], previous: dict[str, Any]) -> None:
    """Keep the question-level numbers (pooled interval, paired differences) of an earlier
    ``study.json`` for the rows whose predictions are no longer on disk, when the rows (and the
    baseline they were paired with) still hold the same seeds; each is listed in ``carried``."""
    old = previous.get("rows", {})
    for key, entry in rows.items():
        before = old.get(key)
        if before is None or before.get("seeds") != entry["seeds"]:
            continue
        for ds, d in entry["datasets"].items():
            b = before.get("datasets", {}).get(ds, {})
            for ci in ("conf_ece_pooled_ci", "semantic_ece_pooled_ci"):
                if ci not in d and ci in b:
                    d[ci] = b[ci]
                    d.setdefault("carried", []).append(ci)
            for base, value in b.get("vs", {}).items():
                same_base = old.get(base, {}).get("seeds") == rows.get(base, {}).get("seeds")
                if base not in d["vs"] and same_base:
                    d["vs"][base] = value
                    d.setdefault("carried", []).append(f"vs {base}")


def _add_cell(rows: dict[str, dict[str, Any]], c: Cell, run_dir: Path) -> None:
    """One finished cell's rows into ``rows``: each metric's per-seed value, the question-level
    predictions (option probabilities or open-QA answers, when kept) and the training dynamics,
    by ``variant/row`` and dataset."""
    results = json.loads((run_dir / "metrics.json").read_text())["results"]
    questions = _questions(run_dir)
    for row, per_ds in results.items():
        key = f"{c.variant.name}/{row}"
        entry = rows.setdefault(key, {"variant": c.variant.name, "row": row, "seeds": [],
                                      "datasets": {}})
        entry["seeds"].append(c.seed)
        history = run_dir / f"history_{row}.jsonl"
        if history.is_file():  # averaged over seeds below
            entry.setdefault("_dynamics", []).append(dynamics(history))
        for ds, r in per_ds.items():
            d = entry["datasets"].setdefault(ds, {"domain": r["domain"], "values": {},
                                                  "_questions": []})
            base = results.get(row.split(":", 1)[0], {}).get(ds, {})
            # runs before the fix copied the α row's calibration numbers into :no_alpha
            copied = row.endswith(":no_alpha") and r.get("calib_nll") == base.get("calib_nll")
            for m in dict.fromkeys((*METRICS, *OPEN_QA_METRICS, *(() if copied else CALIB))):
                if isinstance(r.get(m), (int, float)):
                    d["values"].setdefault(m, []).append(float(r[m]))
            for kind, conf in r.get("confidences", {}).items():  # open QA
                if "semantic_ece" in conf:
                    d["values"].setdefault(f"semantic_ece/{kind}", []).append(
                        float(conf["semantic_ece"]))
                if kind == "semantic" and "mean_confidence" in conf:
                    d["values"].setdefault("mean_confidence", []).append(
                        float(conf["mean_confidence"]))
            q = questions.get((row, ds))
            if q is not None:
                d["_questions"].append(q)


def _questions(run_dir: Path) -> dict[tuple[str, str], Questions]:
    """(row, dataset) -> the cell's question-level predictions: the option probabilities of
    ``predictions.safetensors`` (multiple choice; (N, K_max), zero-padded options), or the
    semantic-cluster confidence and modal correctness of the records an open-QA run keeps; empty
    for a published cell kept without them."""
    out: dict[tuple[str, str], Questions] = {}
    config = run_dir / "config.json"
    n_bins = int(json.loads(config.read_text()).get("n_bins", 10)) if config.is_file() else 10
    preds = _predictions(run_dir)
    for name, p in preds.items():
        row, ds, what = name.rsplit("/", 2)
        if what == "probs":
            out[(row, ds)] = Questions.options(p.double().numpy(), preds[f"{row}/{ds}/labels"].numpy(),
                                               n_bins=n_bins)
    from apps.calm_llm.open_qa import score

    for row, per_ds in score.read_records(run_dir).items():
        for ds, records in per_ds.items():
            if not records:
                continue
            # the semantic kind keeps every record (verbalized would drop unparsed ones), so the
            # ids line up with the pairs
            conf, correct = score.confidence_pairs(records, "semantic")
            out[(row, ds)] = Questions.binary(conf.numpy(), correct.numpy(), [r.id for r in records],
                                              n_bins=n_bins)
    return out


@contextlib.contextmanager
def _naming(what: str) -> Iterator[None]:
    """Re-raise a ValueError of the question-level numbers with the row and dataset it is about."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e


def summarize(study: Study, root: Path, *, n_boot: int = 1000) -> dict[str, Any]:
    """Collect finished cells into ``study.json`` and ``study.md`` under ``root``.

    Cells kept without their question-level predictions (``predictions.safetensors``, or an
    open-QA run's answers; published before they were kept) contribute
    their metrics; their pooled intervals and paired differences come from the ``study.json``
    already in ``root`` where its seeds match (marked ``carried``), else they are left out.
    """
    previous_file = root / "study.json"
    previous = json.loads(previous_file.read_text()) if previous_file.is_file() else {}
    rows: dict[str, dict[str, Any]] = {}
    for c in cells(study):
        if done(root / c.name, c):
            _add_cell(rows, c, root / c.name)
    for key, entry in rows.items():
        for ds, d in entry["datasets"].items():
            qs = d["_questions"]
            if len(qs) != len(entry["seeds"]):  # question-level numbers need every seed
                d["_questions"] = qs = []
            d["mean"] = {m: float(np.mean(v)) for m, v in d["values"].items()}
            d["std"] = {m: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
                        for m, v in d["values"].items()}
            if qs:
                with _naming(f"{key} on {ds}"):
                    d[f"{qs[0].error_name}_pooled_ci"] = list(pooled_interval(qs, n_boot=n_boot))
                if study.chance_table and qs[0].kind == "options":  # the first seed's prediction
                    d["vs_chance"] = against_chance(qs[0].x, qs[0].y)
    for key, entry in rows.items():  # paired against the baselines, on the same questions
        for ds, d in entry["datasets"].items():
            d["vs"] = {}
            for template in study.baselines:
                base = template.format(variant=entry["variant"])
                b = rows.get(base, {}).get("datasets", {}).get(ds)
                if base != key and b is not None and d["_questions"] and b["_questions"]:
                    with _naming(f"{key} against {base} on {ds}"):
                        d["vs"][base] = paired_difference(d["_questions"], b["_questions"],
                                                          n_boot=n_boot)
    _carry_forward(rows, previous)
    for entry in rows.values():
        for d in entry["datasets"].values():
            del d["_questions"]
        per_seed = entry.pop("_dynamics", [])
        if per_seed:
            entry["dynamics"] = {k: float(np.mean([p[k] for p in per_seed])) for k in per_seed[0]}
    out = {"study": study.name, "description": study.description, "rows": rows,
           "variants": {v.name: {"methods": list(v.methods), "args": list(v.args), "note": v.note}
                        for v in study.variants},
           "common": list(study.common), "baselines": list(study.baselines),
           "chance_table": study.chance_table}
    (root / "study.json").write_text(json.dumps(out, indent=1))
    (root / "study.md").write_text(markdown(out))
    return out


def _open_qa_table(summary: dict[str, Any], ds: str) -> list[str]:
    kinds = sorted({m.split("/", 1)[1] for e in summary["rows"].values()
                    for m in e["datasets"].get(ds, {}).get("mean", {}) if m.startswith("semantic_ece/")})
    kinds = [k for k in ("semantic", "split_half") if k in kinds] + \
        [k for k in kinds if k not in ("semantic", "split_half")]
    cols = [("accuracy", "accuracy"), ("greedy accuracy", "greedy_accuracy"),
            *((f"Semantic-ECE ({k})", f"semantic_ece/{k}") for k in kinds if k == "semantic"),
            ("pooled 95% CI of Semantic-ECE (semantic)", "semantic_ece_pooled_ci"),
            *((f"Semantic-ECE ({k})", f"semantic_ece/{k}") for k in kinds if k != "semantic"),
            ("Brier", "brier"), ("AUROC", "auroc"), ("confidence", "mean_confidence"),
            ("clusters / question", "mean_clusters")]
    lines = ["| variant / row | seeds | " + " | ".join(c[0] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for key, e in summary["rows"].items():
        d = e["datasets"].get(ds)
        if d is not None:
            lines.append(f"| {key} | {len(e['seeds'])} | " + " | ".join(
                _pooled_cell(d, m) if m.endswith("_pooled_ci") else
                f"{d['mean'][m]:.3f} ± {d['std'][m]:.3f}" if m in d["mean"] else "–"
                for _, m in cols) + " |")
    return lines


def _pooled_cell(d: dict[str, Any], key: str) -> str:
    ci = d.get(key)
    mark = "†" if key in d.get("carried", ()) else ""
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]{mark}" if ci else "–"


def _metrics_table(summary: dict[str, Any], ds: str) -> list[str]:
    if any("semantic_ece" in e["datasets"].get(ds, {}).get("mean", {}) for e in summary["rows"].values()):
        return _open_qa_table(summary, ds)
    lines = ["| variant / row | seeds | accuracy | conf-ECE | pooled 95% CI | cw-ECE | Brier | NLL | "
             "confidence | calib NLL | calib conf-ECE |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, e in summary["rows"].items():
        d = e["datasets"].get(ds)
        if d is None:
            continue

        def cell(m: str, d: dict = d) -> str:
            return f"{d['mean'][m]:.3f} ± {d['std'][m]:.3f}" if m in d["mean"] else "–"

        lines.append(f"| {key} | {len(e['seeds'])} | {cell('accuracy')} | {cell('conf_ece')} | "
                     f"{_pooled_cell(d, 'conf_ece_pooled_ci')} | {cell('cw_ece')} | {cell('brier')} | {cell('nll')} | "
                     f"{cell('mean_confidence')} | {cell('calib_nll')} | {cell('calib_conf_ece')} |")
    return lines


def _paired_table(summary: dict[str, Any], ds: str) -> list[str]:
    bases = summary.get("baselines", [])
    if not bases:
        return []
    open_qa = any("semantic_ece" in e["datasets"].get(ds, {}).get("mean", {})
                  for e in summary["rows"].values())
    error, label = ("semantic_ece", "Semantic-ECE") if open_qa else ("conf_ece", "conf-ECE")
    names = [b.format(variant="VARIANT") for b in bases]  # "{variant}/sft": each variant's own
    head = "| variant / row | " + " | ".join(f"Δ {label} vs {b} | Δ accuracy vs {b}" for b in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(bases)]
    for key, e in summary["rows"].items():
        vs = e["datasets"].get(ds, {}).get("vs", {})
        cells = []
        for template in bases:
            b = template.format(variant=e["variant"])
            for m in (error, "accuracy"):
                v = vs.get(b, {}).get(m)
                mark = "†" if f"vs {b}" in e["datasets"].get(ds, {}).get("carried", ()) else ""
                cells.append("–" if v is None else
                             f"{v['diff']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}] "
                             f"p={v['p_not_better']:.2f}{mark}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """Per dataset: mean ± std over seeds with the pooled 95 % interval of conf-ECE (open QA:
    Semantic-ECE), then each
    row minus each baseline on the same questions (95 % interval; p = share of resamples in
    which the row is not better)."""
    lines = [f"# Study {summary['study']}", "", summary["description"], ""]
    datasets: dict[str, str] = {}
    for e in summary["rows"].values():
        for ds, d in e["datasets"].items():
            datasets.setdefault(ds, d["domain"])
    for ds, domain in datasets.items():
        lines += [f"## {ds} ({domain})", "", *_metrics_table(summary, ds), ""]
        paired = _paired_table(summary, ds)
        if paired:
            lines += ["Paired on the same questions (row minus baseline, 95% interval, p = share "
                      "of resamples where the row is not better):", "", *paired, ""]
    if any(d.get("carried") for e in summary["rows"].values() for d in e["datasets"].values()):
        lines += ["† carried from the previous summary: the cell's predictions were not kept, its "
                  "seeds (and the baseline's) are unchanged.", ""]
    if summary.get("chance_table"):
        lines += ["## Accuracy against chance", "",
                  "z = (right − expected right under chance) / its standard deviation; chance = "
                  "mean over questions of 1 / (number of options).", "",
                  "| variant / row | dataset | domain | questions | accuracy | chance | z |",
                  "|---|---|---|---|---|---|---|"]
        for key, e in summary["rows"].items():
            for ds, d in e["datasets"].items():
                c = d.get("vs_chance")
                if c:
                    lines.append(f"| {key} | {ds} | {d['domain']} | {c['n']} | {c['accuracy']:.3f} | "
                                 f"{c['chance']:.3f} | {c['z']:+.1f} |")
        lines.append("")
    dyn = _dynamics_table(summary)
    if dyn:
        lines += ["## Training dynamics (mean over seeds)", "", *dyn, ""]
    lines += ["## Variants", ""]
    for name, v in summary["variants"].items():
        lines.append(f"- `{name}`: `--methods {' '.join(v['methods'])} {' '.join(v['args'])}` "
                     f"— {v['note']}")
    lines += ["", f"Every cell: `python -m apps.calm_llm {' '.join(summary['common'])} --seed K ...`", ""]
    return "\n".join(lines)


# what a published cell keeps: its inputs, its numbers, its curves, and the option probabilities
# the pooled intervals and paired tests are computed from (~10 KB per cell; open-QA cells keep
# their answers instead, xz-compressed by publish); no checkpoints
PUBLISHED = ("config.json", "metrics.json", "results.md", "predictions.safetensors")


def publish(study: Study, root: Path, dest: Path) -> list[Path]:
    """Copy the small files of every finished cell, ``study.json``/``study.md`` and
    ``cells.jsonl`` from ``root`` to ``dest`` (e.g. ``docs/results/<study>``); returns the
    files written."""
    import shutil

    from apps.calm_llm.open_qa.score import PREDICTIONS as OPEN_QA_RECORDS

    written = []
    for c in cells(study):
        src = root / c.name
        if not done(src, c):
            continue
        names = [*PUBLISHED, *sorted(p.name for p in src.glob("history_*.jsonl"))]
        for name in names:
            if (src / name).is_file():
                (dest / c.name).mkdir(parents=True, exist_ok=True)
                written.append(Path(shutil.copy2(src / name, dest / c.name / name)))
        if (src / OPEN_QA_RECORDS).is_file():  # every sampled answer: ~1 MB a cell, ~0.2 MB as xz
            out = dest / c.name / f"{OPEN_QA_RECORDS}.xz"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(lzma.compress((src / OPEN_QA_RECORDS).read_bytes(), preset=9))
            written.append(out)
    for name in ("study.json", "study.md", "cells.jsonl"):
        if (root / name).is_file():
            dest.mkdir(parents=True, exist_ok=True)
            written.append(Path(shutil.copy2(root / name, dest / name)))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m apps.study", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(STUDIES))
    ap.add_argument("--root", default="", help="folder of the cells (default: runs/study-NAME)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells and estimated time")
    ap.add_argument("--summarize", action="store_true",
                    help="only write study.json/study.md from the finished cells")
    ap.add_argument("--n-boot", type=int, default=1000, help="resamples of the pooled interval")
    ap.add_argument("--publish", default="", metavar="DEST",
                    help="copy the finished cells' small files and the summary to DEST "
                         "(e.g. docs/results/NAME) and exit")
    ap.add_argument("--figures", default="", metavar="DEST",
                    help="write the pooled reliability diagrams and training curves of the "
                         "finished cells to DEST (e.g. docs/img/NAME) and exit")
    a = ap.parse_args(argv)
    study = STUDIES[a.name]
    root = Path(a.root or f"runs/study-{study.name}")
    if root.exists() and not root.is_dir():
        ap.error(f"--root {root}: a file is there, not a folder of cells; give a folder "
                 f"(default runs/study-{study.name})")
    if not 2 <= a.n_boot <= 1_000_000:  # an interval needs two resamples; more is only slower
        ap.error(f"--n-boot: between 2 and 1,000,000 resamples, got {a.n_boot:,}")
    if a.figures:
        from apps import study_figures

        if not study.figure_rows:
            print(f"study {study.name} names no figure_rows: no reliability diagrams", file=sys.stderr)
        written = study_figures.reliability(study, root, Path(a.figures), study.figure_rows)
        try:
            written.append(study_figures.training_curves(study, root, Path(a.figures)))
        except ValueError as e:  # nothing trained, or no finished cell under root
            print(f"no training curves: {e}", file=sys.stderr)
        print("\n".join(str(p) for p in written))
        return 0 if written else 1
    if a.publish:
        written = publish(study, root, Path(a.publish))
        print(f"{len(written)} files copied to {a.publish}")
        return 0
    if a.summarize:
        summarize(study, root, n_boot=a.n_boot)
        print((root / "study.md").read_text())
        return 0
    rc = run(study, root, dry_run=a.dry_run)
    if not a.dry_run:
        summarize(study, root, n_boot=a.n_boot)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
