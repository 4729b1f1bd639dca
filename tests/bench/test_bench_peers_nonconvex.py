"""bench/peers_nonconvex.py at a tiny size: the dense references are right, and the row builder
gives every method a row (bilevel's with finite errors; an absent peer says "not installed")."""

import math

import pytest
import torch

import bilevel
from bench import peers_nonconvex as pn
from bilevel import linalg


@pytest.fixture(scope="module")
def cases():
    return [pn.mlp_case(n=8, steps=3), pn.darts_case(n=12, batch=4, steps=10, h=3, c=2)]


def _bilevel_dense(case):
    problem = bilevel.Problem(upper=case.upper, lower=case.lower)
    return bilevel.hypergrad(problem, case.alpha, case.theta, upper_batch=case.val,
                             lower_batch=case.train, method=bilevel.Implicit(linalg.Dense()))


def test_dense_reference_matches_bilevel_dense(cases):
    # two independent float64 dense solves of the same linear system: agree to 1e-8 relative
    for case in cases:
        got = _bilevel_dense(case)
        assert float((got - case.exact).norm() / case.exact.norm()) < 1e-8, case.name


def test_rows_one_per_method_finite_bilevel_errors(cases, monkeypatch):
    # peers made absent here whatever the venv holds: their rows must say so, not vanish
    monkeypatch.setattr(pn.torchopt_lib, "unavailable", lambda: "torchopt hidden by the test")
    monkeypatch.setattr(pn.betty_lib, "unavailable", lambda: "betty hidden by the test")
    for case in cases:
        rows = pn.rows(case, timing=True, repeats=1)
        by = {r["method"]: r for r in rows}
        assert set(by) == {f"bilevel {k}" for k in pn.bilevel_solvers(1.0)} | {
            "torchopt solve_normal_cg (default)", "torchopt solve_cg", "betty cg", "betty neumann"}
        for name in ("bilevel MINRES", "bilevel Dense", "bilevel NormalCG"):
            assert math.isfinite(by[name]["error"]) and by[name]["error"] < 1e-6, (case.name, name)
            assert by[name]["ms"] > 0
        for name, r in by.items():  # every bilevel row: a finite error or the exception text
            if name.startswith("bilevel"):
                assert math.isfinite(r["error"]) or r["said"].startswith("raised"), (name, r)
            else:
                assert r["said"].startswith("not installed"), (name, r)
        text = pn.render([case], rows)
        assert "not installed" in text and "bilevel MINRES" in text


def test_rows_with_torchopt_present_match_dense(cases):
    """Where torchopt imports, its solve_cg / solve_normal_cg rows are finite; where it does not,
    the rows say "not installed" (either way the row exists)."""
    rows = {r["method"]: r for r in pn.rows(cases[0], timing=False)}
    for name in ("torchopt solve_cg", "torchopt solve_normal_cg (default)"):
        if pn.torchopt_lib.unavailable() is None:
            assert rows[name]["error"] < 1e-6, rows[name]
        else:
            assert rows[name]["said"].startswith("not installed"), rows[name]


def test_darts_inner_loop_is_sgd_on_one_fresh_minibatch_per_step():
    # the point every method is given comes from bilevel.ITD's lower_batches loop: the same
    # as plain SGD written by hand over the same draws, step for step
    kw = {"n": 12, "batch": 4, "steps": 10, "h": 3, "c": 2}
    case, data = pn.darts_case(**kw), pn.darts_draws(**kw)
    theta = dict(data["theta0"])
    for b in data["batches"]:
        th = {k: v.requires_grad_() for k, v in theta.items()}
        grads = torch.autograd.grad(pn.darts_lower(data["alpha"], th, b), list(th.values()))
        theta = {k: (v - 0.5 * g).detach() for (k, v), g in zip(th.items(), grads)}
    for k in theta:
        torch.testing.assert_close(case.theta[k], theta[k], rtol=1e-12, atol=1e-12)


def test_darts_dense_reference_is_the_derivative_of_the_tilted_problems_solution():
    # the implicit-function-theorem oracle (with its ∇_α f term, zero on the MLP) at θ_T
    # against central differences. θ_T is not stationary for the full-batch g, so tilt g by a
    # constant linear term: g̃(α, θ) = g(α, θ) − ⟨∇_θ g(α_0, θ_T), θ⟩ has θ_T as a stationary
    # point at α_0 and the same ∇²_θθ and ∇²_αθ, so dense_implicit at θ_T is exactly
    # dF/dα of F(α) = f(α, θ̃*(α)); θ̃*(α_0 ± ε e_i) by Newton's method from θ_T. On the
    # bench's own case (its H has condition ≈ 4e4; the tiny fixture's ≈ 3e5 is too curved
    # for a central difference to reach 1e-6)
    case = pn.darts_case()
    keys = list(case.theta)
    sizes = [case.theta[k].numel() for k in keys]
    flat_T = torch.cat([case.theta[k].reshape(-1) for k in keys])

    def unflat(t):
        return {k: p.reshape(case.theta[k].shape) for k, p in zip(keys, t.split(sizes))}

    def grad_g(alpha, t):
        return torch.func.grad(lambda v: pn.darts_lower(alpha, unflat(v), case.train))(t)

    tilt = grad_g(case.alpha, flat_T)

    def solution(alpha):
        t = flat_T.clone()
        for _ in range(6):  # quadratic convergence from 1e-5 away: round-off after 3 or 4
            r = grad_g(alpha, t) - tilt
            t = t - torch.linalg.solve(torch.func.jacfwd(lambda u: grad_g(alpha, u))(t), r)
        assert (grad_g(alpha, t) - tilt).norm() < 1e-12
        return unflat(t)

    eps, fd = 1e-6, torch.zeros_like(case.alpha)
    for i in range(case.alpha.numel()):
        e = torch.zeros_like(case.alpha)
        e[i] = eps
        f = [pn.darts_upper(case.alpha + s * e, solution(case.alpha + s * e), case.val) for s in (1, -1)]
        fd[i] = (f[0] - f[1]) / (2 * eps)
    assert float((fd - case.exact).norm() / case.exact.norm()) < 1e-6, (fd, case.exact)
