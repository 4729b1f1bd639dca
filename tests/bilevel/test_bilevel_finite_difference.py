"""DARTS' finite-difference hypergradient (bilevel.FiniteDifference, bilevel.FD) against its
exact oracle, the one-step unrolled hypergradient (``Unrolled(1, ξ)``, itself checked against
a closed form in test_bilevel_hypergrad.py), in float64.

* quadratic lower level: ∇_α g = −Bᵀθ is linear in θ, so the central difference is exact and
  FD equals the one-step unrolled hypergradient to rounding, property-based over sizes/seeds;
* a lower level with ∇_α g quartic in θ: the error is O(ε²) (halving ε divides it by ≈ 4).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bilevel
from tests.bilevel.test_bilevel_hypergrad import problems, quadratic, relerr

F64 = torch.float64


@settings(max_examples=15, deadline=None)
@given(problems, st.floats(0.01, 1.0), st.floats(1e-4, 1.0))
def test_fd_equals_the_one_step_unrolled_hypergradient_on_quadratics(prob, lr_scale, eps):
    d, m, cond, seed = prob
    problem, alpha, _, _, (A, B, c, C, p, rho) = quadratic(d, m, cond, seed)
    beta = lr_scale / cond
    theta0 = torch.randn(d, generator=torch.Generator().manual_seed(seed + 3), dtype=F64)
    args = dict(upper_batch=None, lower_batch=None)
    fd = bilevel.hypergrad(problem, alpha, {"theta": theta0},
                           method=bilevel.FiniteDifference(beta, eps=eps), **args)
    # closed form of the one-step unrolled hypergradient: θ₁ = θ₀ − β(Aθ₀ − Bα − c),
    # dθ₁/dα = βB, so dF₁/dα = βBᵀCᵀ(Cθ₁ − p) + ρα
    theta1 = theta0 - beta * (A @ theta0 - B @ alpha["a"] - c)
    exact = beta * B.T @ (C.T @ (C @ theta1 - p)) + rho * alpha["a"]
    unrolled = bilevel.hypergrad(problem, alpha, {"theta": theta0},
                                 method=bilevel.Unrolled(1, beta), **args)
    assert relerr(fd["a"], exact) < 1e-9
    assert relerr(unrolled["a"], exact) < 1e-12


def quartic(seed, d=5, m=5):
    """g = ¼ Σ_j e^{α_j} θ_j⁴ + ½‖θ − c‖², f = ½‖θ − p‖²: ∇_α g = ¼ e^α ⊙ θ⁴ is quartic in θ."""
    gen = torch.Generator().manual_seed(seed)
    c, p = torch.randn(d, generator=gen, dtype=F64), torch.randn(d, generator=gen, dtype=F64)

    def lower(o, i, batch):
        th = i["theta"]
        return 0.25 * (o["a"].exp() * th**4).sum() + 0.5 * ((th - c) ** 2).sum()

    def upper(o, i, batch):
        return 0.5 * ((i["theta"] - p) ** 2).sum()

    alpha = {"a": 0.3 * torch.randn(m, generator=gen, dtype=F64)}
    theta0 = torch.randn(d, generator=gen, dtype=F64)
    return bilevel.Problem(upper=upper, lower=lower), alpha, theta0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fd_error_is_second_order_in_eps_when_grad_alpha_g_is_not_quadratic(seed):
    problem, alpha, theta0 = quartic(seed)
    args = dict(upper_batch=None, lower_batch=None)
    beta = 0.1
    exact = bilevel.hypergrad(problem, alpha, {"theta": theta0},
                              method=bilevel.Unrolled(1, beta), **args)["a"]
    errs = []
    for eps in (4e-2, 2e-2, 1e-2):
        h = bilevel.hypergrad(problem, alpha, {"theta": theta0},
                              method=bilevel.FiniteDifference(beta, eps=eps), **args)["a"]
        errs.append(float((h - exact).norm()))
    assert errs[0] > 0
    for big, small in zip(errs, errs[1:]):
        assert 3.5 < big / small < 4.5  # O(ε²): halving ε quarters the error


def test_fd_solver_equals_itd_truncated_to_the_last_step():
    # FD(T, β) differentiates through the last of T steps by a central difference; on a
    # quadratic that is exact, so it equals ITD(T, β, truncate=1) direction for direction.
    problem, alpha, _, _, _ = quadratic(4, 2, 5.0, 11)
    theta0 = {"theta": torch.randn(4, generator=torch.Generator().manual_seed(1), dtype=F64)}
    args = dict(upper_batch=None, lower_batch=None)
    for T in (1, 4):
        fd = bilevel.FD(T, 0.1).step(problem, alpha, theta0, **args)
        itd = bilevel.ITD(T, 0.1, truncate=1).step(problem, alpha, theta0, **args)
        assert relerr(fd.outer_grad["a"], itd.outer_grad["a"]) < 1e-10
        assert torch.allclose(fd.inner_grad["theta"], itd.inner_grad["theta"], rtol=1e-12)
        assert torch.allclose(fd.inner_solution["theta"], itd.inner_solution["theta"], rtol=1e-12)
        assert fd.info["upper_loss"] == pytest.approx(itd.info["upper_loss"], rel=1e-12)
        assert fd.info["lower_loss"] == pytest.approx(itd.info["lower_loss"], rel=1e-12)
        assert fd.info["fd_radius"] > 0


def test_fd_counts_two_extra_gradients_and_no_double_backward():
    calls = {"lower": 0, "upper": 0}
    problem, alpha, theta0 = quartic(0)

    def lower(o, i, b):
        calls["lower"] += 1
        return problem.lower(o, i, b)

    def upper(o, i, b):
        calls["upper"] += 1
        return problem.upper(o, i, b)

    counted = bilevel.Problem(upper=upper, lower=lower)
    bilevel.FD(3, 0.1).step(counted, alpha, {"theta": theta0}, upper_batch=None, lower_batch=None)
    # T steps + the two perturbed gradients + ∇_θ g at θ^(T) for info's lower_grad_norm
    assert calls == {"lower": 3 + 2 + 1, "upper": 1}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: bilevel.FD(0, 0.1), "FD: inner_steps must be >= 1"),
        (lambda: bilevel.FD(1, 0.0), "FD: inner_lr must be a finite number > 0"),
        (lambda: bilevel.FD(1, 0.1, eps=0.0), "FD: eps must be a finite number > 0"),
        (lambda: bilevel.FiniteDifference(-1.0), "FiniteDifference: inner_lr must be"),
        (lambda: bilevel.FiniteDifference(0.1, eps=float("nan")), "FiniteDifference: eps must be"),
    ],
)
def test_fd_options_are_checked_at_construction(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()
