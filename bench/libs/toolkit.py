"""This project's toolkit (``library: bilevel``): ``bilevel.hypergrad`` with Unrolled/Implicit."""

from __future__ import annotations

from collections.abc import Callable

import torch

import bilevel

from ..problems import BenchProblem

Run = Callable[[], torch.Tensor]

NOTES = {"first_order": "no first-order hypergradient (BOME returns a joint (α, θ) direction)"}


def build(p: BenchProblem, method: str, steps: int, lr: float) -> Run | None:
    """``bilevel.hypergrad`` configured for ``method``; tol=0 makes CG run exactly ``steps``
    (a deliberate fixed budget, as in the peers' runs: ``on_unconverged="ignore"``)."""
    if method == "unrolled":
        how: bilevel.Unrolled | bilevel.Implicit = bilevel.Unrolled(inner_steps=steps, inner_lr=lr)
    elif method == "implicit_cg":
        how = bilevel.Implicit(bilevel.linalg.CG(maxiter=steps, tol=0.0, on_unconverged="ignore"))
    elif method == "implicit_neumann":
        how = bilevel.Implicit(bilevel.linalg.Neumann(steps=steps, lr=lr, on_unconverged="ignore"))
    else:
        return None
    problem = bilevel.Problem(upper=p.upper, lower=p.lower)

    def run() -> torch.Tensor:
        return bilevel.hypergrad(
            problem,
            p.alpha,
            p.theta,
            upper_batch=p.upper_batch,
            lower_batch=p.lower_batch,
            method=how,
        )

    return run
