"""Bilevel solvers sharing one interface: ``solver.step(problem, outer, inner, *,
upper_batch, lower_batch) -> StepResult``."""

from .aid import AID
from .base import StepResult
from .bome import BOME
from .imaml import IMAML
from .itd import ITD
from .maml import FOMAML, MAML
from .reptile import Reptile

__all__ = ["AID", "BOME", "FOMAML", "IMAML", "ITD", "MAML", "Reptile", "StepResult"]
