"""The three benchmark problems, each with an exact float64 reference hypergradient.

Every problem is built in float64 at a point (α, θ) with θ ≈ θ*(α), and the reference is the
exact implicit hypergradient there,

    dF/dα = ∇_α f − ∇²_{αθ} g · H⁻¹ ∇_θ f,     H = ∇²_{θθ} g(α, θ),

computed without any of the benchmarked code paths where a closed form or a dense solve
exists. ``BenchProblem.cast(torch.float32)`` gives the instance the libraries are timed on.

* ``quadratic(n)``: g = ½θᵀAθ − θᵀBα, f = ½‖θ − c‖² + ½ρ‖α‖²; θ* = A⁻¹Bα and
  dF/dα = BᵀA⁻¹(θ* − c) + ρα (closed form). A: n × n, B: n × 10, α: (10,).
* ``logistic(d)``: per-feature weight decay; g = mean softplus(−y·Xθ) + ½ Σ e^{α_i} θ_i²,
  f = mean softplus(−y_v·X_vθ); θ ∈ R^d, α ∈ R^d. θ* by Newton, H⁻¹ by a dense Cholesky
  (d ≤ n) or the Woodbury identity (d > n), all in float64; dF/dα = −e^α ⊙ θ ⊙ H⁻¹∇_θ f.
* ``mlp(hidden)``: a 2-hidden-layer tanh classifier with a learned L2 strength;
  g = CE(train) + ½ e^{α} ‖θ‖², f = CE(val), α: (1,). θ* by float64 L-BFGS; H⁻¹∇_θ f by
  float64 CG to a relative residual of 1e-10 (no dense solve fits 10⁵–10⁶ parameters).

Losses are plain functions ``(alpha, theta: list[Tensor], batch: dict) -> scalar`` so that
every library differentiates exactly the same computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BenchProblem", "build", "PROBLEMS", "hvp_cg"]

Loss = Callable[[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]
F64 = torch.float64


@dataclass
class BenchProblem:
    """One benchmark instance: objectives, the evaluation point and the exact reference.

    Attributes:
        name, size: problem family and inner dimension (number of inner parameters).
        alpha: outer variable, shape (m,).
        theta: inner point θ ≈ θ*(α), a list of tensors (shapes per problem).
        lower, upper: g and f as ``(alpha, theta, batch) -> 0-dim tensor``.
        lower_batch, upper_batch: dicts of tensors passed to g and f.
        inner_lr: 1 / λ_max(H), the step size of unrolled steps and Neumann series.
        exact: float64 reference dF/dα at (alpha, theta), shape (m,).
        exact_note: how the reference was computed.
        detail: problem parameters for the records (sample counts, conditioning, ...).
    """

    name: str
    size: int
    alpha: torch.Tensor
    theta: list[torch.Tensor]
    lower: Loss
    upper: Loss
    lower_batch: dict[str, torch.Tensor]
    upper_batch: dict[str, torch.Tensor]
    inner_lr: float
    exact: torch.Tensor
    exact_note: str
    detail: dict[str, Any] = field(default_factory=dict)

    def cast(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> BenchProblem:
        """A copy with every floating tensor in ``dtype`` on ``device`` (labels keep theirs)."""

        def conv(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device)
            return t.to(dtype) if t.is_floating_point() else t

        return replace(
            self,
            alpha=conv(self.alpha),
            theta=[conv(t) for t in self.theta],
            lower_batch={k: conv(v) for k, v in self.lower_batch.items()},
            upper_batch={k: conv(v) for k, v in self.upper_batch.items()},
        )


def hvp_cg(
    problem: BenchProblem, b: list[torch.Tensor], *, rtol: float, maxiter: int
) -> tuple[list[torch.Tensor], float]:
    """Solve H v = b by CG with H = ∇²_θθ g at (alpha, theta); returns v and ‖Hv − b‖/‖b‖.

    One double-backward graph of ∇_θ g is built and every HVP is a backward through it.
    Used for the float64 MLP reference and for power iterations, never timed.
    """
    a = problem.alpha.detach()
    th = [t.detach().requires_grad_(True) for t in problem.theta]
    g = problem.lower(a, th, problem.lower_batch)
    gth = torch.autograd.grad(g, th, create_graph=True)

    def hvp(v: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch.autograd.grad(gth, th, v, retain_graph=True))

    def dot(x: list[torch.Tensor], y: list[torch.Tensor]) -> float:
        return float(sum((xi * yi).sum() for xi, yi in zip(x, y)))

    x = [torch.zeros_like(t) for t in b]
    r = [t.clone() for t in b]
    p = [t.clone() for t in b]
    rr = bb = dot(b, b)
    for _ in range(maxiter):
        if rr <= rtol**2 * bb:
            break
        ap = hvp(p)
        step = rr / dot(p, ap)
        x = [xi + step * pi for xi, pi in zip(x, p)]
        r = [ri - step * api for ri, api in zip(r, ap)]
        rr_new = dot(r, r)
        p = [ri + (rr_new / rr) * pi for ri, pi in zip(r, p)]
        rr = rr_new
    res = [hv - bi for hv, bi in zip(hvp(x), b)]
    return [t.detach() for t in x], math.sqrt(dot(res, res) / bb)


def _lambda_max(problem: BenchProblem, iters: int = 30, seed: int = 0) -> float:
    """Largest Hessian eigenvalue of g at (alpha, theta) by power iteration (float64)."""
    gen = torch.Generator().manual_seed(seed)
    a = problem.alpha.detach()
    th = [t.detach().requires_grad_(True) for t in problem.theta]
    g = problem.lower(a, th, problem.lower_batch)
    gth = torch.autograd.grad(g, th, create_graph=True)
    v = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in th]
    lam = 0.0
    for _ in range(iters):
        norm = math.sqrt(sum(float((x * x).sum()) for x in v))
        v = [x / norm for x in v]
        hv = torch.autograd.grad(gth, th, v, retain_graph=True)
        lam = sum(float((x * y).sum()) for x, y in zip(v, hv))
        v = [x.detach() for x in hv]
    return lam


# --------------------------------------------------------------------------- quadratic
def quadratic(
    n: int, *, m: int = 10, cond: float = 100.0, rho: float = 0.1, seed: int = 0
) -> BenchProblem:
    """Random SPD quadratic with eigenvalues log-spaced in [1, cond]; see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    eig = torch.logspace(0.0, math.log10(cond), n, dtype=F64)
    a_mat = (q * eig) @ q.T
    a_mat = 0.5 * (a_mat + a_mat.T)
    b_mat = torch.randn(n, m, generator=gen, dtype=F64) / math.sqrt(m)
    c = torch.randn(n, generator=gen, dtype=F64)
    alpha = torch.randn(m, generator=gen, dtype=F64)

    def lower(al: torch.Tensor, th: list[torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return 0.5 * th[0] @ (b["A"] @ th[0]) - th[0] @ (b["B"] @ al)

    def upper(al: torch.Tensor, th: list[torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return 0.5 * (th[0] - b["c"]).square().sum() + 0.5 * rho * al.square().sum()

    theta = torch.linalg.solve(a_mat, b_mat @ alpha)
    exact = b_mat.T @ torch.linalg.solve(a_mat, theta - c) + rho * alpha
    return BenchProblem(
        name="quadratic",
        size=n,
        alpha=alpha,
        theta=[theta],
        lower=lower,
        upper=upper,
        lower_batch={"A": a_mat, "B": b_mat},
        upper_batch={"c": c},
        inner_lr=1.0 / cond,
        exact=exact,
        exact_note="closed form B^T A^-1 (theta* - c) + rho alpha",
        detail={"outer_dim": m, "cond": cond},
    )


# --------------------------------------------------------------------------- logistic
def _logistic_loss(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.softplus(-y * (x @ w)).mean()


def _logistic_hinv(
    x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, lam: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """v ↦ H⁻¹v for H = XᵀWX/n + diag(lam), W = σ(m)(1 − σ(m)), m = y·Xw (float64).

    Dense Cholesky when d ≤ n, otherwise Woodbury with U = sqrt(W/n)·X:
    H⁻¹ = Λ⁻¹ − Λ⁻¹Uᵀ(I + UΛ⁻¹Uᵀ)⁻¹UΛ⁻¹ (an n × n system instead of d × d).
    """
    n, d = x.shape
    s = torch.sigmoid(y * (x @ w))
    wdiag = s * (1 - s) / n
    if d <= n:
        h = (x.T * wdiag) @ x + torch.diag(lam)
        chol = torch.linalg.cholesky(h)
        return lambda v: torch.cholesky_solve(v[:, None], chol)[:, 0]
    u = x * wdiag.sqrt()[:, None]
    ul = u / lam
    chol = torch.linalg.cholesky(torch.eye(n, dtype=x.dtype) + ul @ u.T)

    def solve(v: torch.Tensor) -> torch.Tensor:
        lv = v / lam
        return lv - (ul.T @ torch.cholesky_solve((u @ lv)[:, None], chol))[:, 0]

    return solve


def logistic(d: int, *, n: int | None = None, lam: float = 0.1, seed: int = 0) -> BenchProblem:
    """Logistic regression with a learned per-feature weight decay; see the module docstring."""
    n = n if n is not None else (1000 if d <= 10_000 else 500)
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d, generator=gen, dtype=F64) / math.sqrt(d) * 3.0

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, d, generator=gen, dtype=F64)
        noise = 0.5 * torch.randn(n, generator=gen, dtype=F64)
        return x, torch.sign(x @ w_true + noise)

    x_tr, y_tr = data()
    x_va, y_va = data()
    alpha = math.log(lam) + 0.3 * torch.randn(d, generator=gen, dtype=F64)

    def lower(al: torch.Tensor, th: list[torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return _logistic_loss(b["x"], b["y"], th[0]) + 0.5 * (al.exp() * th[0].square()).sum()

    def upper(al: torch.Tensor, th: list[torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
        return _logistic_loss(b["x"], b["y"], th[0])

    # Newton with backtracking on the strongly convex lower level, in float64.
    lam_vec = alpha.exp()
    w = torch.zeros(d, dtype=F64)

    def g_and_grad(w: torch.Tensor) -> tuple[float, torch.Tensor]:
        wr = w.clone().requires_grad_(True)
        val = lower(alpha, [wr], {"x": x_tr, "y": y_tr})
        return float(val.detach()), torch.autograd.grad(val, wr)[0]

    val, grad = g_and_grad(w)
    for _ in range(50):
        if float(grad.norm()) < 1e-13:
            break
        step = -_logistic_hinv(x_tr, y_tr, w, lam_vec)(grad)
        t = 1.0
        while True:
            new_val, new_grad = g_and_grad(w + t * step)
            if new_val <= val + 1e-4 * t * float(grad @ step) or t < 1e-8:
                break
            t *= 0.5
        w, val, grad = w + t * step, new_val, new_grad
    wr = w.clone().requires_grad_(True)
    f_theta = torch.autograd.grad(upper(alpha, [wr], {"x": x_va, "y": y_va}), wr)[0]
    exact = -lam_vec * w * _logistic_hinv(x_tr, y_tr, w, lam_vec)(f_theta)
    prob = BenchProblem(
        name="logistic", size=d, alpha=alpha, theta=[w], lower=lower, upper=upper,
        lower_batch={"x": x_tr, "y": y_tr}, upper_batch={"x": x_va, "y": y_va}, inner_lr=0.0,
        exact=exact,
        exact_note="float64 Newton solution; H^-1 by " + ("Cholesky" if d <= n else "Woodbury"),
        detail={"n_train": n, "n_val": n, "lower_grad_norm": float(grad.norm())},
    )
    lmax = _lambda_max(prob)
    prob.inner_lr = 1.0 / lmax
    prob.detail["cond"] = lmax / float(lam_vec.min())
    return prob


# --------------------------------------------------------------------------- MLP
def _mlp_forward(th: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2, w3, b3 = th
    h = torch.tanh(F.linear(x, w1, b1))
    h = torch.tanh(F.linear(h, w2, b2))
    return F.linear(h, w3, b3)


def mlp_lower(al: torch.Tensor, th: list[torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    """CE of the MLP on the training batch + ½ e^α ‖θ‖²."""
    sq = sum(t.square().sum() for t in th)
    return F.cross_entropy(_mlp_forward(th, b["x"]), b["y"]) + 0.5 * al.exp()[0] * sq


def mlp_upper(al: torch.Tensor, th: list[torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
    """CE of the MLP on the validation batch (α enters through θ only)."""
    return F.cross_entropy(_mlp_forward(th, b["x"]), b["y"])


def mlp(hidden: int, *, n_in: int = 128, classes: int = 10, n: int = 512, lam: float = 0.1,
        lbfgs_iters: int = 200, ref_maxiter: int = 3000, seed: int = 0) -> BenchProblem:
    """Two-hidden-layer tanh MLP classifier with a learned L2 strength; see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(hidden, n_in), (hidden,), (hidden, hidden), (hidden,), (classes, hidden), (classes,)]

    def init() -> list[torch.Tensor]:
        out = []
        for s in shapes:
            fan_in = s[1] if len(s) == 2 else 1
            scale = 1.0 / math.sqrt(fan_in) if len(s) == 2 else 0.0
            out.append(torch.randn(s, generator=gen, dtype=F64) * scale)
        return out

    teacher = init()

    def data() -> dict[str, torch.Tensor]:
        x = torch.randn(n, n_in, generator=gen, dtype=F64)
        logits = 3.0 * _mlp_forward(teacher, x) + torch.randn(n, classes, generator=gen, dtype=F64)
        return {"x": x, "y": logits.argmax(1)}

    train, val = data(), data()
    alpha = torch.tensor([math.log(lam)], dtype=F64)
    theta = [t.requires_grad_(True) for t in init()]
    opt = torch.optim.LBFGS(theta, max_iter=lbfgs_iters, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-14, history_size=20)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = mlp_lower(alpha, theta, train)
        loss.backward()
        return loss

    opt.step(closure)
    theta = [t.detach() for t in theta]
    prob = BenchProblem(
        name="mlp", size=sum(t.numel() for t in theta), alpha=alpha, theta=theta,
        lower=mlp_lower, upper=mlp_upper, lower_batch=train, upper_batch=val, inner_lr=0.0,
        exact=torch.zeros(1, dtype=F64), exact_note="",
    )
    th = [t.clone().requires_grad_(True) for t in theta]
    f_theta = list(torch.autograd.grad(mlp_upper(alpha, th, val), th))
    g_theta = torch.autograd.grad(mlp_lower(alpha, th, train), th)
    v, residual = hvp_cg(prob, f_theta, rtol=1e-10, maxiter=ref_maxiter)
    # ∇²_{αθ} g · v = e^α ⟨θ, v⟩ for g = CE + ½ e^α ‖θ‖² (α is a scalar).
    prob.exact = -alpha.exp() * sum((t * vi).sum() for t, vi in zip(theta, v))
    prob.exact_note = f"float64 CG on the exact HVP, relative residual {residual:.1e}"
    lmax = _lambda_max(prob)
    prob.inner_lr = 1.0 / lmax
    prob.detail = {"hidden": hidden, "n_train": n, "n_val": n,
                   "lower_grad_norm": math.sqrt(sum(float(g.square().sum()) for g in g_theta)),
                   "cond_upper_bound": lmax / lam}
    return prob


def _mlp_sized(hidden: int) -> BenchProblem:
    # Above ~1e5 parameters the float64 reference dominates the run: cap it (the residual
    # it reached is in exact_note).
    return mlp(
        hidden,
        ref_maxiter=3000 if hidden <= 256 else 400,
        lbfgs_iters=200 if hidden <= 256 else 100,
    )


PROBLEMS: dict[str, Callable[[int], BenchProblem]] = {
    "quadratic": quadratic,
    "logistic": logistic,
    "mlp": _mlp_sized,
}


def build(name: str, size: int) -> BenchProblem:
    """The float64 instance of problem ``name`` at ``size`` (inner dim; hidden width for mlp)."""
    if name not in PROBLEMS:
        raise ValueError(f"unknown problem {name!r}; choose from {sorted(PROBLEMS)}")
    return PROBLEMS[name](size)
