"""Applying a solver's directions with torch.optim optimizers, and a small training loop.

    result = solver.step(problem, outer, inner, upper_batch=ub, lower_batch=lb)
    bilevel.apply(result, outer, inner, outer_optimizer=opt_a, inner_optimizer=opt_t)

or, for the whole loop with progress reporting and an info history::

    history = bilevel.fit(problem, solver, outer, inner, steps=500,
                          outer_optimizer=opt_a, inner_optimizer=opt_t,
                          upper_batch=ub, lower_batch=lb)

``outer`` and ``inner`` are the pytrees of leaf tensors the optimizers hold (e.g. dicts of
``nn.Parameter``). ``apply`` sets each leaf's ``.grad`` to its direction and calls
``optimizer.step()``; it never calls ``backward``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from . import distributed as _distributed
from . import tree
from .problem import Problem
from .solvers.base import Solver, StepResult

__all__ = ["History", "apply", "fit"]

logger = logging.getLogger("bilevel")

_SHOWN = ("upper_loss", "lower_loss", "lambda", "q")


@dataclass
class History:
    """``records[k]`` is the ``info`` dict of outer step k (plus ``"step": k``)."""

    records: list[dict[str, float]] = field(default_factory=list)

    def column(self, name: str) -> list[float]:
        """The values of one info key over the steps that reported it."""
        return [r[name] for r in self.records if name in r]

    @property
    def last(self) -> dict[str, float]:
        if not self.records:
            raise IndexError("History is empty")
        return self.records[-1]

    def __len__(self) -> int:
        return len(self.records)


def _set_grads(params: Any, directions: Any, name: str) -> None:
    ps, pspec = tree.flatten(params, name=name)
    ds, dspec = tree.flatten(directions, name=f"{name} direction")
    if pspec != dspec:
        tree.check_same_structure(params, directions, (name, f"{name} direction"))
    for k, (p, d) in enumerate(zip(ps, ds)):
        if not p.is_leaf:
            raise ValueError(
                f"apply: {name} leaf {k} is not a leaf tensor; pass the tensors the optimizer "
                "holds (e.g. nn.Parameter or torch.zeros(..., requires_grad=True))"
            )
        if p.shape != d.shape:
            raise ValueError(
                f"apply: {name} leaf {k} has shape {tuple(p.shape)} but its direction has "
                f"shape {tuple(d.shape)}"
            )
        p.grad = d.detach().to(dtype=p.dtype, device=p.device)


def apply(
    result: StepResult,
    outer: Any,
    inner: Any,
    *,
    outer_optimizer: torch.optim.Optimizer | None,
    inner_optimizer: torch.optim.Optimizer | None = None,
    inner_update: Literal["optimizer", "solution"] = "optimizer",
) -> None:
    """Step the optimizers along ``result``'s directions.

    ``inner_update="optimizer"``: θ takes one ``inner_optimizer`` step along
    ``result.inner_grad`` (BOME's joint update; one warm-started inner step for ITD/AID).
    ``inner_update="solution"``: θ is overwritten by ``result.inner_solution`` (classic
    ITD/AID warm start from θ^(T)); ``inner_optimizer`` must then be None.
    A ``None`` optimizer leaves its variables unchanged.
    """
    if inner_update not in ("optimizer", "solution"):
        raise ValueError(
            f"apply: inner_update must be 'optimizer' or 'solution', got {inner_update!r}"
        )
    if outer_optimizer is not None:
        _set_grads(outer, result.outer_grad, "outer")
        outer_optimizer.step()
    if inner_update == "solution":
        if inner_optimizer is not None:
            raise ValueError(
                "apply: inner_update='solution' copies θ^(T); pass inner_optimizer=None"
            )
        if result.inner_solution is None:
            raise ValueError("apply: this result has no inner_solution to copy")
        tree.check_same_structure(inner, result.inner_solution, ("inner", "inner_solution"))
        with torch.no_grad():
            for p, s in zip(tree.leaves(inner), tree.leaves(result.inner_solution)):
                p.copy_(s)
    elif inner_optimizer is not None:
        _set_grads(inner, result.inner_grad, "inner")
        inner_optimizer.step()


def _check_holds(optimizer: torch.optim.Optimizer | None, tensors: Any, other: Any, name: str) -> None:
    """Refuse an optimizer that holds none of the ``name`` tensors: `apply` sets their ``.grad``
    and steps the optimizer, which would then move nothing, and `fit` would run every solver
    step and return a history while the variables stayed where they were."""
    if optimizer is None:
        return
    leaves = tree.leaves(tensors)
    if not leaves:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if any(id(t) in held for t in leaves):
        return
    other_name = "inner" if name == "outer" else "outer"
    swapped = any(id(t) in held for t in tree.leaves(other))
    raise ValueError(
        f"fit: {name}_optimizer holds none of the {len(leaves)} {name} tensors, so its steps "
        f"would change nothing"
        + (f" (it holds the {other_name} ones: are the two optimizers swapped?)" if swapped else "")
        + f"; build it over the very tensors passed as {name}, e.g. "
        f"torch.optim.Adam(bilevel.tree.leaves({name})), not over copies of them"
    )


def _batch_source(
    batches: Callable[[int], tuple[Any, Any]] | Iterable[tuple[Any, Any]] | None,
    upper_batch: Any,
    lower_batch: Any,
) -> Callable[[int], tuple[Any, Any]]:
    if batches is None:
        return lambda _k: (upper_batch, lower_batch)
    if callable(batches):
        return batches
    iterator: Iterator[tuple[Any, Any]] = iter(batches)

    def nxt(k: int) -> tuple[Any, Any]:
        try:
            pair = next(iterator)
        except StopIteration:
            raise StopIteration from None
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(
                f"fit: batches must yield (upper_batch, lower_batch) pairs; item {k} is {type(pair).__name__}"
            )
        return pair

    return nxt


class _Progress:
    """tqdm if it is installed (it is not a core dependency), else periodic log lines."""

    def __init__(self, total: int, enabled: bool, log_every: int, desc: str) -> None:
        self.bar = None
        enabled = enabled and _distributed.rank() == 0  # data parallelism: rank 0 reports
        self.enabled, self.log_every, self.desc, self.total = enabled, log_every, desc, total
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc)

    def update(self, k: int, info: dict[str, float]) -> None:
        if not self.enabled:
            return
        shown = {key: info[key] for key in _SHOWN if key in info}
        if self.bar is not None:
            self.bar.set_postfix({key: f"{v:.4g}" for key, v in shown.items()}, refresh=False)
            self.bar.update(1)
        elif (k + 1) % self.log_every == 0 or k + 1 == self.total:
            text = " ".join(f"{key}={v:.4g}" for key, v in shown.items())
            logger.info("%s step %d/%d %s", self.desc, k + 1, self.total, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


CHECKPOINT_FORMAT = 1


def _save_checkpoint(path: Path, step: int, outer: Any, inner: Any, optimizers: tuple,
                     solver: Any, history: History) -> None:
    """Everything ``fit`` needs to continue after ``step`` outer steps, written atomically (a
    temp file, then ``os.replace``), so a kill mid-write leaves the previous checkpoint.

    Under data parallelism rank 0 alone writes (the ranks' states are identical), and every
    rank waits until it has: a rank that left ``fit`` first and resumed from ``path`` at
    once would otherwise read the previous checkpoint, or none, and its collectives would
    no longer pair with rank 0's."""
    if _distributed.rank() != 0:
        _distributed.barrier()
        return
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "outer": [t.detach().clone() for t in tree.leaves(outer)],
        "inner": [t.detach().clone() for t in tree.leaves(inner)],
        "optimizers": [None if o is None else o.state_dict() for o in optimizers],
        # a third-party solver with only `step` is stateless as far as fit can tell
        "solver": solver.state_dict() if hasattr(solver, "state_dict") else {},
        "history": [dict(r) for r in history.records],
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    _distributed.barrier()


def _resume(path: Path, outer: Any, inner: Any, optimizers: tuple, solver: Any,
            history: History) -> int:
    """Load ``path`` (if it exists) into the variables, optimizers, solver and history; returns
    the number of outer steps it holds (0 without a checkpoint)."""
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=True)  # tensors, numbers and lists: nothing pickled
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"fit: {path} is not a bilevel.fit checkpoint of format {CHECKPOINT_FORMAT}")
    for name, tensors in (("outer", outer), ("inner", inner)):
        leaves, saved = tree.leaves(tensors), state[name]
        if len(leaves) != len(saved) or any(a.shape != b.shape for a, b in zip(leaves, saved)):
            raise ValueError(
                f"fit: the checkpoint {path} holds {name} leaves of shapes "
                f"{[tuple(t.shape) for t in saved]}, not {[tuple(t.shape) for t in leaves]}: "
                "it belongs to another problem (delete it to start afresh)")
        with torch.no_grad():
            for a, b in zip(leaves, saved):
                a.copy_(b)
    for optimizer, saved in zip(optimizers, state["optimizers"]):
        if (optimizer is None) != (saved is None):
            raise ValueError(f"fit: the checkpoint {path} was written with other optimizers "
                             "(one is None here but not there)")
        if optimizer is not None:
            optimizer.load_state_dict(saved)
    if hasattr(solver, "load_state_dict"):
        solver.load_state_dict(state["solver"])
    history.records = [dict(r) for r in state["history"]]
    return int(state["step"])


def _check_fit_inputs(steps: object, solver: object, optimizers: tuple, outer: Any,
                      inner: Any, distributed: object) -> None:
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"fit: distributed must be None, True or False, got {distributed!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"fit: steps must be an int >= 0, got {steps!r}")
    if not hasattr(solver, "step"):
        raise TypeError(f"fit: solver must have a step(...) method, got {type(solver).__name__}")
    _check_holds(optimizers[0], outer, inner, "outer")
    _check_holds(optimizers[1], inner, outer, "inner")


def _resume_point(path: Path | None, every: object, state: tuple,
                  iterable_source: Callable[[int], Any] | None) -> int:
    """The step ``fit`` starts at: 0, or the checkpoint's (its state loaded); an iterable
    batch source is advanced past the pairs the interrupted run consumed."""
    if path is None:
        return 0
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"fit: checkpoint_every must be an int >= 1, got {every!r}")
    start = _resume(path, *state)
    if iterable_source is not None:
        for j in range(start):
            iterable_source(j)
    return start


def fit(
    problem: Problem,
    solver: Solver,
    outer: Any,
    inner: Any,
    *,
    steps: int,
    outer_optimizer: torch.optim.Optimizer | None,
    inner_optimizer: torch.optim.Optimizer | None = None,
    upper_batch: Any = None,
    lower_batch: Any = None,
    batches: Callable[[int], tuple[Any, Any]] | Iterable[tuple[Any, Any]] | None = None,
    inner_update: Literal["optimizer", "solution"] = "optimizer",
    callback: Callable[[int, StepResult], bool | None] | None = None,
    progress: bool = True,
    log_every: int = 10,
    desc: str | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
    distributed: bool | None = None,
) -> History:
    """Run ``steps`` outer steps of ``solver`` and apply them with the optimizers.

    Args:
        problem: what to solve.
        solver: how (``BOME``, ``ITD``, ``AID``, ``FD``, ``VPBGD``, ``F2SA``, ``SOBA``,
            ``SABA`` (batches as ``Indexed``), or any object with the same ``step``).
        outer: pytree of the leaf tensors the outer optimizer holds; updated in place.
        inner: pytree of the leaf tensors the inner optimizer holds; updated in place.
        steps: number of outer steps (stops earlier if ``batches`` runs out).
        outer_optimizer: any ``torch.optim`` optimizer (see :func:`apply`) holding (some of)
            the tensors of ``outer``, else ValueError.
        inner_optimizer: the same for ``inner``.
        upper_batch: the fixed batch of f, used when ``batches`` is None.
        lower_batch: the fixed batch of g, used when ``batches`` is None.
        batches: a callable ``step -> (upper_batch, lower_batch)`` or an iterable of pairs.
        inner_update: ``"optimizer"`` or ``"solution"`` (see :func:`apply`).
        callback: called as ``callback(step, result)`` after each update; returning True
            stops the loop.
        progress: show a tqdm bar if tqdm is installed, else log every ``log_every`` steps
            to the ``"bilevel"`` logger.
        checkpoint: a file path. Every ``checkpoint_every`` steps (and at the end) ``fit``
            saves outer, inner, both optimizers' and the solver's ``state_dict`` and the
            history there (``torch.save``, atomically; ``torch.load(weights_only=True)``
            reads it). If the file exists when ``fit`` starts, it resumes from it: the same
            call continues bit for bit where the interrupted one stopped. A callable
            ``batches`` is called with the global step, so it resumes exactly; an iterable
            is advanced past the steps already done. Under data parallelism only rank 0
            writes it (the others wait until it has); every rank resumes from it.
        distributed: data parallelism over ``torch.distributed`` (docs/bilevel.md,
            "Distributed (data-parallel) runs"): None (default) = on when a process group
            with more than one rank is initialized (or as an enclosing
            ``bilevel.distributed.data_parallel`` block says); True = on, a RuntimeError
            without a process group; False = off (each rank alone). When on, each rank
            passes its own equal-sized shard as ``upper_batch``/``lower_batch`` (or from
            ``batches``), every gradient of the step is averaged over the ranks, and all
            ranks take identical steps; the progress bar shows on rank 0 only.

    Returns:
        The :class:`History` of every step's ``info``.
    """
    optimizers = (outer_optimizer, inner_optimizer)
    _check_fit_inputs(steps, solver, optimizers, outer, inner, distributed)
    source = _batch_source(batches, upper_batch, lower_batch)
    history = History()
    path = None if checkpoint is None else Path(checkpoint)
    with contextlib.nullcontext() if distributed is None else _distributed.data_parallel(distributed):
        start = _resume_point(path, checkpoint_every, (outer, inner, optimizers, solver, history),
                              source if batches is not None and not callable(batches) else None)
        bar = _Progress(steps, progress, max(1, log_every), desc or type(solver).__name__)
        try:
            for k in range(start, steps):
                try:
                    ub, lb = source(k)
                except StopIteration:
                    break
                result = solver.step(problem, outer, inner, upper_batch=ub, lower_batch=lb)
                apply(result, outer, inner, outer_optimizer=outer_optimizer,
                      inner_optimizer=inner_optimizer, inner_update=inner_update)
                history.records.append({"step": float(k), **result.info})
                bar.update(k, result.info)
                stop = callback is not None and callback(k, result)
                if path is not None and (stop or (k + 1) % checkpoint_every == 0
                                         or k + 1 == steps):
                    _save_checkpoint(path, k + 1, outer, inner, optimizers, solver, history)
                if stop:
                    break
        finally:
            bar.close()
    return history
