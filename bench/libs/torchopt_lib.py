"""torchopt 0.7.x: implicit ``custom_root`` (CG / Neumann solve) and the unrolled ``MetaSGD``.

The optimality function is ``torch.func.grad`` of g, as in torchopt's own implicit examples;
``custom_root`` linearizes it once with ``torch.func.vjp`` and reuses the pullback per matvec.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..problems import BenchProblem

Run = Callable[[], torch.Tensor]


def unavailable() -> str | None:
    """None if torchopt imports, else the reason."""
    try:
        import torchopt  # noqa: F401
    except Exception as err:  # any import failure means: skip with a note
        return f"torchopt not importable ({type(err).__name__}: {err})"
    return None


class Holder(nn.Module):
    """θ as module parameters, sharing storage with the problem's tensors (no copy)."""

    def __init__(self, theta: list[torch.Tensor]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(t.detach()) for t in theta])


def _meta_sgd(p: BenchProblem, steps: int, lr: float) -> Run:
    import torchopt

    def run() -> torch.Tensor:
        a = p.alpha.detach().requires_grad_(True)
        net = Holder(p.theta)
        opt = torchopt.MetaSGD(net, lr=lr)
        for _ in range(steps):
            opt.step(p.lower(a, list(net.parameters()), p.lower_batch))
        return torch.autograd.grad(p.upper(a, list(net.parameters()), p.upper_batch), a)[0]

    return run


def _custom_root(p: BenchProblem, solve: Callable) -> Run:
    import torchopt

    def lower(theta: tuple[torch.Tensor, ...], alpha: torch.Tensor) -> torch.Tensor:
        return p.lower(alpha, list(theta), p.lower_batch)

    optimality = torch.func.grad(lower, argnums=0)

    @torchopt.diff.implicit.custom_root(optimality, argnums=1, solve=solve)
    def solution(theta: tuple[torch.Tensor, ...], alpha: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return theta  # already the inner solution: only the implicit backward is timed

    def run() -> torch.Tensor:
        a = p.alpha.detach().requires_grad_(True)
        theta = solution(tuple(t.detach() for t in p.theta), a)
        return torch.autograd.grad(p.upper(a, list(theta), p.upper_batch), a)[0]

    return run


def build(p: BenchProblem, method: str, steps: int, lr: float) -> Run | None:
    import torchopt

    if method == "unrolled":
        return _meta_sgd(p, steps, lr)
    if method == "implicit_cg":
        return _custom_root(p, torchopt.linear_solve.solve_cg(maxiter=steps, rtol=0.0, atol=0.0))
    if method == "implicit_neumann":
        return _custom_root(p, torchopt.linear_solve.solve_inv(ns=True, maxiter=steps, alpha=lr))
    return None


NOTES = {"first_order": "no first-order hypergradient"}
