"""Hyperparameter optimization: one L2 regularization strength per feature for logistic
regression (Pedregosa, "Hyperparameter optimization with approximate gradient", ICML 2016;
jaxopt's and BOAT's L2 examples), on scikit-learn's bundled breast-cancer data.

    python -m examples.l2_hpo [--quick] [--out runs/examples] [--seed 0]

    g(α, θ) = (1/n) Σ_i BCE(x_iᵀw + b, y_i) + ½ Σ_j e^{min(α_j, 2.5)} w_j²   (training third)
    f(α, θ) = BCE on the validation third;  θ = (w, b), α ∈ R^30

The model is ``nn.Linear(30, 1)`` through ``bilevel.functional`` (θ = its weight and bias).

Reported per solver: the validation loss (what it minimizes) and the test loss of the same
θ against solver wall-clock, and both at the end. Outputs: ``l2_hpo.{json,md,png}``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import bilevel

from ._common import Setup, parse_args, select, summary_row, train, write_outputs

NAME = "l2_hpo"
INNER_LR = 0.1
INNER_STEPS = 30
# GD on g with step β is stable while β(λ_max(data Hessian) ≈ 3.3 + max_j e^{α_j}) < 2. Without a
# bound, AID pushed one α_j to 3.3 and its inner steps overflowed after 145 outer steps
# (docs/bilevel.md, "Examples"); α_j is therefore clamped at 2.5 inside g (e^{2.5} ≈ 12).
LOG_REG_MAX = 2.5

# One line per solver.
SOLVERS: dict[str, Setup] = {
    "BOME": Setup(
        bilevel.BOME(INNER_STEPS, INNER_LR), outer_lr=0.05, inner_update="optimizer", inner_lr=INNER_LR
    ),
    "ITD": Setup(bilevel.ITD(INNER_STEPS, INNER_LR), outer_lr=0.05),
    "AID": Setup(bilevel.AID(INNER_STEPS, INNER_LR, bilevel.linalg.CG(maxiter=40)), outer_lr=0.05),
    "FD": Setup(bilevel.FD(INNER_STEPS, INNER_LR), outer_lr=0.05),
    # the θ direction is ∇f + γ∇g: its step size scales as 1/γ (docs/bilevel.md, V-PBGD)
    "V-PBGD": Setup(
        bilevel.VPBGD(INNER_STEPS, INNER_LR, gamma=10.0), outer_lr=0.05, inner_update="optimizer",
        inner_lr=INNER_LR / 10,
    ),
    "F2SA": Setup(bilevel.F2SA(INNER_STEPS, INNER_LR, lam=10.0), outer_lr=0.05),
    "SOBA": Setup(bilevel.SOBA(INNER_LR), outer_lr=0.05, inner_update="optimizer", inner_lr=INNER_LR),
    # the reference: α frozen at 0 (outer_lr = 0), θ trained by the same warm-started steps
    "no HPO (α = 0)": Setup(bilevel.AID(INNER_STEPS, INNER_LR, bilevel.linalg.CG(maxiter=1)), outer_lr=0.0),
}


def load_data(seed: int, n: int | None) -> dict[str, torch.Tensor]:
    """Breast cancer (569 × 30) in three shuffled thirds (the first ``n`` rows if given),
    standardized with the training third's statistics."""
    from sklearn.datasets import load_breast_cancer

    raw = load_breast_cancer()
    x = torch.tensor(raw.data, dtype=torch.float32)
    y = torch.tensor(raw.target, dtype=torch.float32)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:n]
    parts = order.tensor_split(3)
    mean, std = x[parts[0]].mean(0), x[parts[0]].std(0)
    out = {}
    for split, idx in zip(("train", "val", "test"), parts):
        out[f"x_{split}"], out[f"y_{split}"] = (x[idx] - mean) / std, y[idx]
    return out


def init_model(d: int) -> bilevel.FunctionalModule:
    """Logistic regression, ``nn.Linear(d, 1)``, as a function of its parameters θ = (w, b)
    (``.params``: ``weight`` (1, d), ``bias`` (1,)), started at θ = 0."""
    linear = torch.nn.Linear(d, 1, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.zero_()
    return bilevel.functional(linear)


def bce(model: bilevel.FunctionalModule, theta: dict, data: dict, split: str) -> torch.Tensor:
    """Mean binary cross-entropy of ``model(θ, x)`` on one split."""
    z = model(theta, data[f"x_{split}"]).squeeze(-1)
    return F.binary_cross_entropy_with_logits(z, data[f"y_{split}"])


def problem_for(data: dict[str, torch.Tensor], model: bilevel.FunctionalModule) -> bilevel.Problem:
    """The per-feature L2 problem of the module docstring; θ is ``model``'s parameters."""

    def lower(alpha: dict, theta: dict, batch: Any) -> torch.Tensor:
        reg = alpha["a"].clamp(max=LOG_REG_MAX).exp()
        return bce(model, theta, data, "train") + 0.5 * (reg * theta["weight"].pow(2)).sum()

    def upper(alpha: dict, theta: dict, batch: Any) -> torch.Tensor:
        return bce(model, theta, data, "val")

    return bilevel.Problem(upper=upper, lower=lower)


def run_solver(setup: Setup, data: dict, config: dict) -> list[dict]:
    """Optimize α with one solver from α = 0 (e^α = 1 on every feature), θ = 0."""
    d = data["x_train"].shape[1]
    alpha = {"a": torch.zeros(d, requires_grad=True)}
    model = init_model(d)
    theta = model.params
    problem = problem_for(data, model)

    def evaluate() -> dict[str, float]:
        with torch.no_grad():
            val = float(problem.upper(alpha, theta, None))
            test = float(bce(model, theta, data, "test"))
        a = alpha["a"].detach()
        return {"val_loss": val, "test_loss": test, "mean_log_reg": float(a.mean()),
                "max_log_reg": float(a.max())}

    return train(
        problem, setup, alpha, theta,
        steps=config["steps"], eval_every=config["eval_every"], evaluate=evaluate,
        batches=lambda _k: (None, None),
    )


def _solve_lower(problem: bilevel.Problem, alpha: dict, model: bilevel.FunctionalModule) -> dict:
    """θ*(α) by L-BFGS from θ = 0 (the lower level is strongly convex in w, convex in b)."""
    theta = {k: torch.zeros_like(v, requires_grad=True) for k, v in model.params.items()}
    opt = torch.optim.LBFGS(list(theta.values()), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = problem.lower(alpha, theta, None)
        loss.backward()
        return loss

    opt.step(closure)
    return theta


def scalar_grid(data: dict, grid: torch.Tensor) -> list[dict]:
    """The usual alternative: one λ for every feature, chosen on validation from ``grid``
    (log λ values), θ solved to convergence by L-BFGS at each. The curve is the best
    validation loss so far (and the test loss of that λ) against the time spent."""
    d = data["x_train"].shape[1]
    model = init_model(d)
    problem = problem_for(data, model)
    curve, best, spent = [], None, 0.0
    for k, log_reg in enumerate(grid.tolist()):
        start = time.perf_counter()
        alpha = {"a": torch.full((d,), log_reg)}
        theta = _solve_lower(problem, alpha, model)
        spent += time.perf_counter() - start
        with torch.no_grad():
            val = float(problem.upper(alpha, theta, None))
            test = float(bce(model, theta, data, "test"))
        if best is None or val < best["val_loss"]:
            best = {"val_loss": val, "test_loss": test, "mean_log_reg": log_reg,
                    "max_log_reg": log_reg}
        curve.append({"step": float(k + 1), "time_s": spent, **best})
    curve[-1]["cg_indefinite_steps"] = 0.0
    return curve


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    """Every solver in ``SOLVERS``; write the JSON, table and PNG."""
    args = parse_args(__doc__.split("\n\n", 1)[0], argv)
    chosen = select(SOLVERS, args.only)
    config = {"seed": args.seed, "rows": None, "steps": 300, "eval_every": 10}
    if args.quick:
        config.update(rows=300, steps=20, eval_every=5)
    data = load_data(args.seed, config["rows"])
    curves = {name: run_solver(setup, data, config) for name, setup in chosen.items()}
    if not args.only:  # the reference, not a solver: left out when --only picks solvers
        grid = torch.linspace(-8.0, LOG_REG_MAX, 4 if args.quick else 22)
        curves["one λ, grid on validation"] = scalar_grid(data, grid)
    finals = {"final val loss": "val_loss", "final test loss": "test_loss",
              "log λ (mean)": "mean_log_reg"}
    summary = [
        summary_row("solver", name, curve, finals, ("val_loss", "min"))
        for name, curve in curves.items()
    ]
    config["solvers"] = {name: repr(s) for name, s in chosen.items()}
    return write_outputs(
        args.out, NAME, config=config, curves=curves, summary=summary,
        panels=[("val_loss", "validation loss (upper objective)"), ("test_loss", "test loss")],
        title="Per-feature L2 for logistic regression, breast cancer",
        notes=NOTES,
    )


NOTES = (
    "α = 0 (weight e^0 = 1 on every feature) at step 0. `one λ, grid on validation`: a single "
    "λ for all features, chosen from a grid of log λ in [−8, 2.5] with θ solved by L-BFGS at "
    "each (its steps are grid points; its curve is the best so far). Wall-clock excludes evaluation; the "
    "machine was shared, so times are indicative."
)


if __name__ == "__main__":
    main()
