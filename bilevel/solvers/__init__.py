"""Bilevel solvers sharing one interface: ``solver.step(problem, outer, inner, *,
upper_batch, lower_batch) -> StepResult``."""

from .aid import AID
from .base import StepResult
from .bome import BOME
from .f2sa import F2SA
from .fd import FD
from .itd import ITD
from .soba import SOBA
from .vpbgd import VPBGD

__all__ = ["AID", "BOME", "F2SA", "FD", "ITD", "SOBA", "StepResult", "VPBGD"]
