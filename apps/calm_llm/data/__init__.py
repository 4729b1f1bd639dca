"""MCQA and instruction data for the CALM app: unified schema, sources, splits, batches."""

from .collate import Collator, batch_iterator
from .schema import Batch, InstructionExample, MCQAExample

__all__ = ["Batch", "Collator", "InstructionExample", "MCQAExample", "batch_iterator"]
