"""Bilevel solvers sharing one interface: ``solver.step(problem, outer, inner, *,
upper_batch, lower_batch) -> StepResult``."""

from .aid import AID
from .base import Solver, StepResult
from .bome import BOME
from .f2sa import F2SA
from .fd import FD
from .imaml import IMAML
from .itd import ITD
from .maml import FOMAML, MAML
from .reptile import Reptile
from .saba import SABA, Indexed
from .soba import SOBA
from .vpbgd import VPBGD

__all__ = [
    "AID",
    "BOME",
    "F2SA",
    "FD",
    "FOMAML",
    "IMAML",
    "ITD",
    "MAML",
    "Indexed",
    "Reptile",
    "SABA",
    "SOBA",
    "Solver",
    "StepResult",
    "VPBGD",
]
