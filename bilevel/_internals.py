"""Plumbing shared by the hypergradient methods and the solvers (private).

* :class:`CheckedObjectives` calls f and g and checks what they return;
* :class:`FlatVariables` holds the outer and inner pytrees as flat leaf lists plus their
  structures (:func:`flatten_variables` builds and validates it), so that hot loops never
  walk a tree;
* :class:`Batches` bundles the two batches; :class:`Estimate` is what a hypergradient
  method returns;
* :func:`inner_gradient_steps` runs graph-free gradient steps on g; :func:`start_step`
  is how a solver's ``step`` begins (checks, flat variables, those steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import tree
from ._autodiff import grad, leaf_aliases
from .problem import Problem

__all__ = [
    "Batches",
    "CheckedObjectives",
    "Estimate",
    "FlatVariables",
    "flatten_variables",
    "batch_drawer",
    "check_lower_batches",
    "inner_gradient_steps",
    "start_step",
]


@dataclass(frozen=True)
class Batches:
    """The batches passed unchanged to the upper (f) and lower (g) objectives."""

    upper: Any
    lower: Any


@dataclass(frozen=True)
class FlatVariables:
    """Outer (α) and inner (θ) variables as flat lists of leaves, with their structures.

    ``outer_tree``/``inner_tree`` rebuild the trees with :func:`tree.rebuilder` functions made
    once here, not a spec walk per objective call (per-call overhead; bench/overhead.py).
    """

    outer: list[torch.Tensor]
    outer_spec: tree.TreeSpec
    inner: list[torch.Tensor]
    inner_spec: tree.TreeSpec
    _build_outer: Callable[[list[torch.Tensor]], Any] = field(init=False, repr=False, compare=False)
    _build_inner: Callable[[list[torch.Tensor]], Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_build_outer", tree.rebuilder(self.outer_spec))
        object.__setattr__(self, "_build_inner", tree.rebuilder(self.inner_spec))

    def outer_tree(self, leaves: list[torch.Tensor] | None = None) -> Any:
        """``leaves`` (default: ``self.outer``) shaped as the outer pytree."""
        return self._build_outer(self.outer if leaves is None else leaves)

    def inner_tree(self, leaves: list[torch.Tensor] | None = None) -> Any:
        """``leaves`` (default: ``self.inner``) shaped as the inner pytree."""
        return self._build_inner(self.inner if leaves is None else leaves)

    def replace(self, **changes: list[torch.Tensor]) -> FlatVariables:
        """The same structures with other leaves (``outer=...`` and/or ``inner=...``)."""
        return dataclasses.replace(self, **changes)


def flatten_variables(owner: str, outer: Any, inner: Any) -> FlatVariables:
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
    return FlatVariables(out[0], out[1], out[2], out[3])


@dataclass
class Estimate:
    """What one hypergradient computation produced (all tensors detached, flat lists).

    ``first_inner_grad`` is ∇_θ g(α, θ) at the starting ``inner`` (the gradient of the first
    inner step, reused by ITD/AID as their inner direction at no extra cost).
    ``linear_solution`` is v of the implicit method's linear system (None for others), kept
    so that AID can warm-start the next solve with it.
    """

    outer_grad: list[torch.Tensor]
    inner_solution: list[torch.Tensor]
    first_inner_grad: list[torch.Tensor]
    scalars: dict[str, torch.Tensor | float] = field(default_factory=dict)
    linear_solution: list[torch.Tensor] | None = None


class CheckedObjectives:
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
        self._labels: list[str | tuple[str, str]] = []
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
        # formatted only if it is reported: one objective call per unrolled step records one
        self._labels.append((which, where))
        return value

    def record_finite(self, value: torch.Tensor, label: str) -> None:
        """Add a 0-dim ``value`` to the deferred finiteness check; ``label`` says what
        produced it ("the linear solver CG (its solution x)")."""
        self._values.append(value.detach().reshape(()))
        self._labels.append(label)

    def upper(self, outer: Any, inner: Any, batch: Any, where: str) -> torch.Tensor:
        return self._record(self.problem.upper(outer, inner, batch), "upper", where)

    def lower(self, outer: Any, inner: Any, batch: Any, where: str) -> torch.Tensor:
        return self._record(self.problem.lower(outer, inner, batch), "lower", where)

    def _raise_first_nonfinite(self, flags: list[bool]) -> None:
        for i, ok in enumerate(flags):
            if not ok:
                k = self._checked + i
                label = self._labels[k]
                if isinstance(label, tuple):
                    label = f"the {label[0]} objective ({label[1]})"
                raise FloatingPointError(
                    f"{self.owner}: {label} returned a non-finite value "
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
            # (timings: docs/performance.md, "Measured choices inside bilevel/").
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


def inner_gradient_steps(
    objectives: CheckedObjectives,
    variables: FlatVariables,
    batch: Any,
    *,
    steps: int,
    lr: float,
    first: int = 0,
    total: int | None = None,
    draw: Callable[[], Any] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor | None]:
    """``steps`` graph-free gradient steps θ ← θ − lr ∇_θ g(α, θ) from ``variables.inner``.

    α and θ are detached. With ``draw``, each step evaluates g on a fresh batch ``draw()``
    instead of ``batch`` (stochastic gradient steps, stocBiO's inner loop). Returns θ after the steps, and the gradient and value of the first
    step (None if steps == 0). Each step is one forward-backward of the lower objective; the
    update is out of place because θ_0 shares storage with the caller's tensors. ``first``
    and ``total`` only number the steps in error messages.
    """
    total = steps if total is None else total
    outer = variables.outer_tree([a.detach() for a in variables.outer])
    theta = variables.inner
    first_grad, first_value = None, None
    for t in range(steps):
        leaves = leaf_aliases(theta)
        where = f"inner step {first + t + 1} of {total}"
        b = batch if draw is None else draw()
        g = objectives.lower(outer, variables.inner_tree(leaves), b, where)
        gth = grad(g, leaves)
        if t == 0:
            first_grad, first_value = gth, g.detach()
        with torch.no_grad():
            theta = torch._foreach_add(theta, gth, alpha=-lr)
    return [x.detach() for x in theta], first_grad, first_value


def check_lower_batches(owner: str, lower_batches: object) -> None:
    """``lower_batches`` is None or a callable ``() -> batch`` (TypeError naming ``owner``)."""
    if lower_batches is not None and not callable(lower_batches):
        raise TypeError(
            f"{owner}: lower_batches must be a callable () -> batch (e.g. lambda: "
            f"next(batch_iterator)), got {type(lower_batches).__name__}"
        )


def batch_drawer(owner: str, lower_batches: Callable[[], Any] | None) -> Callable[[], Any] | None:
    """``lower_batches`` wrapped so that an exhausted source is a RuntimeError naming
    ``owner`` and the fix, not a bare StopIteration escaping from ``step`` (which would end
    ``fit``'s loop silently); None stays None (no fresh batches)."""
    if lower_batches is None:
        return None

    def draw() -> Any:
        try:
            return lower_batches()
        except StopIteration:
            raise RuntimeError(
                f"{owner}: lower_batches ran out of batches (it raised StopIteration); give it "
                "an endless source, e.g. itertools.cycle over the batches or a sampler"
            ) from None

    return draw


@dataclass(frozen=True)
class StepStart:
    """What a solver's ``step`` begins with: the checked objectives, the flat variables, and
    θ after the graph-free inner steps with the first step's gradient and value (None when
    no step ran)."""

    objectives: CheckedObjectives
    variables: FlatVariables
    theta: list[torch.Tensor]
    first_grad: list[torch.Tensor] | None
    first_value: torch.Tensor | None


def start_step(
    owner: str, problem: Problem, outer: Any, inner: Any, lower_batch: Any, *,
    steps: int, lr: float, total: int | None = None, draw: Callable[[], Any] | None = None,
) -> StepStart:
    """Check the problem and variables for ``owner`` and run ``steps`` graph-free inner
    gradient steps of size ``lr`` from ``inner`` (:func:`inner_gradient_steps`; ``draw``:
    a fresh lower batch per step)."""
    objectives = CheckedObjectives(problem, owner)
    variables = flatten_variables(owner, outer, inner)
    theta, first_grad, first_value = inner_gradient_steps(
        objectives, variables, lower_batch, steps=steps, lr=lr, total=total, draw=draw
    )
    return StepStart(objectives, variables, theta, first_grad, first_value)
