"""MCQA, instruction and open-QA data for the CALM app: unified schemas, sources, splits, batches.

The names below load their submodule on first use, so that `sources` (the source table, which
`config` reads to validate ``--in-domain``) imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Collator": "collate",
    "warn_truncated": "collate",
    "batch_iterator": "collate",
    "budget_batches": "collate",
    "Batch": "schema",
    "InstructionExample": "schema",
    "MCQAExample": "schema",
    "MCQA_SOURCES": "sources",
    "SOURCES": "sources",
    "SourceInfo": "sources",
    "load_source": "sources",
    "register_source": "sources",
    "source_names": "sources",
    "OpenQAExample": "open_qa",
    "load_open_qa": "open_qa",
    "open_qa_source_names": "open_qa",
    "Splits": "splits",
    "make_splits": "splits",
    "question_key": "splits",
    "split_fingerprints": "splits",
    "split_question_digests": "splits",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
