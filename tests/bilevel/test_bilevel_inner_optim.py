"""Unrolling SGD with momentum and Adam (bilevel.SGD, bilevel.Adam as ``inner_optimizer``).

Oracles, both independent of bilevel's own update code:
* the trajectory θ_T equals T steps of ``torch.optim.SGD``/``torch.optim.Adam`` on g(α, ·);
* the unrolled hypergradient equals float64 central finite differences of
  F(α) = f(α, θ_T(α)) with θ_T computed by ``torch.optim`` (property-based over sizes, seeds,
  step counts and optimizer settings).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bilevel
from tests.bilevel.test_bilevel_hypergrad import quadratic, relerr

F64 = torch.float64

OPTIMIZERS = {
    "momentum": (bilevel.SGD(momentum=0.9), lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)),
    "dampened": (
        bilevel.SGD(momentum=0.5, dampening=0.3),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.5, dampening=0.3),
    ),
    "nesterov": (
        bilevel.SGD(momentum=0.8, nesterov=True),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.8, nesterov=True),
    ),
    "adam": (bilevel.Adam(), lambda p, lr: torch.optim.Adam(p, lr=lr)),
    "adam_betas": (
        bilevel.Adam(betas=(0.5, 0.9), eps=1e-6),
        lambda p, lr: torch.optim.Adam(p, lr=lr, betas=(0.5, 0.9), eps=1e-6),
    ),
}


def torch_optim_trajectory(problem, alpha, theta0, make, lr, T):
    """θ_T from T steps of a torch.optim optimizer on g(α, ·) (α fixed)."""
    theta = theta0.clone().requires_grad_()
    opt = make([theta], lr)
    for _ in range(T):
        opt.zero_grad()
        problem.lower(alpha, {"theta": theta}, None).backward()
        opt.step()
    return theta.detach()


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 5), st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**16),
    st.sampled_from(sorted(OPTIMIZERS)),
)
def test_unrolled_optimizer_matches_finite_differences_of_torch_optim(d, m, T, seed, name):
    problem, alpha, _, _, _ = quadratic(d, m, 4.0, seed)
    ours, make = OPTIMIZERS[name]
    lr = 0.05 if name.startswith("adam") else 0.1
    theta0 = torch.randn(d, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)

    def F(a):
        a_tree = {"a": a}
        theta_T = torch_optim_trajectory(problem, a_tree, theta0, make, lr, T)
        return float(problem.upper(a_tree, {"theta": theta_T}, None))

    h = 1e-5
    fd = torch.zeros(m, dtype=F64)
    for j in range(m):
        e = torch.zeros(m, dtype=F64)
        e[j] = h
        fd[j] = (F(alpha["a"] + e) - F(alpha["a"] - e)) / (2 * h)
    got = bilevel.hypergrad(
        problem, alpha, {"theta": theta0}, upper_batch=None, lower_batch=None,
        method=bilevel.Unrolled(T, lr, inner_optimizer=ours),
    )["a"]
    assert relerr(got, fd) < 1e-6, (name, got, fd)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_itd_inner_solution_is_the_torch_optim_trajectory(name):
    problem, alpha, _, _, _ = quadratic(5, 2, 10.0, 3)
    ours, make = OPTIMIZERS[name]
    theta0 = torch.randn(5, generator=torch.Generator().manual_seed(9), dtype=F64)
    for truncate in (None, 3):  # the graph-free part (T − K steps) runs the same update
        r = bilevel.ITD(7, 0.05, truncate=truncate, inner_optimizer=ours).step(
            problem, alpha, {"theta": theta0}, upper_batch=None, lower_batch=None
        )
        expected = torch_optim_trajectory(problem, alpha, theta0, make, 0.05, 7)
        assert torch.allclose(r.inner_solution["theta"], expected, rtol=1e-12, atol=1e-14)


def test_default_and_plain_sgd_are_the_unrolled_gradient_descent():
    problem, alpha, _, _, _ = quadratic(4, 2, 5.0, 0)
    theta0 = {"theta": torch.ones(4, dtype=F64)}
    args = dict(upper_batch=None, lower_batch=None)
    a = bilevel.hypergrad(problem, alpha, theta0, method=bilevel.Unrolled(5, 0.1), **args)
    b = bilevel.hypergrad(problem, alpha, theta0, method=bilevel.Unrolled(
        5, 0.1, inner_optimizer=bilevel.SGD(momentum=0.0)), **args)
    assert torch.equal(a["a"], b["a"])


def test_truncated_momentum_treats_the_window_start_state_as_constant():
    # With truncate=K, θ_{T−K} and the momentum buffer there are constants. Check against
    # the definition: the last K steps written out by hand from torch.optim's state after
    # the first T − K steps, differentiated w.r.t. α by autograd.
    problem, alpha, _, _, _ = quadratic(3, 2, 5.0, 4)
    theta0 = torch.randn(3, generator=torch.Generator().manual_seed(2), dtype=F64)
    T, K, lr, mu = 6, 2, 0.1, 0.9
    theta = theta0.clone().requires_grad_()
    opt = torch.optim.SGD([theta], lr=lr, momentum=mu)
    for _ in range(T - K):
        opt.zero_grad()
        problem.lower(alpha, {"theta": theta}, None).backward()
        opt.step()
    buf = opt.state[theta]["momentum_buffer"].detach()
    a = alpha["a"].clone().requires_grad_()
    th = theta.detach().requires_grad_()
    for _ in range(K):  # the window, written out by hand
        g_value = problem.lower({"a": a}, {"theta": th}, None)
        (g,) = torch.autograd.grad(g_value, th, create_graph=True)
        buf = mu * buf + g
        th = th - lr * buf
    (expected,) = torch.autograd.grad(problem.upper({"a": a}, {"theta": th}, None), a)
    got = bilevel.hypergrad(problem, alpha, {"theta": theta0}, upper_batch=None, lower_batch=None,
                            method=bilevel.Unrolled(T, lr, truncate=K,
                                                    inner_optimizer=bilevel.SGD(momentum=mu)))
    assert relerr(got["a"], expected) < 1e-12


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: bilevel.SGD(momentum=-0.1), "SGD: momentum must be a finite number >= 0"),
        (lambda: bilevel.SGD(nesterov=True), "SGD: nesterov=True needs momentum > 0"),
        (lambda: bilevel.Adam(betas=(0.9, 1.0)), r"Adam: betas\[1\] must be a number in \[0, 1\)"),
        (lambda: bilevel.Adam(betas=[0.9, 0.99]), "Adam: betas must be a tuple"),
        (lambda: bilevel.Adam(eps=0.0), "Adam: eps and eps_root are both 0"),
        (lambda: bilevel.ITD(3, 0.1, inner_optimizer=torch.optim.SGD),
         "ITD: inner_optimizer must be bilevel.SGD"),
        (lambda: bilevel.Unrolled(3, 0.1, inner_optimizer="adam"),
         "Unrolled: inner_optimizer must be bilevel.SGD"),
    ],
)
def test_inner_optimizer_options_are_checked_at_construction(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def test_adam_through_a_gradient_entry_that_is_exactly_zero_is_finite_and_right():
    # θ₀ = α in the first entry: g's gradient there is exactly 0 at step 1, so v̂ = 0 and
    # autograd's d√v̂ = ∞ · 0 = NaN would poison the hypergradient. The true derivative
    # comes through m alone; eps = 1 makes it resolvable by central differences (with the
    # default 1e-8 it is ~1/eps per step, as steep as Adam's map is there).
    def lower(o, i, b):
        return 0.5 * ((i["theta"] - o["a"]) ** 2).sum()

    def upper(o, i, b):
        return ((i["theta"] - 1) ** 2).sum()

    problem = bilevel.Problem(upper=upper, lower=lower)
    alpha = {"a": torch.tensor([0.5, 0.3], dtype=F64)}
    theta0 = torch.tensor([0.5, -1.0], dtype=F64)
    lr, T, h = 0.1, 3, 1e-6

    def F(a):
        make = lambda p, lr: torch.optim.Adam(p, lr=lr, eps=1.0)  # noqa: E731
        theta_T = torch_optim_trajectory(problem, {"a": a}, theta0, make, lr, T)
        return upper({"a": a}, {"theta": theta_T}, None)

    fd = torch.stack([(F(alpha["a"] + h * e) - F(alpha["a"] - h * e)) / (2 * h)
                      for e in torch.eye(2, dtype=F64)])
    args = dict(upper_batch=None, lower_batch=None)
    got = bilevel.hypergrad(problem, alpha, {"theta": theta0}, **args,
                            method=bilevel.Unrolled(T, lr, inner_optimizer=bilevel.Adam(eps=1.0)))
    assert relerr(got["a"], fd) < 1e-5, (got["a"], fd)
    default = bilevel.hypergrad(problem, alpha, {"theta": theta0}, **args,
                                method=bilevel.Unrolled(T, lr, inner_optimizer=bilevel.Adam()))
    assert torch.isfinite(default["a"]).all()


def test_every_unroll_starts_a_fresh_optimizer_state():
    # The optimizer objects are stateless: the same ITD (and SGD with dampening, whose
    # first step b₁ = g₁ differs from later ones) gives the same step twice.
    problem, alpha, _, _, _ = quadratic(3, 2, 5.0, 8)
    theta0 = {"theta": torch.randn(3, generator=torch.Generator().manual_seed(4), dtype=F64)}
    solver = bilevel.ITD(4, 0.1, inner_optimizer=bilevel.SGD(momentum=0.9, dampening=0.5))
    first, second = (solver.step(problem, alpha, theta0, upper_batch=None, lower_batch=None)
                     for _ in range(2))
    assert torch.equal(first.outer_grad["a"], second.outer_grad["a"])
    assert torch.equal(first.inner_solution["theta"], second.inner_solution["theta"])
