"""higher 0.2.x: unrolled differentiation through ``innerloop_ctx`` with a differentiable SGD."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..problems import BenchProblem
from .torchopt_lib import Holder

Run = Callable[[], torch.Tensor]

NOTES = {
    "implicit_cg": "unrolled only",
    "implicit_neumann": "unrolled only",
    "first_order": "unrolled only",
}


def unavailable() -> str | None:
    """None if higher imports, else the reason."""
    try:
        import higher  # noqa: F401
    except Exception as err:
        return f"higher not importable ({type(err).__name__}: {err})"
    return None


def build(p: BenchProblem, method: str, steps: int, lr: float) -> Run | None:
    if method != "unrolled":
        return None
    import higher

    def run() -> torch.Tensor:
        a = p.alpha.detach().requires_grad_(True)
        net = Holder(p.theta)
        inner_opt = torch.optim.SGD(net.parameters(), lr=lr)
        with higher.innerloop_ctx(net, inner_opt, copy_initial_weights=True) as (fnet, diffopt):
            for _ in range(steps):
                diffopt.step(p.lower(a, list(fnet.parameters()), p.lower_batch))
            f = p.upper(a, list(fnet.parameters()), p.upper_batch)
            return torch.autograd.grad(f, a)[0]

    return run
