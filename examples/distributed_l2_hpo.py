"""Data-parallel bilevel optimization: per-feature L2 strengths of a logistic regression,
the training and validation batches split over the ranks of a ``torch.distributed`` run.

    torchrun --nproc-per-node 2 examples/distributed_l2_hpo.py [--steps 20]
    python examples/distributed_l2_hpo.py                          # one process, same numbers

    g(α, θ) = (1/n) Σ_i BCE(x_iᵀw + b, y_i) + ½ Σ_j e^{α_j} w_j²     (training batch)
    f(α, θ) = (1/m) Σ_i BCE(x_iᵀw + b, y_i)                          (validation batch)

Every rank builds the same synthetic data set (a fixed seed), keeps its shard of each batch
(``bilevel.distributed.shard``) and runs the same ``bilevel.fit``: each gradient the solver
forms is averaged over the ranks, so every rank ends with the same α and θ, equal (to
round-off) to one process on the whole batches. docs/bilevel.md, "Distributed
(data-parallel) runs".
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bilevel

FEATURES, N_TRAIN, N_VAL = 5, 64, 32


def data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The whole (training, validation) batches, identical on every rank (seeded), float64."""
    gen = torch.Generator().manual_seed(0)
    w_true = torch.randn(FEATURES, generator=gen, dtype=torch.float64)
    x = torch.randn(N_TRAIN + N_VAL, FEATURES, generator=gen, dtype=torch.float64)
    y = (x @ w_true + 0.5 * torch.randn(N_TRAIN + N_VAL, generator=gen, dtype=torch.float64) > 0)
    y = y.to(torch.float64)
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def bce(inner: dict[str, torch.Tensor], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.binary_cross_entropy_with_logits(x @ inner["w"] + inner["b"], y)  # a mean


def lower(outer: dict[str, torch.Tensor], inner: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    return bce(inner, batch) + 0.5 * (outer["log_l2"].exp() * inner["w"] ** 2).sum()


def upper(outer: dict[str, torch.Tensor], inner: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    return bce(inner, batch)


def run(steps: int = 20, solver: Any = None) -> dict[str, Any]:
    """``steps`` outer steps of ``solver`` (default AID with CG) from α = 0, θ = 0 on this
    rank's shards (the whole batches without a process group): the final α, θ and the info
    of the last step (the same on every rank)."""
    train, val = data()
    outer = {"log_l2": torch.zeros(FEATURES, dtype=torch.float64, requires_grad=True)}
    inner = {"w": torch.zeros(FEATURES, dtype=torch.float64, requires_grad=True),
             "b": torch.zeros((), dtype=torch.float64, requires_grad=True)}
    solver = solver or bilevel.AID(20, 0.5, bilevel.linalg.CG(maxiter=50, tol=1e-10))
    history = bilevel.fit(
        bilevel.Problem(upper=upper, lower=lower), solver, outer, inner, steps=steps,
        outer_optimizer=torch.optim.SGD(bilevel.tree.leaves(outer), lr=0.5),
        upper_batch=bilevel.distributed.shard(val), lower_batch=bilevel.distributed.shard(train),
        inner_update="solution", progress=False,
    )
    return {"outer": bilevel.tree.detach(outer), "inner": bilevel.tree.detach(inner),
            "info": history.last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:  # started by torchrun: one process per rank
        dist.init_process_group("gloo")
    try:
        result = run(args.steps)
        if bilevel.distributed.rank() == 0:
            world = bilevel.distributed.world_size()
            print(f"{world} process(es): validation loss {result['info']['upper_loss']:.6f}")
            print("log L2 strengths:", [round(v, 6) for v in result["outer"]["log_l2"].tolist()])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
