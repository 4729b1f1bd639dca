"""bilevel.hypergrad against closed forms in float64.

Oracles (all computed here with torch.linalg.solve, independently of the library):
* quadratic: g = ½θᵀAθ − θᵀ(Bα + c), θ*(α) = A⁻¹(Bα + c),
  f = ½‖Cθ − p‖² + ½ρ‖α‖²,  dF/dα = Bᵀ A⁻¹ Cᵀ(Cθ* − p) + ρα.
  Unrolled GD from θ₀ with step β: dθ_T/dα = Σ_{j<T}(I − βA)^j βB = (I − (I − βA)^T) A⁻¹B;
  truncated to the last K steps: (I − (I − βA)^K) A⁻¹B.
* ridge with learned log-regularization (scalar and per feature):
  g = ‖Xw − y‖²/2n + ½ Σ_j e^{α_j} w_j²,  H = XᵀX/n + diag(e^α),  w* = H⁻¹Xᵀy/n,
  dF/dα = −(e^α ⊙ w*) ⊙ H⁻¹∇_w f   (summed over j for the scalar case).
* logistic regression with per-feature weight decay: w* by Newton's method to machine
  precision, dF/dα by central finite differences of F(α) = f(w*(α)).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bilevel
from bilevel import linalg

F64 = torch.float64
SETTINGS = settings(max_examples=15, deadline=None)


def spd(n, cond, gen):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    return (q * torch.logspace(0, math.log10(cond), n, dtype=F64)) @ q.T


def quadratic(d, m, cond, seed):
    gen = torch.Generator().manual_seed(seed)
    A = spd(d, cond, gen)
    B = torch.randn(d, m, generator=gen, dtype=F64)
    c = torch.randn(d, generator=gen, dtype=F64)
    C = torch.randn(d + 1, d, generator=gen, dtype=F64)
    p = torch.randn(d + 1, generator=gen, dtype=F64)
    rho = 0.3
    alpha = {"a": torch.randn(m, generator=gen, dtype=F64)}

    def lower(o, i, batch):
        th = i["theta"]
        return 0.5 * th @ A @ th - th @ (B @ o["a"] + c)

    def upper(o, i, batch):
        r = C @ i["theta"] - p
        return 0.5 * r @ r + 0.5 * rho * o["a"] @ o["a"]

    theta_star = torch.linalg.solve(A, B @ alpha["a"] + c)
    exact = B.T @ torch.linalg.solve(A, C.T @ (C @ theta_star - p)) + rho * alpha["a"]
    return bilevel.Problem(upper=upper, lower=lower), alpha, theta_star, exact, (A, B, c, C, p, rho)


problems = st.tuples(
    st.integers(1, 8), st.integers(1, 4), st.floats(1.0, 30.0), st.integers(0, 2**16)
)


def relerr(x, y):
    return float((x - y).norm() / max(float(y.norm()), 1e-12))


@pytest.mark.slow
@SETTINGS
@given(problems)
def test_implicit_matches_closed_form_on_random_quadratics(prob):
    d, m, cond, seed = prob
    problem, alpha, theta_star, exact, _ = quadratic(d, m, cond, seed)
    lr = 1.0 / cond  # λ_max(A) = cond
    methods = {
        "CG": (linalg.CG(maxiter=10 * d, tol=1e-14), 1e-9),
        "Dense": (linalg.Dense(), 1e-10),
        "Neumann": (linalg.Neumann(steps=2500, lr=lr), 1e-7),
        "FixedPoint": (linalg.FixedPoint(maxiter=2500, lr=lr, tol=1e-14), 1e-7),
    }
    for name, (solver, tol) in methods.items():
        h = bilevel.hypergrad(
            problem,
            alpha,
            {"theta": theta_star},
            upper_batch=None,
            lower_batch=None,
            method=bilevel.Implicit(linear_solver=solver),
        )
        assert set(h) == {"a"} and h["a"].shape == alpha["a"].shape
        assert relerr(h["a"], exact) < tol, name


@SETTINGS
@given(problems, st.integers(1, 25), st.data())
def test_unrolled_matches_its_finite_T_closed_form_with_and_without_truncation(prob, T, data):
    d, m, cond, seed = prob
    problem, alpha, theta_star, _, (A, B, c, C, p, rho) = quadratic(d, m, cond, seed)
    K = data.draw(st.integers(1, T))
    beta = 1.0 / cond
    theta0 = torch.randn(d, generator=torch.Generator().manual_seed(seed + 7), dtype=F64)
    eye = torch.eye(d, dtype=F64)
    M = eye - beta * A
    # θ_{t+1} = Mθ_t + β(Bα + c) with M = I − βA, so θ_T = M^T θ₀ + (I − M^T) θ*.
    MT = torch.linalg.matrix_power(M, T)
    theta_T = MT @ theta0 + (eye - MT) @ theta_star
    grad_theta = C.T @ (C @ theta_T - p)
    for trunc in (None, K):
        k = T if trunc is None else trunc
        jac = (eye - torch.linalg.matrix_power(M, k)) @ torch.linalg.solve(A, B)
        expected = jac.T @ grad_theta + rho * alpha["a"]
        h = bilevel.hypergrad(
            problem,
            alpha,
            {"theta": theta0},
            upper_batch=None,
            lower_batch=None,
            method=bilevel.Unrolled(inner_steps=T, inner_lr=beta, truncate=trunc),
        )
        assert relerr(h["a"], expected) < 1e-9


def test_errors_shrink_as_iterations_grow():
    problem, alpha, theta_star, exact, (A, *_rest) = quadratic(6, 3, 20.0, 1)
    lr = 1.0 / 20.0

    def err(method, inner):
        h = bilevel.hypergrad(
            problem, alpha, {"theta": inner}, upper_batch=None, lower_batch=None, method=method
        )
        return relerr(h["a"], exact)

    cg = [err(bilevel.Implicit(linalg.CG(maxiter=k, tol=0.0)), theta_star) for k in (1, 3, 6)]
    neumann = [
        err(bilevel.Implicit(linalg.Neumann(steps=k, lr=lr)), theta_star) for k in (10, 100, 1000)
    ]
    fixed = [
        err(bilevel.Implicit(linalg.FixedPoint(maxiter=k, lr=lr, tol=0.0)), theta_star)
        for k in (10, 100, 1000)
    ]
    unrolled = [
        err(bilevel.Unrolled(inner_steps=k, inner_lr=lr), torch.zeros(6, dtype=F64)) for k in (10, 100, 1000)
    ]
    for name, errs in {
        "CG": cg,
        "Neumann": neumann,
        "FixedPoint": fixed,
        "Unrolled": unrolled,
    }.items():
        assert errs[0] > errs[1] > errs[2] or errs[2] < 1e-12, (name, errs)
        assert errs[2] < 1e-6, (name, errs)


def ridge(n, d, seed, per_feature):
    gen = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(n, d, generator=gen, dtype=F64), torch.randn(n, d, generator=gen, dtype=F64)
    w_true = torch.randn(d, generator=gen, dtype=F64)
    y = X @ w_true + 0.5 * torch.randn(n, generator=gen, dtype=F64)
    yv = Xv @ w_true + 0.5 * torch.randn(n, generator=gen, dtype=F64)
    log_lam = 0.3 * torch.randn(d if per_feature else (), generator=gen, dtype=F64) - 1.0

    def lower(o, w, batch):
        Xb, yb = batch
        r = Xb @ w - yb
        return 0.5 * r @ r / len(yb) + 0.5 * (o.exp() * w * w).sum()

    def upper(o, w, batch):
        Xb, yb = batch
        r = Xb @ w - yb
        return 0.5 * r @ r / len(yb)

    lam = log_lam.exp() * torch.ones(d, dtype=F64)
    H = X.T @ X / n + torch.diag(lam)
    w_star = torch.linalg.solve(H, X.T @ y / n)
    grad_f = Xv.T @ (Xv @ w_star - yv) / n
    per = -(lam * w_star) * torch.linalg.solve(H, grad_f)
    exact = per if per_feature else per.sum()
    return bilevel.Problem(upper=upper, lower=lower), log_lam, w_star, exact, (X, y), (Xv, yv), H


@pytest.mark.slow
@SETTINGS
@given(st.integers(5, 40), st.integers(1, 6), st.integers(0, 2**16), st.booleans())
def test_ridge_with_learned_regularization(n, d, seed, per_feature):
    problem, log_lam, w_star, exact, train, val, H = ridge(n, d, seed, per_feature)
    lmax = float(torch.linalg.eigvalsh(H)[-1])
    for solver in (linalg.CG(maxiter=10 * d, tol=1e-14), linalg.Dense()):
        h = bilevel.hypergrad(
            problem,
            log_lam,
            w_star,
            upper_batch=val,
            lower_batch=train,
            method=bilevel.Implicit(solver),
        )
        assert h.shape == log_lam.shape
        assert torch.allclose(h, exact, rtol=1e-8, atol=1e-12)
    # Unrolled from w* itself: θ_t stays at w*, and the Jacobian converges as T grows.
    h = bilevel.hypergrad(
        problem,
        log_lam,
        w_star,
        upper_batch=val,
        lower_batch=train,
        method=bilevel.Unrolled(inner_steps=400, inner_lr=1.0 / lmax),
    )
    lmin = float(torch.linalg.eigvalsh(H)[0])
    bound = (1 - lmin / lmax) ** 400
    assert relerr(h, exact) < max(1e-8, 10 * bound)


def logistic(seed, n=30, d=4):
    gen = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(n, d, generator=gen, dtype=F64), torch.randn(n, d, generator=gen, dtype=F64)
    w0 = torch.randn(d, generator=gen, dtype=F64)
    y = (X @ w0 + 0.5 * torch.randn(n, generator=gen, dtype=F64) > 0).to(F64)
    yv = (Xv @ w0 + 0.5 * torch.randn(n, generator=gen, dtype=F64) > 0).to(F64)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def lower(o, i, batch):
        return bce(X @ i["w"], y) + 0.5 * (o["log_wd"].exp() * i["w"] ** 2).sum()

    def upper(o, i, batch):
        return bce(Xv @ i["w"], yv)

    def solve(log_wd):
        w = torch.zeros(d, dtype=F64)
        for _ in range(50):  # Newton's method: quadratic convergence to machine precision
            wr = w.clone().requires_grad_()
            g = torch.autograd.functional.jacobian(
                lambda v: torch.autograd.grad(
                    lower({"log_wd": log_wd}, {"w": v}, None), v, create_graph=True
                )[0],
                wr,
            )
            (gr,) = torch.autograd.grad(lower({"log_wd": log_wd}, {"w": wr}, None), wr)
            w = w - torch.linalg.solve(g, gr)
        return w

    return bilevel.Problem(upper=upper, lower=lower), solve, upper


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logistic_regression_weight_decay_vs_dense_and_finite_differences(seed):
    problem, solve, upper = logistic(seed)
    log_wd = torch.tensor([-1.0, -2.0, 0.0, -0.5], dtype=F64)
    w_star = solve(log_wd)
    fd = torch.zeros(4, dtype=F64)
    h_step = 1e-5
    for j in range(4):
        e = torch.zeros(4, dtype=F64)
        e[j] = h_step
        f_plus = upper(None, {"w": solve(log_wd + e)}, None)
        f_minus = upper(None, {"w": solve(log_wd - e)}, None)
        fd[j] = (f_plus - f_minus) / (2 * h_step)
    args = dict(upper_batch=None, lower_batch=None)
    dense = bilevel.hypergrad(
        problem, {"log_wd": log_wd}, {"w": w_star}, method=bilevel.Implicit(linalg.Dense()), **args
    )["log_wd"]
    cg = bilevel.hypergrad(
        problem,
        {"log_wd": log_wd},
        {"w": w_star},
        method=bilevel.Implicit(linalg.CG(maxiter=50, tol=1e-14)),
        **args,
    )["log_wd"]
    assert torch.allclose(dense, fd, rtol=1e-6, atol=1e-9)
    assert torch.allclose(cg, dense, rtol=1e-10, atol=1e-13)
    # Unrolled from the solution with many steps converges to the same answer.
    unrolled = bilevel.hypergrad(
        problem,
        {"log_wd": log_wd},
        {"w": w_star},
        method=bilevel.Unrolled(inner_steps=300, inner_lr=1.0),
        **args,
    )["log_wd"]
    assert torch.allclose(unrolled, dense, rtol=1e-6, atol=1e-9)


# -- a user-written linear solver (a plain function) behind Implicit ---------------------------
def _flat(xs):
    return torch.cat([x.reshape(-1) for x in xs])


def _split(vec, like):
    out, start = [], 0
    for t in like:
        out.append(vec[start : start + t.numel()].reshape(t.shape))
        start += t.numel()
    return out


def dense_solve(matvec, b, init=None):
    """Materialize A from unit vectors and call torch.linalg.solve (init is not needed)."""
    eye = torch.eye(sum(t.numel() for t in b), dtype=b[0].dtype)
    a = torch.stack([_flat(matvec(_split(e, b))) for e in eye], dim=1)
    return _split(torch.linalg.solve(a, _flat(b)), b), {"matvecs": float(len(eye))}


def richardson(lr, iters):
    def solve(matvec, b, init=None):
        x = [torch.zeros_like(t) for t in b] if init is None else [t.clone() for t in init]
        for _ in range(iters):
            x = [xi + lr * (bi - ai) for xi, bi, ai in zip(x, b, matvec(x))]
        return x, {}

    return solve


def test_a_plain_function_linear_solver_gives_the_dense_oracle_hypergradient():
    problem, alpha, theta_star, exact, _ = quadratic(6, 3, 20.0, 11)
    args = dict(upper_batch=None, lower_batch=None)
    inner = {"theta": theta_star}
    oracle = bilevel.hypergrad(problem, alpha, inner, method=bilevel.Implicit(linalg.Dense()), **args)
    assert relerr(oracle["a"], exact) < 1e-10
    h, info = bilevel.hypergrad(
        problem, alpha, inner, method=bilevel.Implicit(dense_solve), return_info=True, **args
    )
    assert relerr(h["a"], oracle["a"]) < 1e-12
    assert info["solver_matvecs"] == 6.0  # the user's info keys come back as solver_<key>
    h = bilevel.hypergrad(
        problem, alpha, inner, method=bilevel.Implicit(richardson(1 / 20.0, 2000)), **args
    )
    assert relerr(h["a"], oracle["a"]) < 1e-9
    aid = bilevel.AID(0, 0.1, linear_solver=dense_solve)  # AID takes it too
    r = aid.step(problem, alpha, inner, **args)
    assert relerr(r.outer_grad["a"], oracle["a"]) < 1e-12


SOLVER_KEYS = {"solver_iterations", "solver_residual", "solver_converged"}


def test_return_info_reports_each_methods_diagnostics():
    problem, alpha, theta_star, _, _ = quadratic(5, 2, 10.0, 3)
    inner, args = {"theta": theta_star}, dict(upper_batch=None, lower_batch=None)
    keys = {
        bilevel.Implicit(linalg.CG(maxiter=30, tol=1e-12)): SOLVER_KEYS,
        bilevel.Implicit(linalg.MINRES(maxiter=30, tol=1e-12)): SOLVER_KEYS,
        bilevel.Implicit(linalg.NormalCG(maxiter=30, tol=1e-12)):
            SOLVER_KEYS | {"solver_normal_residual", "solver_matvecs"},
        bilevel.Implicit(linalg.Neumann(steps=5, lr=0.05, on_unconverged="ignore")): SOLVER_KEYS,
        bilevel.Implicit(linalg.FixedPoint(maxiter=5, lr=0.05, on_unconverged="ignore")): SOLVER_KEYS,
        bilevel.Implicit(linalg.Dense()): SOLVER_KEYS | {"solver_rank"},
        bilevel.Unrolled(4, 0.05): set(),
    }
    for method, extra in keys.items():
        h, info = bilevel.hypergrad(problem, alpha, inner, method=method, return_info=True, **args)
        assert set(info) == {"upper_loss", "lower_loss"} | extra, method
        assert all(isinstance(v, float) for v in info.values())
        assert torch.equal(h["a"], bilevel.hypergrad(problem, alpha, inner, method=method, **args)["a"])
    _, info = bilevel.hypergrad(
        problem, alpha, inner, method=bilevel.Implicit(linalg.Dense()), return_info=True, **args
    )
    assert info["solver_iterations"] == 5.0


def test_hypergrad_accepts_any_object_with_estimate():
    class Halved:
        """A user method: half the implicit hypergradient (through the public protocol)."""

        def estimate(self, objectives, variables, batches):
            est = bilevel.Implicit(linalg.Dense()).estimate(objectives, variables, batches)
            est.outer_grad = [0.5 * g for g in est.outer_grad]
            return est

    problem, alpha, theta_star, exact, _ = quadratic(4, 2, 5.0, 1)
    h = bilevel.hypergrad(problem, alpha, {"theta": theta_star}, upper_batch=None,
                          lower_batch=None, method=Halved())
    assert relerr(h["a"], 0.5 * exact) < 1e-10


def test_a_linear_solver_with_the_wrong_signature_or_result_is_named():
    with pytest.raises(TypeError, match="linear_solver must be a bilevel.linalg solver .* or a "
                                        r"callable solve\(matvec, b, init=None\)"):
        bilevel.Implicit(linear_solver=lambda matvec: None)
    problem, alpha, theta_star, _, _ = quadratic(4, 2, 5.0, 1)
    bad = {
        "x of type Tensor": lambda matvec, b, init=None: (b[0], {}),
        "returned x of shapes": lambda matvec, b, init=None: ([b[0][:2]], {}),
    }
    for match, solve in bad.items():
        with pytest.raises(ValueError, match=match):
            bilevel.hypergrad(problem, alpha, {"theta": theta_star}, upper_batch=None,
                              lower_batch=None, method=bilevel.Implicit(solve))
