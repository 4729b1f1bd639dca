"""The named studies (`STUDIES`): each a grid of ordinary ``apps.calm_llm`` runs (variants ×
seeds), the costs ``--dry-run`` estimates from, and the primary comparisons its claims are
decided by. The types they are built of (`Study`, `Variant`, `Comparison`, `FlopScale`, the
split roles) are in `design`, re-exported here.
"""

from __future__ import annotations

from apps.study.design import (
    DEVELOPMENT,
    ROLES,
    SPLIT_KINDS,
    Comparison,
    FlopScale,
    Study,
    Variant,
    family,
)

__all__ = ["CALM_COUPLING", "CALM_DIAGNOSIS", "CALM_DYNAMICS", "DEVELOPMENT", "FINAL", "FINAL_OOD",
           "LAPTOP", "LAPTOP_OPEN_QA", "LAPTOP_PRIMARY", "LAPTOP_SCREEN", "PAPER_7B",
           "PAPER_METHODS", "PAPER_MODELS", "PAPER_STEP_RATIO", "ROLES", "SCREEN_SETS",
           "SPLIT_KINDS", "STUDIES", "TS_SHIFT_SCREEN", "TS_SHIFT_TRAINED", "Comparison",
           "FlopScale", "Study", "Variant", "family"]


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
    # docs/calm.md's conclusion: no CALM setting beats SFT, none gets near TS out of domain
    primary=(
        Comparison("default/calm", "default/sft", "arc_easy", "error", "CALM vs SFT out of domain"),
        Comparison("default/calm", "reference/ts", "arc_easy", "error", "CALM vs TS out of domain"),
    ),
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

# issue 28: does temperature scaling fail out of domain here at all? The untrained model only
# (nothing is trained, so any failure is the shift's, not a method's): T fitted on the in-domain
# calibration split (TS, 200 questions) against the temperature that is best on each test set,
# for the candidate shifts the offline data allow with the model above chance: a domain shift
# (SciQ -> ARC-Easy; the reverse, ARC-Easy -> SciQ, by T_opt of one set applied to the other),
# and a prompt-format shift (paper prompts <-> chat template; the cross-format pairs are formed
# from the two cells by apps.study.shift). Letter mode is left out:
# the model is at chance there (docs/results.md, "Which sets the model can be tested on").
TS_SHIFT_SCREEN = Study(
    name="ts-shift-screen",
    description="SmolLM2-135M-Instruct untrained, cloze: T fitted in domain (TS) against each "
                "test set's best T, for domain and prompt-format shifts; split seed 0",
    common=("--split-seed", "0", "--no-zero-shot", "--in-domain", "sciq", "--out-of-domain",
            "arc_easy", "--n-calib", "150", "--n-test", "250", "--n-ood", "250", "--n-boot", "200"),
    seeds=(0,),
    variants=(Variant("paper", ("none", "ts"), ("--prompt-style", "paper"),
                      note="the paper's prompt"),
              Variant("chat", ("none", "ts"), ("--prompt-style", "chat"),
                      note="the model's chat template")),
    # from the paper cell, scored while the 2 cores were shared with other jobs: an upper bound
    step_s={"none": 0.0, "ts": 0.0}, question_s=0.15, run_s=15.0, questions=650,
)

# issue 28, the screen with trained models: the untrained screen above found TS transferring on
# every shift, but the CALM paper's premise concerns fine-tuned models. The same shifts after
# fine-tuning: SFT on SciQ multiple choice under each prompt format (the format shift is formed
# across the two cells, as above), and the paper's protocol, instruction-style SFT on free-form
# TriviaQA answers (question -> gold answer as a generated target, `trivia_qa_sft`) evaluated on
# the multiple-choice sets. A trained row has no TS row of its own, so T_fit is the NLL-optimal
# temperature of the row on its in-domain test set (SciQ; apps.study.shift): a temperature fitted
# in domain, on questions the model did not train on. Small sizes: 60 steps of 8, 200 + 200
# test questions; seed-major so a stopped screen has every variant's first seed.
TS_SHIFT_TRAINED = Study(
    name="ts-shift-trained",
    description="SmolLM2-135M-Instruct fine-tuned 60 steps (SFT on SciQ MCQA under the paper "
                "prompt or the chat template; instruction SFT on TriviaQA answers), cloze: T "
                "fitted in domain (SciQ test) against ARC-Easy's best T; split seed 0",
    common=("--split-seed", "0", "--steps", "60", "--no-zero-shot", "--in-domain", "sciq",
            "--out-of-domain", "arc_easy", "--n-calib", "100", "--n-test", "200", "--n-ood",
            "200", "--n-boot", "200"),
    seeds=(0,),
    variants=(Variant("sft_paper", ("sft",), ("--prompt-style", "paper"),
                      note="SFT on SciQ multiple choice, the paper's prompt"),
              Variant("sft_chat", ("sft",), ("--prompt-style", "chat"),
                      note="SFT on SciQ multiple choice, the chat template"),
              Variant("instruct_trivia", ("sft",), ("--prompt-style", "chat", "--instruction-data",
                                                    "trivia_qa_sft", "--n-train", "480"),
                      note="the paper's protocol: SFT on TriviaQA questions with their gold "
                           "answer as the generated target, then multiple choice")),
    # the laptop study's SFT step (1.22 s) and question (0.06 s), on a quiet machine
    step_s={"sft": 1.22}, question_s=0.06, run_s=15.0, questions=400,
    seed_major=True,
)

# issue 13's laptop comparison. The screen (docs/results/laptop-screen) found SmolLM2-135M
# above chance zero-shot only on SciQ and ARC-Easy (z = +11, +12; ARC-Challenge, OpenBookQA,
# CommonsenseQA, MMLU, MedMCQA within or below chance), so ARC-Easy is the one OOD set; the
# calm-dynamics recipe (60 steps of 8 questions, calibration batch 8) with 300 test questions.
# CALM's "best setting" from calm-dynamics, by the calibration-split NLL among the settings
# whose upper level uses no labels: plain SGD (1.16 against the default's 1.25).
# one comparison (or two: ECE and accuracy) per claim of docs/results.md's claims table, decided
# together as one Holm family; every other interval of the study is exploratory
_OOD, _ID = "OOD: CALM beats TS without losing accuracy", "ID: CALM the only method improving both"
_ABL = "ablations lose against CALM"
LAPTOP_PRIMARY = (
    Comparison("calm/calm", "reference/ts", "arc_easy", "error", _OOD),
    Comparison("calm/calm", "sft/sft", "arc_easy", "error", _OOD),
    Comparison("calm/calm", "reference/none", "arc_easy", "accuracy", _OOD),
    Comparison("sft/sft", "reference/ts", "sciq", "error", "ID: TS best in domain"),
    Comparison("calm/calm", "sft/sft", "sciq", "error", _ID),
    Comparison("calm/calm", "sft/sft", "sciq", "accuracy", _ID),
    Comparison("ablations/calm_iterate", "calm/calm", "sciq", "error", _ABL),
    Comparison("ablations/calm_iterate", "calm/calm", "sciq", "accuracy", _ABL),
    Comparison("ablations/calm_regularization", "calm/calm", "sciq", "error", _ABL),
    Comparison("ablations/calm_regularization", "calm/calm", "sciq", "accuracy", _ABL),
    Comparison("ablations/calm_scalar", "calm/calm", "sciq", "error", "scalar alpha is weaker"),
    Comparison("reference/none", "sft/sft", "sciq", "error", "CFT lowers in-domain ECE"),
    # with the line above: SFT improves both accuracy and ECE over the base model too (claim _ID)
    Comparison("sft/sft", "reference/none", "sciq", "accuracy", _ID),
    Comparison("rcft_scaled/rcft", "sft/sft", "sciq", "error", "RCFT keeps calibration"),
)
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
    primary=LAPTOP_PRIMARY,
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
    # the CALM paper's open-QA claim: CALM lowers Semantic-ECE against the model as given; and
    # against post-hoc TS, which the verdict needs to tell calibration from collapse
    primary=tuple(Comparison(f"{v}/calm", f"{v}/{base}", ds, "error", f"open QA: CALM vs {base}")
                  for base in ("none", "ts") for v, sets in (("trivia_to_nq", ("trivia_qa", "nq_open")),
                                                             ("nq_to_trivia", ("nq_open", "trivia_qa")))
                  for ds in sets),
)

# issue 28: CALM's coupling switched on, measured on the development split (the laptop study's
# questions: SciQ and ARC-Easy validation documents, split seed 0, all development already).
# Longer inner loops (T = 10 instead of 2), BOME's control φ as η‖∇q̂‖² or c·q̂ at a weak and a
# strong coefficient, and an α step size able to reach the temperature TS fits: Adam moves each
# raw parameter by at most about its learning rate per step, so 60 steps at 0.01 bound
# |Δ log τ| near 0.6 (0.3 measured), below SciQ's log T_TS = log 5.62 = 1.73; at 0.05 the bound is
# 3.0. The histories record λ per step (apps.study.dynamics): does λ stay at 0 (the coupling
# idle) or follow η?
# a CALM step at T = 10 on 2 cores: the median of the final study's 10 CALM rows' per-step
# medians (history step_seconds, 7.7-9.9 s; 2026-12-06); the T = 2 step scaled by the passes
# over the batch, 2.94 * 11 / 3 = 10.8 s, had overestimated it
CALM_T10_STEP_S = 9.1
_COUPLING = ("--inner-steps", "10", "--alpha-lr", "0.05", "--no-eval-without-alpha")
CALM_COUPLING = Study(
    name="calm-coupling",
    description="SmolLM2-135M-Instruct, cloze, SciQ -> ARC-Easy (development split), 60 steps, "
                "CALM with T = 10 inner steps, alpha lr 0.05, phi and its coefficient varied",
    common=LAPTOP.common,  # the laptop study's questions: the development split
    seeds=(0, 1, 2),
    variants=(
        LAPTOP.variants[0],  # reference: none and TS, one seed
        Variant("sft", ("sft",)),
        *(Variant(f"{phi}_{k}{v}", ("calm",), (*_COUPLING, "--phi", phi, f"--{k}", v),
                  note=f"phi = {'eta·|grad q|^2' if phi == 'grad_norm' else 'c·q'}, {k} = {v}")
          for phi, k in (("grad_norm", "eta"), ("value_gap", "c")) for v in ("0.1", "0.9")),
    ),
    # sft and the scoring as in the laptop study; a CALM step with T = 10 as the final study
    # measured it (below)
    step_s={"sft": 1.22, "calm": CALM_T10_STEP_S, "none": 0.0, "ts": 0.0},
    question_s=0.06, run_s=15.0, questions=700,
    baselines=("sft/sft", "reference/ts"),
    seed_major=True,
)

# issue 28: the final study. Out-of-domain test questions from documents no development study
# read: the ARC test documents (ARC-Easy 2,376, ARC-Challenge 1,172 questions; every study so
# far read the validation documents), 800 per set, 5 seeds, the power to see 0.03 (issue 28's
# estimate). MMLU is left out: the untrained model is at chance on it (docs/results/laptop-screen);
# ARC-Challenge was at chance too and is kept for its accuracy-against-chance table, the claims
# being decided on ARC-Easy. SciQ offers 1,000 questions offline, most read by the development
# studies, so its in-domain test is declared development (exploratory, not a final test), and
# the claims that live out of domain are the primary family. CALM's coupling is chosen as
# calm-coupling measures it, here by --select on this study's own calibration split (declared
# development: the only numbers the choice reads). The split discipline is checked before any
# cell runs (apps.study.discipline).
FINAL_OOD = ("arc_easy_test", "arc_challenge_test")
_FINAL = "OOD (final test): CALM beats TS without losing accuracy"
FINAL = Study(
    name="final",
    description="SmolLM2-135M-Instruct, cloze, SciQ -> ARC-Easy/ARC-Challenge test documents "
                "(800 each, final test), 60 steps, 5 seeds, split seed 0",
    common=("--split-seed", "0", "--steps", "60", "--no-zero-shot", "--in-domain", "sciq",
            "--out-of-domain", *FINAL_OOD, "--n-test", "120", "--n-calib", "100",
            "--n-ood", "800"),
    seeds=(0, 1, 2, 3, 4),
    variants=(
        Variant("reference", ("none", "ts"), seeds=(0,), note="no training: one seed suffices"),
        Variant("sft", ("sft", "label_smoothing")),
        Variant("calm", ("calm",), (*_COUPLING, "--select", "eta=0.1,0.9"),
                note="CALM with the coupling switched on; eta chosen on the calibration split"),
    ),
    step_s={"sft": 1.22, "label_smoothing": 1.11, "calm": CALM_T10_STEP_S, "none": 0.0, "ts": 0.0},
    question_s=0.06, run_s=15.0, questions=120 + 2 * 800 + 100,
    baselines=("sft/sft", "reference/ts"),
    chance_table=True,
    seed_major=True,
    primary=(Comparison("calm/calm", "reference/ts", "arc_easy_test", "error", _FINAL),
             Comparison("calm/calm", "sft/sft", "arc_easy_test", "error", _FINAL),
             Comparison("calm/calm", "reference/none", "arc_easy_test", "accuracy", _FINAL)),
    roles={"train": "training", "calib": "development", "test": "development", "ood": "test"},
    # found after the study ran, when the check learned to fold plurals (issue 39): one
    # ARC-Challenge test question whose options differ from a validation question's only in
    # "adaptation(s)"; ARC-Challenge is outside the primary family, so no verdict reads it
    acknowledged_shared={"laptop-screen: ood/arc_challenge_test": 1},
)

# issue 39: why CALM loses here, on development questions (SciQ -> ARC-Easy validation
# documents; no final-test question is read). Each variant is one CALM configuration beside
# its own none / TS / SFT rows on the same split, at two split seeds (the calibration draw
# varies) and two training seeds; the rows are compared within a variant ("{variant}/…").
# The decision rule is written before any cell runs (docs/results.md, "Why CALM loses: the
# planned experiment"). CALM's final configuration: T = 10, α lr 0.05, η = 0.9 (what every seed
# of the final study chose), with its α-off row.
_DIAGNOSIS_CALM = ("--inner-steps", "10", "--alpha-lr", "0.05", "--eta", "0.9")
# (name, methods, options, note, split seeds): the three rows the decision rule reads first run
# at both split seeds; the other two at one, to keep the study within 4 h of the 2-core machine
_DIAGNOSIS = (
    ("calm", ("calm",), ("--eval-without-alpha",),
     "CALM at the final configuration, and the same model evaluated without α", (1, 2)),
    ("vocab_temperature", ("calm_scalar",), ("--alpha-support", "vocab", "--no-eval-without-alpha"),
     "one temperature over the whole vocabulary, in the lower loss and at inference", (1,)),
    ("calib400", ("calm",), ("--n-calib", "400", "--no-eval-without-alpha"),
     "CALM with 400 calibration questions instead of 100", (1, 2)),
    ("option_temperature", ("calm",),
     ("--alpha-acts", "options", "--alpha-param", "temperature", "--no-eval-without-alpha"),
     "a bilevel-trained temperature on the evaluated option scores (upper level and inference; "
     "θ sees it only through the coupling); a scalar T needs no centring: softmax is "
     "shift-invariant", (1, 2)),
    ("value_gap", ("calm",), ("--phi", "value_gap", "--c", "0.9", "--no-eval-without-alpha"),
     "BOME's other control, φ = c·q̂ (calm-coupling's question)", (1,)),
)
CALM_DIAGNOSIS = Study(
    name="calm-diagnosis",
    description="SmolLM2-135M-Instruct, cloze, SciQ -> ARC-Easy (development questions), 60 "
                "steps, CALM variants beside none/TS/SFT, split seeds 1 (and 2) x training seeds "
                "0 and 1",
    common=("--steps", "60", "--eval-calib", "--no-zero-shot", "--in-domain", "sciq",
            "--out-of-domain", "arc_easy", "--n-test", "200", "--n-ood", "200",
            *_DIAGNOSIS_CALM),
    seeds=(0, 1),
    variants=tuple(
        Variant(f"{name}_split{split}", ("none", "ts", "sft", *methods),
                ("--split-seed", str(split), *args), note=note)
        for name, methods, args, note, splits in _DIAGNOSIS for split in splits),
    step_s={"sft": 1.22, "calm": CALM_T10_STEP_S, "calm_scalar": CALM_T10_STEP_S, "none": 0.0,
            "ts": 0.0},
    question_s=0.06, run_s=15.0, questions=200 + 200 + 100,
    baselines=("{variant}/sft", "{variant}/ts"),
    seed_major=True,
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
                                                  LAPTOP_OPEN_QA, PAPER_7B, TS_SHIFT_SCREEN,
                                                  TS_SHIFT_TRAINED, CALM_COUPLING, FINAL,
                                                  CALM_DIAGNOSIS)}

