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
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import tree
from ._autodiff import grad, leaf_aliases, reached
from .distributed import all_mean, world_size
from .errors import UnusedLeafWarning
from .meta import MetaProblem
from .problem import Problem

__all__ = [
    "Batches",
    "CheckedObjectives",
    "Estimate",
    "FlatVariables",
    "LeafUsage",
    "flatten_variables",
    "batch_drawer",
    "check_lower_batches",
    "inner_gradient_steps",
    "start_step",
    "stationarity",
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

    def replace(self, **changes: Any) -> FlatVariables:
        """The same structures with other leaves (``outer=...`` and/or ``inner=...``)."""
        return dataclasses.replace(self, **changes)


def flatten_variables(owner: str, outer: Any, inner: Any) -> FlatVariables:
    """Flatten and validate the outer and inner trees (tensor, floating point, non-empty)."""
    out: list[Any] = []
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


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for a warning raised by the caller of this function,
    that points at the first frame outside ``bilevel/`` (the user's ``step``, ``fit`` or
    ``hypergrad`` call) instead of at library internals."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


# (problem, owner) pairs whose unused leaves were already checked: the check runs on the first
# step of each solver kind on each problem only (weak keys: a problem is not kept alive).
_LEAVES_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LeafUsage:
    """Which outer (α) and inner (θ) leaves one step's objective evaluations depend on.

    Every evaluation with grad enabled is observed: for each leaf passed to it that requires
    grad, whether the value's autograd graph reaches it (:func:`bilevel._autodiff.reached`,
    a graph walk, no extra objective call). After the step (:meth:`report`), with
    ``through_inner`` (the meta solvers: θ_0 = α, leaf k of α is leaf k of θ), a leaf is
    reported by name with :class:`bilevel.UnusedLeafWarning` when

    * outer leaf k: seen with grad by f and by g and reached by neither (its hypergradient
      is a structural zero); with ``through_inner``: α_k reached by nothing, and θ_k not by
      f and seen but not reached by g;
    * inner leaf k: seen with grad by g and not reached (g does not determine θ* along it).
    """

    def __init__(self, outer: Any, inner: Any) -> None:
        self.outer = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(outer)[0]]
        self.inner = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(inner)[0]]
        n = len(self.outer) + len(self.inner)
        self.seen = {"upper": [False] * n, "lower": [False] * n}
        self.hit = {"upper": [False] * n, "lower": [False] * n}

    def observe(self, which: str, value: torch.Tensor, outer: Any, inner: Any) -> None:
        xs = tree.leaves(outer) + tree.leaves(inner)
        if len(xs) != len(self.seen[which]) or not torch.is_grad_enabled():
            return  # another structure, or a value computed without a graph: no evidence
        seen, hit = self.seen[which], self.hit[which]
        for i, x in enumerate(xs):
            seen[i] = seen[i] or x.requires_grad
        # only leaves not found yet are searched for: an unrolled loop's later graphs contain
        # the earlier ones, and searching them again would make the first step O(T²)
        idx = [i for i, x in enumerate(xs) if x.requires_grad and not hit[i]]
        if idx:
            for i, h in zip(idx, reached(value, [xs[i] for i in idx])):
                hit[i] = h

    def unused(self, through_inner: bool) -> tuple[list[int], list[int]]:
        """(outer indices, inner indices) to report (class docstring)."""
        no, seen, hit = len(self.outer), self.seen, self.hit
        inner = [k for k in range(len(self.inner)) if seen["lower"][no + k] and not hit["lower"][no + k]]
        if through_inner:
            outer = [k for k in inner if k < no and not (hit["upper"][k] or hit["lower"][k]
                                                       or hit["upper"][no + k])]
        else:
            outer = [k for k in range(no) if seen["upper"][k] and seen["lower"][k]
                     and not (hit["upper"][k] or hit["lower"][k])]
        return outer, inner

    def report(self, owner: str, problem: Problem, through_inner: bool) -> None:
        outer, inner = self.unused(through_inner)
        level = user_stacklevel()
        if outer:
            names = ", ".join(f"outer{self.outer[k]}" + (f" (with its adapted copy inner"
                              f"{self.inner[k]})" if through_inner else "") for k in outer)
            hint = ""
            if isinstance(problem, MetaProblem) and problem.prox == 0 and not through_inner:
                hint = (" The problem is bilevel.meta_problem(..., prox=0): α enters it only "
                        "through the proximal term (λ/2)‖θ − α‖², so a solver that starts from "
                        "the given inner (not from θ_0 = α) gets an all-zero meta-gradient; use "
                        "MAML, FOMAML or Reptile, or prox > 0.")
            warnings.warn(
                f"{owner}: {names} is used by neither the upper nor the lower objective: its "
                f"outer_grad is a structural zero, not a computed one.{hint}",
                UnusedLeafWarning, stacklevel=level,
            )
        if inner:
            names = ", ".join(f"inner{self.inner[k]}" for k in inner)
            warnings.warn(
                f"{owner}: {names} is not used by the lower objective: g does not determine "
                "θ* along it (its inner gradient is a structural zero, it stays where it "
                "starts, and an implicit method sees a singular Hessian)",
                UnusedLeafWarning, stacklevel=level,
            )


class CheckedObjectives:
    """Evaluates the objectives of one solver step and checks what they return.

    The scalar check happens at once (it is free: a shape test). The finiteness check is
    deferred to :meth:`check`/:meth:`finish`, which test every recorded value with a single
    device synchronization per solver step instead of one per objective call (a GPU sync
    per unrolled inner step is measurable overhead). The error still names the objective
    and the step where the first non-finite value appeared.

    On the first step of each ``owner`` on each problem it also records which leaves the
    evaluations depend on (:class:`LeafUsage`) and warns at :meth:`finish` about the unused
    ones; ``through_inner`` marks the meta solvers (θ_0 = α). Later steps: one lookup.
    """

    def __init__(self, problem: Problem, owner: str, *, through_inner: bool = False) -> None:
        if not isinstance(problem, Problem):
            raise TypeError(
                f"{owner}: problem must be a bilevel.Problem, got {type(problem).__name__}"
            )
        self.problem = problem
        self.owner = owner
        self._values: list[torch.Tensor] = []
        self._labels: list[str | tuple[str, str]] = []
        self._checked = 0
        self.last_lower_batch: Any = None
        self.through_inner = through_inner
        # read once per step, not once per gradient: the setting cannot change inside a step,
        # and asking torch.distributed costs ~10 Python calls each time (bench/overhead.py)
        self._parallel = world_size() > 1
        self._usage: LeafUsage | bool = self._needs_leaf_check()  # False: no check this step

    def _needs_leaf_check(self) -> bool:
        try:
            return self.owner not in _LEAVES_CHECKED.get(self.problem, ())
        except TypeError:  # an unhashable problem subclass: check every step
            return True

    def _observe(self, which: str, value: torch.Tensor, outer: Any, inner: Any) -> None:
        if self._usage is True:
            self._usage = LeafUsage(outer, inner)
        if isinstance(self._usage, LeafUsage):  # always, as callers skip it when _usage is False
            self._usage.observe(which, value, outer, inner)

    def _report_leaves(self) -> None:
        if isinstance(self._usage, LeafUsage):
            self._usage.report(self.owner, self.problem, self.through_inner)
            try:
                _LEAVES_CHECKED.setdefault(self.problem, set()).add(self.owner)
            except TypeError:
                pass
        self._usage = False

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
        value = self._record(self.problem.upper(outer, inner, batch), "upper", where)
        if self._usage is not False:
            self._observe("upper", value, outer, inner)
        return value

    def lower(self, outer: Any, inner: Any, batch: Any, where: str) -> torch.Tensor:
        self.last_lower_batch = batch  # the batch of the step's last g call (stationarity)
        value = self._record(self.problem.lower(outer, inner, batch), "lower", where)
        if self._usage is not False:
            self._observe("lower", value, outer, inner)
        return value

    def mean(self, xs: list[torch.Tensor], *, differentiable: bool = False) -> list[torch.Tensor]:
        """``xs``, formed from this rank's batches, averaged over the data-parallel ranks
        (:func:`bilevel.distributed.all_mean`; the identity without data parallelism). The
        one place a step's gradients meet the other ranks. The identity for the meta
        solvers (``through_inner``) too: their θ holds this rank's own tasks, not a copy of
        a shared θ, so only their meta-gradient is averaged (in ``meta_result``)."""
        if self.through_inner or not self._parallel:
            return xs
        return all_mean(xs, differentiable=differentiable)

    def _raise_first_nonfinite(self, flags: list[bool]) -> None:
        for i, ok in enumerate(flags):
            if not ok:
                k = self._checked + i
                label = self._labels[k]
                if isinstance(label, tuple):
                    label = f"the {label[0]} objective ({label[1]})"
                value = float(self._values[k])
                # under data parallelism the flags are the ranks' mean: every rank raises
                shown = f"({value})" if not math.isfinite(value) else "on another rank"
                raise FloatingPointError(
                    f"{self.owner}: {label} returned a non-finite value {shown}"
                )

    def check(self) -> None:
        """Raise ``FloatingPointError`` if any value recorded since the last check is not finite."""
        self.finish({})

    def finish(self, scalars: dict[str, torch.Tensor | float]) -> dict[str, float]:
        """Check the recorded values and convert ``scalars`` to Python floats in one sync."""
        out = self._finish(scalars)
        if self._usage is not False:  # after the finiteness check: a failed step reports nothing
            self._report_leaves()
        return out

    def _finish(self, scalars: dict[str, torch.Tensor | float]) -> dict[str, float]:
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
        # Data parallelism: one collective averages the finiteness flags (a non-finite value
        # on any rank fails every rank's step, instead of one raising while the others wait
        # in their next collective) and the info values (a rank's loss on its shard becomes
        # the full-batch mean; values formed from averaged gradients are the same everywhere).
        joined = torch.cat(parts)
        host = (all_mean([joined])[0] if self._parallel else joined).tolist()
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
        gth = objectives.mean(grad(g, leaves))
        if t == 0:
            first_grad, first_value = gth, g.detach()
        with torch.no_grad():
            theta = list(torch._foreach_add(theta, gth, alpha=-lr))
    return [x.detach() for x in theta], first_grad, first_value


def stationarity(
    objectives: CheckedObjectives, variables: FlatVariables, theta: list[torch.Tensor], where: str
) -> dict[str, torch.Tensor]:
    """``lower_loss_solution`` = g(α, θ̂) and ``lower_grad_norm`` = ‖∇_θ g(α, θ̂)‖ at θ̂ =
    ``theta`` (the step's inner solution), on the last lower batch the step evaluated g on
    (its ``lower_batch``, or the last one drawn from ``lower_batches``): the stationarity
    residual an implicit or truncated hypergradient's accuracy depends on. Cost: one
    graph-free forward-backward of g, for the solvers that have no gradient at θ̂ already
    (ITD, FD, MAML, FOMAML, Reptile; docs/bilevel.md, "Diagnostics: what `info` holds")."""
    outer = variables.outer_tree([a.detach() for a in variables.outer])
    leaves = leaf_aliases(theta)
    g = objectives.lower(outer, variables.inner_tree(leaves), objectives.last_lower_batch, where)
    return {"lower_loss_solution": g.detach(),
            "lower_grad_norm": tree.sq_norm_list(objectives.mean(grad(g, leaves))).sqrt()}


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
