"""Each linear solver on a non-convex inner problem: hyper-cleaning with a 5-8-2 tanh MLP.

The lower level is the per-example-weighted training loss of the MLP (no L2 term), after 30
gradient steps from a seeded initialization, with a weight decay of 1e-3: its Hessian at θ_30 is symmetric, indefinite and
nonsingular, the case a neural network's lower level gives. Every solver's implicit
hypergradient ``bilevel.Implicit(solver)`` is compared with the dense float64 answer
(``torch.linalg.solve`` on the Hessian built by ``torch.func.hessian``, independently of
``bilevel.linalg``), and timed in the same run::

    OMP_NUM_THREADS=1 python -m bench.linalg_nonconvex

prints one row per solver: relative error, matvecs, converged, what it raised or warned, and
the median time per hypergradient. docs/bilevel.md, "Which linear solver?", quotes it.
"""

from __future__ import annotations

import re
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import bilevel
from bilevel import linalg

F64 = torch.float64
DECAY = 1e-3
SIZES = (5, 8, 2)  # inputs, hidden units, classes: 5·8 + 8 + 8·2 + 2 = 66 parameters


def _forward(th: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ th["w1"] + th["b1"]) @ th["w2"] + th["b2"]


def lower(alpha: torch.Tensor, th: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """Σ_i σ(α_i) CE_i / n on the (noisy) training set, hyper-cleaning's weighted loss, + ½·DECAY
    ‖θ‖²: the softmax is unchanged by adding one constant to both logits, so without the
    decay the Hessian is singular (9 zero eigenvalues), with it nonsingular and indefinite."""
    x, y = batch
    ce = (torch.sigmoid(alpha) * F.cross_entropy(_forward(th, x), y, reduction="none")).mean()
    return ce + 0.5 * DECAY * sum((t**2).sum() for t in th.values())


def upper(alpha: torch.Tensor, th: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """CE on the clean validation set (α enters through θ only)."""
    x, y = batch
    return F.cross_entropy(_forward(th, x), y)


@dataclass
class MLPCase:
    """The problem at θ_T, with the dense float64 implicit hypergradient there."""

    problem: bilevel.Problem
    alpha: torch.Tensor
    theta: dict[str, torch.Tensor]
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    hessian: torch.Tensor
    exact: torch.Tensor

    def hypergrad(self, solver: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """``bilevel.hypergrad`` with ``Implicit(solver)`` at θ_T, and its info."""
        return bilevel.hypergrad(
            self.problem, self.alpha, self.theta, upper_batch=self.val, lower_batch=self.train,
            method=bilevel.Implicit(solver), return_info=True,
        )


def hyper_cleaning_mlp(seed: int = 0, n: int = 40, steps: int = 30, lr: float = 1.0) -> MLPCase:
    """A 5-8-2 tanh MLP after ``steps`` gradient steps of size ``lr`` on its weighted training
    loss (labels of a random teacher, a third of the training labels flipped), float64."""
    gen = torch.Generator().manual_seed(seed)
    d, h, c = SIZES
    teacher = torch.randn(d, c, generator=gen, dtype=F64)
    x_tr, x_va = (torch.randn(n, d, generator=gen, dtype=F64) for _ in range(2))
    y_tr, y_va = (x_tr @ teacher).argmax(1), (x_va @ teacher).argmax(1)
    flip = torch.rand(n, generator=gen, dtype=F64) < 1 / 3
    y_tr = torch.where(flip, 1 - y_tr, y_tr)
    scale = {"w1": d**-0.5, "b1": 0.5, "w2": h**-0.5, "b2": 0.5}
    shapes = {"w1": (d, h), "b1": (h,), "w2": (h, c), "b2": (c,)}
    theta = {k: scale[k] * 2 * torch.randn(s, generator=gen, dtype=F64) for k, s in shapes.items()}
    alpha = 0.5 * torch.randn(n, generator=gen, dtype=F64)
    for _ in range(steps):  # plain gradient descent to θ_T
        th = {k: v.requires_grad_() for k, v in theta.items()}
        grads = torch.autograd.grad(lower(alpha, th, (x_tr, y_tr)), list(th.values()))
        theta = {k: (v - lr * g).detach() for (k, v), g in zip(th.items(), grads)}
    hessian, exact = dense_implicit(alpha, theta, (x_tr, y_tr), (x_va, y_va))
    return MLPCase(bilevel.Problem(upper=upper, lower=lower), alpha, theta, (x_tr, y_tr),
                   (x_va, y_va), hessian, exact)


def dense_implicit(alpha: torch.Tensor, theta: dict[str, torch.Tensor], train: Any, val: Any,
                   *, upper: Any = upper, lower: Any = lower) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, dF/dα): H = ∇²_θθ g by ``torch.func.hessian`` on the flattened θ, v = H⁻¹ ∇_θ f by
    ``torch.linalg.solve``, dF/dα = ∇_α f − ∇²_αθ g · v, independently of ``bilevel.linalg``.
    ``upper``/``lower`` default to this module's hyper-cleaning objectives (∇_α f = 0 there);
    bench/peers_nonconvex.py passes its DARTS ones."""
    keys = list(theta)
    sizes = [theta[k].numel() for k in keys]
    flat = torch.cat([theta[k].reshape(-1) for k in keys])

    def unflat(t: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: p.reshape(theta[k].shape) for k, p in zip(keys, t.split(sizes))}

    hessian = torch.func.hessian(lambda t: lower(alpha, unflat(t), train))(flat)
    f_theta, f_alpha = torch.func.grad(lambda t, a: upper(a, unflat(t), val), argnums=(0, 1))(
        flat, alpha)
    v = torch.linalg.solve(hessian, f_theta)
    g_theta = torch.func.grad(lambda a, t: lower(a, unflat(t), train), argnums=1)
    mixed = torch.func.vjp(lambda a: g_theta(a, flat), alpha)[1](v)[0]
    return hessian, f_alpha - mixed


SOLVERS = {
    "CG (stop)": lambda lr: linalg.CG(maxiter=500, tol=1e-10),
    "CG (raise)": lambda lr: linalg.CG(maxiter=500, tol=1e-10, negative_curvature="raise"),
    "MINRES": lambda lr: linalg.MINRES(maxiter=500, tol=1e-10),
    "NormalCG": lambda lr: linalg.NormalCG(maxiter=500, tol=1e-10),
    "Neumann(500)": lambda lr: linalg.Neumann(steps=500, lr=lr),
    "FixedPoint": lambda lr: linalg.FixedPoint(maxiter=500, lr=lr, tol=1e-10),
    # what the two returned before the divergence check: finite, silent and wrong
    "Neumann, ignore": lambda lr: linalg.Neumann(steps=500, lr=lr, on_divergence="ignore",
                                                 on_unconverged="ignore"),
    "FixedPt, ignore": lambda lr: linalg.FixedPoint(maxiter=500, lr=lr, tol=1e-10,
                                                    on_divergence="ignore", on_unconverged="ignore"),
    "Dense": lambda lr: linalg.Dense(),
}


def measure(case: MLPCase, name: str, solver: Any, repeats: int = 5) -> dict[str, Any]:
    """One row: relative error, matvecs, converged, what was raised or warned, median time."""
    row: dict[str, Any] = {"solver": name, "error": float("nan"), "matvecs": float("nan"),
                           "converged": "-", "said": "", "ms": float("nan")}
    times = []
    for _ in range(repeats):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            try:
                grad, info = case.hypergrad(solver)
            except (FloatingPointError, ArithmeticError) as e:
                where = re.search(r"at iteration \d+", str(e))
                row["said"] = f"raised {type(e).__name__}" + (f" {where[0]}" if where else "")
                return row
            times.append(time.perf_counter() - start)
    row["error"] = float((grad - case.exact).norm() / case.exact.norm())
    row["matvecs"] = info.get("solver_matvecs", info["solver_iterations"])
    row["converged"] = bool(info["solver_converged"])
    row["said"] = ", ".join(sorted({type(w.message).__name__ for w in caught})) or "nothing"
    row["ms"] = 1e3 * statistics.median(times)
    return row


def main() -> None:
    torch.set_num_threads(1)
    case = hyper_cleaning_mlp()
    eig = torch.linalg.eigvalsh(case.hessian)
    lam_max = float(eig.abs().max())
    print(f"5-8-2 MLP hyper-cleaning at θ_30: {int((eig < 0).sum())} of {eig.numel()} Hessian "
          f"eigenvalues negative, |λ| in [{float(eig.abs().min()):.2e}, {lam_max:.2e}]; "
          f"Neumann/FixedPoint lr = 1/|λ|_max")
    print(f"{'solver':<14}{'rel. error':>12}{'matvecs':>9}{'converged':>11}  "
          f"{'ms/hypergrad':>12}  raised or warned")
    for name, make in SOLVERS.items():
        r = measure(case, name, make(1.0 / lam_max))
        print(f"{r['solver']:<14}{r['error']:>12.2e}{r['matvecs']:>9.0f}{str(r['converged']):>11}  "
              f"{r['ms']:>12.2f}  {r['said']}")


if __name__ == "__main__":
    main()
