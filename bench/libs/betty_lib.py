"""betty-ml 0.1.1 (the only release installable on Python 3.11): its cg/neumann/darts.

The wheel's metadata (``torch>=1.6.*``) is rejected by pip ≥ 24.1, so it is not in the venv.
Download it with an old pip and unpack it, then point ``BETTY_PATH`` at the folder::

    python3.11 -m venv /tmp/oldpip && /tmp/oldpip/bin/pip install "pip<24.1"
    /tmp/oldpip/bin/pip download --no-deps betty-ml==0.1.1 -d /tmp/betty_dl
    python -m zipfile -e /tmp/betty_dl/betty_ml-0.1.1-py3-none-any.whl /tmp/betty
    BETTY_PATH=/tmp/betty python -m bench.hypergrad

Betty computes hypergradients inside its ``Engine`` from ``Problem`` objects; here its own
``betty.hypergradient.get_grads`` runs on minimal stand-ins for the two problems (the
attributes it reads: ``config``, ``cur_batch``, ``paths``, ``training_step_exec``,
``trainable_parameters``, ``parameters``). That times betty's hypergradient code and leaves
out its engine's bookkeeping, so betty's numbers here are a lower bound on its cost.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch

from ..problems import BenchProblem

Run = Callable[[], torch.Tensor]

NOTES = {"unrolled": "its unrolled mode wraps higher (measured as higher)"}
_TYPES = {"implicit_cg": "cg", "implicit_neumann": "neumann", "first_order": "darts"}


def unavailable() -> str | None:
    """None if betty imports (from ``$BETTY_PATH``), else the reason."""
    path = os.environ.get("BETTY_PATH")
    if path and path not in sys.path:
        sys.path.append(path)
    try:
        import betty.hypergradient  # noqa: F401
    except Exception as err:
        hint = (
            ""
            if path
            else "; set BETTY_PATH to an unpacked betty-ml 0.1.1 wheel (see bench/libs/betty_lib.py)"
        )
        return f"betty not importable ({type(err).__name__}: {err}){hint}"
    return None


class Lower:
    """Stand-in for betty's lower ``Problem``: θ are its parameters, g its training loss."""

    paths: list = []

    def __init__(self, p: BenchProblem, alpha: torch.Tensor, config: SimpleNamespace) -> None:
        # Fresh leaves sharing storage; betty's darts writes into .data (and does not undo
        # its last shift, see docs/performance.md), so it gets clones instead.
        clone = config.type == "darts"
        self.params = [
            (t.detach().clone() if clone else t.detach()).requires_grad_(True) for t in p.theta
        ]
        self.p, self.alpha, self.config, self.cur_batch = p, alpha, config, p.lower_batch

    def training_step_exec(self, batch: dict) -> torch.Tensor:
        return self.p.lower(self.alpha, self.params, batch)

    def trainable_parameters(self) -> list[torch.Tensor]:
        return self.params

    def parameters(self) -> list[torch.Tensor]:
        return self.params


def build(p: BenchProblem, method: str, steps: int, lr: float) -> Run | None:
    if method not in _TYPES:
        return None
    from betty.hypergradient import get_grads

    config = SimpleNamespace(
        type=_TYPES[method],
        cg_iterations=steps,
        cg_alpha=1.0,
        neumann_iterations=steps,
        neumann_alpha=lr,
        darts_alpha=0.01,
    )

    def run() -> torch.Tensor:
        a = p.alpha.detach().requires_grad_(True)
        lower = Lower(p, a, config)
        upper = SimpleNamespace(trainable_parameters=lambda: [a])
        f = p.upper(a, lower.params, p.upper_batch)
        # betty adds the direct ∇_α f itself (Problem.backward); it is zero unless f reads α.
        direct = torch.autograd.grad(f, a, retain_graph=True, allow_unused=True)[0]
        implicit = get_grads(f, [upper, lower, upper], retain_graph=False)[0]
        return implicit if direct is None else implicit + direct

    return run
