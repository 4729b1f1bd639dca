"""Studies: named grids of ordinary ``apps.calm_llm`` runs (settings × seeds), run as resumable
cells and summarised over seeds with a hierarchical bootstrap.

    python -m apps.study calm-dynamics --dry-run      # the cells and their estimated time
    python -m apps.study calm-dynamics                # run (again: finished cells are skipped)
    python -m apps.study calm-dynamics --summarize    # study.json + study.md from finished cells
    python -m apps.study calm-dynamics --publish docs/results/calm-dynamics   # the small files
    python -m apps.study laptop --figures docs/img/laptop   # pooled reliability diagrams, curves

One process writes into a study root at a time (``apps.lock``): a second study, summary or
publish of the same root (or into the same destination) is refused with the holder's pid and
start time; a killed holder's lock is taken over.

Seeds vary training (LoRA init, batch order, dropout) while ``--split-seed`` keeps the questions
fixed, so the same questions are scored in every cell and the summary can pair them.

The modules, in the order a study flows through them:

- ``catalogue``: the named studies (``Study``, ``Variant``, ``Comparison``, ``FlopScale``);
- ``runner``: a study's cells, each parsed by the run's own config parser, run in subprocesses;
- ``discipline``: each study's split roles (training, development, final test), and the
  refusal, before any cell runs, to test on questions another study developed on;
- ``estimates``: what a cell costs (``--dry-run``);
- ``questions``: a cell's question-level predictions read back (``Questions``);
- ``integrity``: a finished cell's metrics.json recomputed from its predictions, and every
  unreadable file named (``DamagedCell``) instead of a seed dropped;
- ``stats``: pooled intervals, paired differences and the primary family decided with Holm,
  from ``calibration.stats``'s hierarchical bootstrap (seeds, then questions);
- ``summary`` and ``report``: ``study.json`` and ``study.md``; ``dynamics``: BOME's λ, α's range;
- ``publish``: the small files into ``docs/results/``; ``figures``: pooled diagrams and curves;
- ``shift``: whether a temperature fitted in domain fails under a shift (``ts-shift-screen``
  untrained, ``ts-shift-trained`` fine-tuned).

The summary reports, per variant and row, the mean ± standard deviation over seeds of each
metric, the hierarchical bootstrap's 95 % interval of the calibration error (conf-ECE; open QA:
Semantic-ECE of the semantic-cluster confidence), each row minus its baselines on the same
resamples, and the study's primary comparisons with Holm-adjusted p-values; every other
interval is exploratory (docs/results.md, "How the intervals are computed").
"""

from __future__ import annotations

from apps.study.catalogue import STUDIES
from apps.study.design import Comparison, FlopScale, Study, Variant
from apps.study.dynamics import dynamics
from apps.study.estimates import estimate_s
from apps.study.integrity import DamagedCell, cross_check
from apps.study.publish import PUBLISHED, publish, publish_cell, restore
from apps.study.questions import Questions
from apps.study.report import markdown
from apps.study.runner import Cell, cells, done, run
from apps.study.stats import (
    DatasetDraws,
    against_chance,
    decide,
    paired_difference,
    pooled_interval,
)
from apps.study.summary import summarize

__all__ = [
    "PUBLISHED", "STUDIES", "Cell", "Comparison", "DamagedCell", "DatasetDraws", "FlopScale",
    "Questions", "Study", "Variant", "against_chance", "cells", "cross_check", "decide", "done",
    "dynamics", "estimate_s",
    "markdown", "paired_difference", "pooled_interval", "publish", "publish_cell", "restore",
    "run", "summarize",
]
