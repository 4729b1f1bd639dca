"""Few-shot sinusoid regression (Finn, Abbeel & Levine, ICML 2017, section 5.1) with MAML,
first-order MAML, Reptile, iMAML and BOME as the meta-learner.

    python -m examples.few_shot_sinusoid [--quick] [--out runs/examples] [--seed 0]

A task is y = a·sin(x − φ), a ~ U[0.1, 5], φ ~ U[0, π], x ~ U[−5, 5]; the model is Finn et
al.'s MLP 1-40-40-1 (ReLU); K = 10 support and 10 query points per training task. The
meta-training set is a fixed pool of tasks, used whole at every step (a batch of tasks is a
leading task dimension of θ, ``bilevel.meta_problem``), so that BOME, whose inner variables
persist between steps, solves the same bilevel problem as the others. Metric: the query MSE on
fresh test tasks (K = 10 support points, 50 query points) after adapting from the learned α by
the learner's own inner problem (its proximal weight, step size and number of steps).
Outputs: ``few_shot_sinusoid.{json,md,png}`` in ``--out``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import bilevel

from ._common import Setup, parse_args, select, summary_row, train, write_outputs

NAME = "few_shot_sinusoid"


@dataclass(frozen=True)
class Learner:
    """A solver's setup plus the proximal weight λ of its inner problem."""

    setup: Setup
    prox: float = 0.0


# One line per meta-learner. MAML-family step sizes follow Finn et al. (β = 0.01 there, with
# one step); here 5 steps of 0.02. BOME and iMAML need λ > 0: with λ = 0, α is not in g.
# iMAML: λ = 2 and 20 inner steps beat λ = 1 with 10 and λ = 0.5 with 20 in a 500-step trial;
# BOME: θ's SGD step 0.002 with T = 10 is the setting of those tried (0.005, outer 1e-2) that
# did not diverge (docs/bilevel.md, "Examples").
LEARNERS: dict[str, Learner] = {
    "MAML": Learner(Setup(bilevel.MAML(5, 0.02), outer_lr=1e-3)),
    "FOMAML": Learner(Setup(bilevel.FOMAML(5, 0.02), outer_lr=1e-3)),
    "Reptile": Learner(Setup(bilevel.Reptile(5, 0.02), outer_lr=1.0, outer_optimizer="sgd")),
    "iMAML": Learner(
        Setup(bilevel.IMAML(20, 0.02, bilevel.linalg.CG(maxiter=5)), outer_lr=1e-3), prox=2.0
    ),
    "BOME": Learner(
        Setup(bilevel.BOME(10, 0.02), outer_lr=1e-3, inner_update="optimizer", inner_lr=0.002),
        prox=1.0,
    ),
}


def mlp() -> torch.nn.Module:
    """Finn et al.'s 1-40-40-1 ReLU MLP, on the meta device: the architecture only (no
    storage, no draw from the global random generator)."""
    nn = torch.nn
    layers = [nn.Linear(1, 40, device="meta"), nn.Linear(40, 40, device="meta"),
              nn.Linear(40, 1, device="meta")]
    return nn.Sequential(layers[0], nn.ReLU(), layers[1], nn.ReLU(), layers[2])


# The network as a function of its parameters (a dict name -> tensor, the pytree α and θ are):
# MODEL(params, x) = torch.func.functional_call(mlp(), params, (x,)). Only its architecture
# matters (it lives on the meta device): every call passes all the parameters.
MODEL = bilevel.functional(mlp())


def _mse(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (MODEL(params, x) - y).pow(2).mean()


def task_loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-task mean squared error, shape (tasks,), for parameters with a leading task
    dimension (vmap over the tasks: x is (tasks, points, 1)); a 0-dim loss for one task's
    parameters and data (x: (points, 1))."""
    if params["0.weight"].ndim == MODEL.params["0.weight"].ndim:
        return _mse(params, batch["x"], batch["y"])
    return torch.func.vmap(_mse)(params, batch["x"], batch["y"])


def sample_tasks(tasks: int, points: Sequence[int], gen: torch.Generator) -> list[dict]:
    """``tasks`` sinusoids; one batch {x, y} of shape (tasks, n, 1) per entry of ``points``."""
    amp = 0.1 + 4.9 * torch.rand(tasks, 1, 1, generator=gen)
    phase = math.pi * torch.rand(tasks, 1, 1, generator=gen)
    out = []
    for n in points:
        x = -5 + 10 * torch.rand(tasks, n, 1, generator=gen)
        out.append({"x": x, "y": amp * torch.sin(x - phase)})
    return out


def init_params(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """PyTorch's default nn.Linear initialization, U(±1/√fan_in), drawn from ``gen``: a fresh
    network's parameters (``bilevel.functional(...).params``, leaves that require grad)."""
    net = mlp().to_empty(device="cpu")
    with torch.no_grad():
        for layer in (net[0], net[2], net[4]):
            fan_out, fan_in = layer.weight.shape
            bound = 1 / math.sqrt(fan_in)
            # drawn as (fan_in, fan_out), the order and shape of the draws before the
            # examples used modules, so that the initialization is the same numbers
            layer.weight.copy_(((2 * torch.rand(fan_in, fan_out, generator=gen) - 1) * bound).T)
            layer.bias.copy_((2 * torch.rand(fan_out, generator=gen) - 1) * bound)
    return bilevel.functional(net).params


def adapted_mse(
    problem: bilevel.Problem, alpha: dict, support: dict, query: dict, steps: int, lr: float
) -> float:
    """Query MSE after ``steps`` gradient steps of size ``lr`` on the inner problem from α."""
    a = {k: v.detach() for k, v in alpha.items()}
    theta = bilevel.task_copies(a, support["x"].shape[0])
    for _ in range(steps):
        theta = {k: v.requires_grad_(True) for k, v in theta.items()}
        grads = torch.autograd.grad(problem.lower(a, theta, support), list(theta.values()))
        theta = {k: (v - lr * g).detach() for (k, v), g in zip(theta.items(), grads)}
    with torch.no_grad():
        return float(task_loss(theta, query).mean())


def run_learner(name: str, learner: Learner, data: dict, config: dict) -> list[dict]:
    """Meta-train one learner from the shared initialization; its curve of test MSE."""
    gen = torch.Generator().manual_seed(config["seed"])
    alpha = init_params(gen)
    inner = {k: v.requires_grad_(True) for k, v in bilevel.task_copies(alpha, config["pool"]).items()}
    problem = bilevel.meta_problem(task_loss, prox=learner.prox)
    solver = learner.setup.solver

    def evaluate() -> dict[str, float]:
        args = (problem, alpha, data["test_support"], data["test_query"])
        return {"test_mse": adapted_mse(*args, solver.inner_steps, solver.inner_lr)}

    return train(
        problem,
        learner.setup,
        alpha,
        inner,
        steps=config["steps"],
        eval_every=config["eval_every"],
        evaluate=evaluate,
        batches=lambda _k: (data["query"], data["support"]),
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    """Meta-train every learner in ``LEARNERS``; write the JSON, table and PNG."""
    args = parse_args(__doc__.split("\n\n", 1)[0], argv)
    chosen = select(LEARNERS, args.only)
    config = {"seed": args.seed, "pool": 25, "steps": 500, "eval_every": 50, "test_tasks": 100}
    if args.quick:
        config.update(pool=8, steps=30, eval_every=10, test_tasks=20)
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    support, query = sample_tasks(config["pool"], (10, 10), gen)
    test_support, test_query = sample_tasks(config["test_tasks"], (10, 50), gen)
    data = {"support": support, "query": query, "test_support": test_support,
            "test_query": test_query}
    curves = {name: run_learner(name, lr, data, config) for name, lr in chosen.items()}
    summary = [
        {
            **summary_row("learner", name, curve, {"final test MSE": "test_mse"},
                          ("test_mse", "min")),
            "initial test MSE": curve[0]["test_mse"],
        }
        for name, curve in curves.items()
    ]
    config["learners"] = {name: repr(lr) for name, lr in chosen.items()}
    return write_outputs(
        args.out, NAME, config=config, curves=curves, summary=summary,
        panels=[("test_mse", "query MSE after adaptation, fresh tasks")],
        title="Few-shot sinusoid regression (K = 10)",
        notes=NOTES,
    )


NOTES = (
    "Post-adaptation query MSE on fresh test tasks, adapting from the learned α with each "
    "learner's own inner problem; `initial` is the same adaptation from the random initial α. "
    "Wall-clock excludes evaluation; the machine was shared, so times are indicative."
)


if __name__ == "__main__":
    main()
