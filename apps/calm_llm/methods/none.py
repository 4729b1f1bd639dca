"""`none`: the model as given (LoRA adapters at their identity initialization, B = 0)."""

from __future__ import annotations

from . import spec
from .base import Method


class NoTraining(Method):
    """The untouched model; every other method is compared with it."""

    info = spec.info("none")
