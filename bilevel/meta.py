"""Meta-learning as a bilevel problem: the outer variable is a model's initialization α, the
inner variable the parameters θ adapted to a batch of B tasks.

    upper:  f(α, θ; query)   = (1/B) Σ_b L(θ_b; query_b)
    lower:  g(α, θ; support) = Σ_b [ L(θ_b; support_b) + (λ/2) ‖θ_b − α‖² ]

``task_loss(params, batch)`` returns the B per-task losses, shape ``(B,)``, for parameters
whose leaves carry a leading task dimension (``params[k].shape == (B,) + α[k].shape``); a
0-dim loss is one task with θ shaped like α. The lower level *sums* over tasks so that
∇_{θ_b} g is task b's own gradient and an inner step of size β is β on every task whatever B
is; the upper level averages, so the meta-gradient is the mean of the per-task ones. λ = 0
(``prox=0``) is the MAML/Reptile inner problem (Finn et al., ICML 2017; Nichol et al., 2018);
λ > 0 the proximal one of iMAML (Rajeswaran et al., NeurIPS 2019), where θ*(α) depends on α
through the proximal term alone.

The meta-learning solvers (``MAML``, ``FOMAML``, ``Reptile``, ``IMAML``) start the inner
steps from θ_0 = α copied to every task and ignore the values in ``inner`` (only its shapes
count: :func:`task_copies` builds it); BOME, ITD and AID accept the same problem and start
from the ``inner`` they are given. See docs/bilevel.md, "Meta-learning".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import tree
from ._checks import check_int, check_nonnegative
from .problem import Problem

__all__ = ["MetaProblem", "meta_problem", "task_copies"]

TaskLoss = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class MetaProblem(Problem):
    """A :class:`Problem` built by :func:`meta_problem`; keeps ``prox`` (λ) so that a solver
    that needs λ > 0 (``IMAML``) can say so at its first step."""

    task_loss: TaskLoss | None = None
    prox: float = 0.0


def _per_task(loss: Any, batch_name: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.ndim > 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"meta_problem: task_loss must return the per-task losses, a tensor of shape (B,) "
            f"(or a 0-dim tensor for one task), got {shape} on the {batch_name} batch"
        )
    return loss


def meta_problem(task_loss: TaskLoss, *, prox: float = 0.0) -> MetaProblem:
    """The meta-learning bilevel problem of the module docstring.

    Args:
        task_loss: ``(params, batch) -> (B,)`` per-task losses (0-dim for a single task).
        prox: λ ≥ 0, the weight of (λ/2)‖θ_b − α‖² in each task's inner problem
            (iMAML's regularization strength; 0 for MAML, FOMAML and Reptile).

    Returns:
        A :class:`MetaProblem` (a ``bilevel.Problem``); every solver accepts it.

    Cost: one call of ``task_loss`` per objective call, plus O(|θ|) for the proximal term.
    """
    if not callable(task_loss):
        raise TypeError(
            f"meta_problem: task_loss must be a callable (params, batch) -> per-task losses, "
            f"got {type(task_loss).__name__}"
        )
    check_nonnegative("meta_problem", "prox", prox)
    lam = float(prox)

    def upper(outer: Any, inner: Any, batch: Any) -> torch.Tensor:
        return _per_task(task_loss(inner, batch), "query (upper)").mean()

    def lower(outer: Any, inner: Any, batch: Any) -> torch.Tensor:
        value = _per_task(task_loss(inner, batch), "support (lower)").sum()
        if lam == 0.0:
            return value
        # α broadcasts over the leading task dimension of θ.
        gaps = [(t - a).pow(2).sum() for t, a in zip(tree.leaves(inner), tree.leaves(outer))]
        return value + 0.5 * lam * torch.stack(gaps).sum()

    return MetaProblem(upper=upper, lower=lower, task_loss=task_loss, prox=lam)


def task_copies(outer: Any, tasks: int | None) -> Any:
    """θ for a batch of ``tasks`` tasks: each leaf of ``outer`` repeated along a new leading
    dimension (``tasks=None``: one task, θ shaped like α). Detached new storage.

    Cost: O(tasks · |α|) memory and one copy.
    """
    if tasks is not None:
        check_int("task_copies", "tasks", tasks, minimum=1)
    leaves, spec = tree.flatten(outer, name="outer")
    if tasks is None:
        copies = [a.detach().clone() for a in leaves]
    else:
        copies = [a.detach().unsqueeze(0).repeat(tasks, *([1] * a.ndim)) for a in leaves]
    return tree.unflatten(copies, spec)
