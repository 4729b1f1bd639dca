"""Open QA's modal answers scored beside the run's own matcher, from a cell's saved records.

The run credits the modal sampled answer when it contains a gold alias (``--match contains``),
which also credits an answer that only repeats the question (an alias that occurs in the
question). From the records every open-QA cell keeps, per (row, dataset):

- ``accuracy_no_echo``: the run's matcher with the aliases the question contains left out
  (``calibration.semantic.matches(..., question=...)``);
- ``exact_match`` and ``token_f1``: TriviaQA's / NQ-open's standard normalized exact match and
  token F1 of the modal answer against its best alias (Joshi et al. 2017; Rajpurkar et al. 2016);
- ``echo_credited``: the share of questions the run counted right only through an alias the
  question contains.

Means over the N questions; cost O(N · aliases) string work per row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ANSWER_METRICS = ("accuracy_no_echo", "exact_match", "token_f1", "echo_credited")


def _match_mode(run_dir: Path) -> str:
    """The run's ``--match`` where it is a string matcher; ``contains`` for a judge (whose
    verdicts cannot be recomputed) or when the config is not kept."""
    config = run_dir / "config.json"
    mode = json.loads(config.read_text()).get("open_qa", {}).get("match") if config.is_file() else None
    return mode if mode in ("exact", "contains") else "contains"


def answer_metrics(run_dir: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(row, dataset) -> the ``ANSWER_METRICS`` of the modal answers an open-QA cell saved;
    empty for a multiple-choice cell or one kept without its answers."""
    from apps.calm_llm.open_qa import score
    from calibration.semantic import matches, token_f1

    mode = _match_mode(run_dir)
    out: dict[tuple[str, str], dict[str, float]] = {}
    for row, per_ds in score.read_records(run_dir).items():
        for ds, records in per_ds.items():
            if not records:
                continue
            no_echo = np.array([matches(r.modal_answer, r.answers, mode=mode, question=r.question)
                                for r in records])
            credited = np.array([r.modal_correct for r in records])
            out[(row, ds)] = {
                "accuracy_no_echo": float(no_echo.mean()),
                "exact_match": float(np.mean([matches(r.modal_answer, r.answers) for r in records])),
                "token_f1": float(np.mean([token_f1(r.modal_answer, r.answers) for r in records])),
                "echo_credited": float((credited & ~no_echo).mean()),
            }
    return out
