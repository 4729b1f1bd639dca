"""Bilevel solvers sharing one interface: ``solver.step(problem, outer, inner, *,
upper_batch, lower_batch) -> StepResult``."""

from .aid import AID
from .base import StepResult
from .bome import BOME
from .fd import FD
from .itd import ITD

__all__ = ["AID", "BOME", "FD", "ITD", "StepResult"]
