"""The bilevel problem and the checks on what its objectives return.

    min_α  F(α) = f(α, θ*(α); upper_batch)
    s.t.   θ*(α) ∈ argmin_θ g(α, θ; lower_batch)

``outer`` (α) and ``inner`` (θ) are pytrees of floating-point tensors; f is ``upper`` (e.g. a
validation loss) and g is ``lower`` (e.g. a training loss), both
``(outer, inner, batch) -> 0-dim tensor``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import tree

__all__ = ["Objective", "Problem"]

Objective = Callable[[Any, Any, Any], torch.Tensor]


@dataclass(frozen=True)
class Problem:
    """A bilevel problem: ``upper`` = f(outer, inner, batch), ``lower`` = g(outer, inner, batch).

    An ``nn.Module`` becomes an objective through ``torch.func.functional_call``::

        def lower(alpha, lora, batch):
            logits = torch.func.functional_call(model, lora, (batch["x"],))
            return cross_entropy(logits, batch["y"]) + alpha["wd"] * tree.sq_norm(lora)

    Only the tensors passed as ``inner`` are inner variables; every other model parameter
    is a constant for the solvers (they never write ``.grad`` anywhere).
    """

    upper: Objective
    lower: Objective

    def __post_init__(self) -> None:
        for name in ("upper", "lower"):
            if not callable(getattr(self, name)):
                raise TypeError(
                    f"Problem: {name} must be a callable (outer, inner, batch) -> scalar tensor, "
                    f"got {type(getattr(self, name)).__name__}"
                )


class Tape:
    """Evaluates the objectives of one solver step and checks what they return.

    The scalar check happens at once (it is free: a shape test). The finiteness check is
    deferred to :meth:`check`/:meth:`finish`, which test every recorded value with a single
    device synchronization per solver step instead of one per objective call (a GPU sync
    per unrolled inner step is measurable overhead). The error still names the objective
    and the step where the first non-finite value appeared.
    """

    def __init__(self, problem: Problem, owner: str) -> None:
        if not isinstance(problem, Problem):
            raise TypeError(
                f"{owner}: problem must be a bilevel.Problem, got {type(problem).__name__}"
            )
        self.problem = problem
        self.owner = owner
        self._values: list[torch.Tensor] = []
        self._labels: list[str] = []
        self._checked = 0

    def _record(self, value: Any, which: str, where: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{self.owner}: the {which} objective must return a torch.Tensor, got "
                f"{type(value).__name__} ({where})"
            )
        if value.ndim != 0:
            raise ValueError(
                f"{self.owner}: the {which} objective must return a scalar (0-dim) tensor, got "
                f"shape {tuple(value.shape)} ({where}); reduce it, e.g. with .mean()"
            )
        if not value.is_floating_point():
            raise TypeError(
                f"{self.owner}: the {which} objective returned dtype {value.dtype}; it must be "
                f"floating point to be differentiated ({where})"
            )
        self._values.append(value.detach())
        self._labels.append(f"the {which} objective ({where})")
        return value

    def upper(self, outer: Any, inner: Any, batch: Any, where: str) -> torch.Tensor:
        return self._record(self.problem.upper(outer, inner, batch), "upper", where)

    def lower(self, outer: Any, inner: Any, batch: Any, where: str) -> torch.Tensor:
        return self._record(self.problem.lower(outer, inner, batch), "lower", where)

    def _raise_first_nonfinite(self, flags: list[bool]) -> None:
        for i, ok in enumerate(flags):
            if not ok:
                k = self._checked + i
                raise FloatingPointError(
                    f"{self.owner}: {self._labels[k]} returned a non-finite value "
                    f"({float(self._values[k])})"
                )

    def check(self) -> None:
        """Raise ``FloatingPointError`` if any value recorded since the last check is not finite."""
        self.finish({})

    def finish(self, scalars: dict[str, torch.Tensor | float]) -> dict[str, float]:
        """Check the recorded values and convert ``scalars`` to Python floats in one sync."""
        new = self._values[self._checked :]
        names = list(scalars)
        tensors = [v for v in scalars.values() if isinstance(v, torch.Tensor)]
        if not new and not tensors:
            return {k: float(v) for k, v in scalars.items()}
        ref = (new or tensors)[0]
        # float64 keeps info values exact; MPS has no float64.
        dtype = torch.float32 if ref.device.type == "mps" else torch.float64
        parts = []
        if new:
            # One stack + one isfinite for all T + 1 values, not a check and a cast per value
            # (measured: ~20 operators per unrolled step otherwise, doubling tiny problems' time).
            try:
                stacked = torch.stack(new)
            except RuntimeError:  # values on different devices
                stacked = torch.stack([v.to(device=ref.device) for v in new])
            parts.append(torch.isfinite(stacked).to(dtype))
        parts += [v.detach().to(device=ref.device, dtype=dtype).reshape(1) for v in tensors]
        host = torch.cat(parts).tolist()
        flags, values = host[: len(new)], iter(host[len(new) :])
        self._raise_first_nonfinite([f == 1.0 for f in flags])
        self._checked = len(self._values)
        return {
            k: next(values) if isinstance(scalars[k], torch.Tensor) else float(scalars[k])
            for k in names
        }


def prepare(
    owner: str, outer: Any, inner: Any
) -> tuple[list[torch.Tensor], tree.TreeSpec, list[torch.Tensor], tree.TreeSpec]:
    """Flatten and validate the outer and inner trees (tensor, floating point, non-empty)."""
    out = []
    for name, t in (("outer", outer), ("inner", inner)):
        leaves, spec = tree.flatten(t, name=name)
        if not leaves:
            raise ValueError(f"{owner}: {name} has no tensor leaves")
        for i, x in enumerate(leaves):
            if not x.is_floating_point():
                raise TypeError(
                    f"{owner}: {name} leaf {i} has dtype {x.dtype}; outer and inner variables "
                    "must be floating point"
                )
        out += [leaves, spec]
    return out[0], out[1], out[2], out[3]
