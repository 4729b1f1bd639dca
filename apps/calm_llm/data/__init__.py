"""MCQA and instruction data for the CALM app: unified schema, sources, splits, batches."""

from .collate import Collator, batch_iterator, budget_batches
from .schema import Batch, InstructionExample, MCQAExample
from .sources import INSTRUCTION_SOURCES, MCQA_SOURCES, SOURCES, load_source
from .splits import Splits, make_splits

__all__ = [
    "Batch",
    "Collator",
    "INSTRUCTION_SOURCES",
    "InstructionExample",
    "MCQAExample",
    "MCQA_SOURCES",
    "SOURCES",
    "Splits",
    "batch_iterator",
    "budget_batches",
    "load_source",
    "make_splits",
]
