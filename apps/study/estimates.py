"""What a cell costs, for ``--dry-run`` and the ETA of a running study.

Read from the cell's own run configuration (``Cell.config``: the run's config parser, so the
defaults are the run's and not copies of them), priced with the study's measured costs
(``Study.step_s``, ``question_s``, ``run_s``) or, for a GPU study, its FLOP scale
(``catalogue.FlopScale``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from apps.calm_llm.config import Config, select_grid
from apps.study.design import Study, family

if TYPE_CHECKING:
    from apps.study.runner import Cell


def _step_cost(study: Study, cfg: Config) -> Callable[[str], float]:
    """Seconds per optimizer step of a method: the GPU FLOP scale, or the measured CPU table
    looked up as "method:solver" (CALM through another solver), "method", then its family."""
    if study.flops is not None:
        return study.flops.step_s

    def step(m: str) -> float:
        for key in (f"{m}:{cfg.calm.solver}", m, family(m)):
            if key in study.step_s:
                return study.step_s[key]
        return 0.0
    return step


def estimate_s(study: Study, cell: Cell) -> float:
    """Estimated seconds of a cell.

    seconds = run_s (model load) + steps · Σ_m step(m)·g_m + E + Σ_m p_m·g_m · prediction,
    where g_m is the size of the ``--select`` grid for a trained method (each point trains and
    is scored once; 1 otherwise), p_m = 2 for a CALM row scored with and without α
    (``--eval-without-alpha``), else 1, prediction = ``questions``·``question_s`` (CPU) or one
    forward over every scored set (``FlopScale.prediction_s``), and E the RCFT E-steps (on the
    CPU: 1 + ⌊(steps − 1)/k⌋ passes over the ``--n-train`` questions for
    ``--rcft-reestimate-every k``, one pass for k = 0).
    """
    cfg = cell.config(study)
    methods = cell.variant.methods
    step = _step_cost(study, cfg)
    prediction = study.flops.prediction_s() if study.flops is not None else \
        study.questions * study.question_s
    grid = max(1, len(select_grid(cfg)))
    points = {m: grid if step(m) > 0 else 1 for m in methods}
    steps = cfg.train.steps
    train = sum(step(m) * points[m] for m in methods) * steps
    if "rcft" in methods and study.flops is None:  # its E-steps score the training set
        every = cfg.options_of("rcft").reestimate_every
        passes = 1 + ((steps - 1) // every if every else 0)
        train += passes * cfg.data.n_train * study.question_s
    twice = cfg.calm.eval_without_alpha
    scored = sum((2 if twice and m.startswith("calm") else 1) * points[m] for m in methods)
    return study.run_s + train + scored * prediction
