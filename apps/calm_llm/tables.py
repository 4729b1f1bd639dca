"""What every results table and file name of a run shares, whatever the task: how one number
is printed (`fmt`) and how a dataset name becomes a file name (`safe_name`). Imports no torch.

The tables themselves are the task's (`evaluate.render_table` for multiple choice,
`open_qa.score.render_table` for open QA, the model card's results section): each chooses its
columns and how a NaN reads there.
"""

from __future__ import annotations

import math
from typing import Any

ABSENT = "–"  # a value a row does not have (None): the same dash in every table


def fmt(x: Any, digits: int = 3, *, nan: str = ABSENT) -> str:
    """One table cell: ``ABSENT`` for None, ``nan`` for a float NaN (the multiple-choice tables
    print the dash, so a metric undefined on a set reads as missing; open QA's and the model
    card's print "nan", so an AUROC undefined on an all-correct set stays visible), a float
    with ``digits`` decimals, anything else (an int count) as ``str``."""
    if x is None:
        return ABSENT
    if isinstance(x, float):
        return nan if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def safe_name(s: str) -> str:
    """``s`` with every character but letters, digits, ``-``, ``_`` and ``.`` replaced by ``_``
    (a dataset name in a file name: ``reliability_<name>.png``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s)
