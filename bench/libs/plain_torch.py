"""The floor: each hypergradient hand-written in plain PyTorch autograd, no library.

Written for speed: one graph of ∇_θ g reused for every Hessian-vector product, in-place
``torch._foreach`` updates in the solver loops, no pytree walking, no validation. A
library can approach this but should not beat it by much; the gap is its overhead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..problems import BenchProblem

Run = Callable[[], torch.Tensor]


def _dot(x: list[torch.Tensor], y: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(a * b).sum() for a, b in zip(x, y)]).sum()


def unrolled(p: BenchProblem, steps: int, lr: float) -> Run:
    """d f(α, θ_T)/dα through θ_{t+1} = θ_t − lr ∇_θ g(α, θ_t), θ_0 = p.theta."""

    def run() -> torch.Tensor:
        a = p.alpha.detach().requires_grad_(True)
        th = [t.detach().requires_grad_(True) for t in p.theta]
        for _ in range(steps):
            gr = torch.autograd.grad(p.lower(a, th, p.lower_batch), th, create_graph=True)
            th = [t - lr * g for t, g in zip(th, gr)]
        return torch.autograd.grad(p.upper(a, th, p.upper_batch), a)[0]

    return run


def _implicit(p: BenchProblem, solve: Callable) -> Run:
    """∇_α f − ∇²_{αθ} g · v with v = solve(hvp, ∇_θ f)."""

    def run() -> torch.Tensor:
        a = p.alpha.detach().requires_grad_(True)
        th = [t.detach().requires_grad_(True) for t in p.theta]
        gth = torch.autograd.grad(p.lower(a, th, p.lower_batch), th, create_graph=True)
        df = torch.autograd.grad(p.upper(a, th, p.upper_batch), [a, *th], allow_unused=True)
        f_a = df[0] if df[0] is not None else torch.zeros_like(a)

        def hvp(v: list[torch.Tensor]) -> list[torch.Tensor]:
            return list(torch.autograd.grad(gth, th, v, retain_graph=True))

        v = solve(hvp, list(df[1:]))
        return f_a - torch.autograd.grad(gth, a, v)[0]

    return run


def implicit_cg(p: BenchProblem, iterations: int) -> Run:
    """Implicit hypergradient with exactly ``iterations`` CG steps (no early stop)."""

    def cg(hvp: Callable, b: list[torch.Tensor]) -> list[torch.Tensor]:
        x = [torch.zeros_like(t) for t in b]
        r = [t.clone() for t in b]
        d = [t.clone() for t in b]
        rr = _dot(r, r)
        for _ in range(iterations):
            ad = hvp(d)
            step = rr / _dot(d, ad)
            torch._foreach_add_(x, torch._foreach_mul(d, step))
            torch._foreach_sub_(r, torch._foreach_mul(ad, step))
            rr_new = _dot(r, r)
            torch._foreach_mul_(d, rr_new / rr)
            torch._foreach_add_(d, r)
            rr = rr_new
        return x

    return _implicit(p, cg)


def implicit_neumann(p: BenchProblem, iterations: int, lr: float) -> Run:
    """Implicit hypergradient with v = lr Σ_{k=0}^{K} (I − lr H)^k ∇_θ f (K HVPs)."""

    def neumann(hvp: Callable, b: list[torch.Tensor]) -> list[torch.Tensor]:
        term = [t.clone() for t in b]
        acc = [t.clone() for t in b]
        for _ in range(iterations):
            torch._foreach_add_(term, hvp(term), alpha=-lr)
            torch._foreach_add_(acc, term)
        torch._foreach_mul_(acc, lr)
        return acc

    return _implicit(p, neumann)


def first_order(p: BenchProblem, radius: float) -> Run:
    """DARTS-style first-order estimate ∇_α f − ∇²_{αθ} g · v with v = ∇_θ f, the mixed term
    by a central difference of ∇_α g at θ ± ε v, ε = radius / ‖v‖ (H⁻¹ replaced by I).
    """

    def run() -> torch.Tensor:
        a = p.alpha.detach().requires_grad_(True)
        th = [t.detach().requires_grad_(True) for t in p.theta]
        df = torch.autograd.grad(p.upper(a, th, p.upper_batch), [a, *th], allow_unused=True)
        f_a = df[0] if df[0] is not None else torch.zeros_like(a)
        v = list(df[1:])
        eps = radius / _dot(v, v).sqrt()
        with torch.no_grad():
            plus = torch._foreach_add([t.detach() for t in th], torch._foreach_mul(v, eps))
            minus = torch._foreach_sub([t.detach() for t in th], torch._foreach_mul(v, eps))
        gp = torch.autograd.grad(p.lower(a, plus, p.lower_batch), a)[0]
        gm = torch.autograd.grad(p.lower(a, minus, p.lower_batch), a)[0]
        return f_a - (gp - gm) / (2 * eps)

    return run


def build(p: BenchProblem, method: str, steps: int, lr: float) -> Run | None:
    """The floor's runner for ``method`` (``unrolled``, ``implicit_cg``, ``implicit_neumann``,
    ``first_order``); ``steps`` is T or the solver iterations."""
    if method == "unrolled":
        return unrolled(p, steps, lr)
    if method == "implicit_cg":
        return implicit_cg(p, steps)
    if method == "implicit_neumann":
        return implicit_neumann(p, steps, lr)
    if method == "first_order":
        return first_order(p, 0.01)
    return None
