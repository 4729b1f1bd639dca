"""The first-order and single-loop solvers (BOME, V-PBGD, F2SA, SOBA, FD) converge through
``bilevel.fit`` to the known solution of a convex bilevel problem, each to a stated
tolerance within a stated number of steps.

The problem (float64): g = ½θᵀAθ − θᵀ(Bα + c) with A's eigenvalues in [1, 2],
f = ½‖Cθ − p‖² + ½ρ‖α‖² (``quadratic`` of test_bilevel_hypergrad.py, d = 3, m = 2). Closed
forms, computed here with torch.linalg.solve:

* the bilevel solution: θ*(α) = A⁻¹(Bα + c), F(α) = ½‖J α + r‖² + ½ρ‖α‖² with
  J = CA⁻¹B, r = CA⁻¹c − p, so α* = −(JᵀJ + ρI)⁻¹Jᵀr;
* the penalty methods with a fixed penalty λ (V-PBGD's γ, F2SA's λ) solve
  min_{α,θ} P_λ = f(α, θ) + λ(g(α, θ) − min_θ' g(α, θ')), here a quadratic in (α, θ):
  its minimizer (α_λ, θ_λ) is one dense solve, and ‖α_λ − α*‖ = O(1/λ);
* FD (DARTS) differentiates one inner step: with θ = θ*(α) its direction is
  ρα + βBᵀCᵀ(Cθ*(α) − p), zero at α_FD = −(ρI + βBᵀCᵀJ)⁻¹ βBᵀCᵀr — the bilevel solution
  only when one step of size β solves the lower level (A = I/β).
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bilevel
from tests.bilevel.test_bilevel_hypergrad import quadratic

F64 = torch.float64
PROBLEM, ALPHA0, _, _, (A, B, c, C, p, RHO) = quadratic(3, 2, 2.0, 5)
AINV = torch.linalg.inv(A)
J, R = C @ AINV @ B, C @ AINV @ c - p
ALPHA_STAR = -torch.linalg.solve(J.T @ J + RHO * torch.eye(2, dtype=F64), J.T @ R)
THETA_STAR = AINV @ (B @ ALPHA_STAR + c)


def penalized_minimizer(lam):
    """argmin over (α, θ) of P_λ, by one Newton step (P_λ is quadratic)."""

    def P(z):
        a, y = z[:2], z[2:]
        e = y - AINV @ (B @ a + c)  # g(α, y) − g*(α) = ½ eᵀAe
        r = C @ y - p
        return 0.5 * r @ r + 0.5 * RHO * a @ a + 0.5 * lam * e @ A @ e

    z0 = torch.zeros(5, dtype=F64)
    H = torch.autograd.functional.hessian(P, z0)
    z = -torch.linalg.solve(H, torch.autograd.functional.jacobian(P, z0))
    return z[:2], z[2:]


def run(solver, steps, lr_outer, lr_inner, momentum=0.0, problem=PROBLEM, d=3, **kwargs):
    outer = {"a": ALPHA0["a"].clone().requires_grad_()}
    inner = {"theta": torch.zeros(d, dtype=F64, requires_grad=True)}
    inner_opt = None if lr_inner is None else torch.optim.SGD(
        list(inner.values()), lr=lr_inner, momentum=momentum)
    history = bilevel.fit(
        problem, solver, outer, inner, steps=steps, progress=False,
        outer_optimizer=torch.optim.SGD(list(outer.values()), lr=lr_outer, momentum=momentum),
        inner_optimizer=inner_opt, **kwargs,
    )
    return outer["a"].detach(), inner["theta"].detach(), history


def rel(x, y):
    return float((x - y).norm() / y.norm())


def test_soba_converges_to_the_bilevel_solution():
    a, theta, history = run(bilevel.SOBA(v_lr=0.5), steps=400, lr_outer=0.1, lr_inner=0.5)
    assert rel(a, ALPHA_STAR) < 1e-8 and rel(theta, THETA_STAR) < 1e-8
    assert history.last["v_residual_norm"] < 1e-8  # v solved ∇²_θθ g v = −∇_θ f on the way


def test_f2sa_with_a_fixed_lambda_converges_to_the_penalized_minimizer():
    lam = 10.0
    a, theta, history = run(bilevel.F2SA(5, 0.5, lam=lam), steps=300, lr_outer=0.3, lr_inner=0.5)
    a_lam, _ = penalized_minimizer(lam)
    assert rel(a, a_lam) < 1e-8
    assert rel(theta, AINV @ (B @ a + c)) < 1e-8  # θ is F2SA's z ≈ θ*(α)
    assert 0.005 < rel(a_lam, ALPHA_STAR) < 0.05  # the O(1/λ) bias at λ = 10
    assert history.last["penalty"] == lam


def test_f2sa_with_a_growing_lambda_converges_to_the_bilevel_solution():
    # λ_k = 10 + k: the y step is scaled by 1/λ and the α direction stays O(1) as λ grows,
    # so fixed learning rates stay stable while the O(1/λ) bias vanishes.
    solver = bilevel.F2SA(5, 0.5, lam=10.0, lam_growth=1.0)
    a, theta, history = run(solver, steps=300, lr_outer=0.3, lr_inner=0.5)
    assert history.last["penalty"] == 10.0 + 299
    assert rel(a, ALPHA_STAR) < 2e-3 and rel(theta, THETA_STAR) < 2e-3
    a_lam, _ = penalized_minimizer(309.0)
    assert rel(a, a_lam) < 1e-3  # where a λ ≈ 300 penalty puts it


@pytest.mark.slow
def test_vpbgd_with_a_fixed_gamma_converges_to_the_penalized_minimizer():
    # β = 2/3 contracts θ^(T) towards θ* by 1/3 per step (A's eigenvalues in [1, 2]), so
    # T = 12 makes g(α, θ^(T)) = g*(α) to ~1e-6 and V-PBGD's fixed point that of P_γ.
    gamma = 10.0
    a, theta, history = run(bilevel.VPBGD(12, 2 / 3, gamma=gamma), steps=300, lr_outer=0.02,
                            lr_inner=0.02, momentum=0.8)
    a_g, theta_g = penalized_minimizer(gamma)
    assert rel(a, a_g) < 1e-4 and rel(theta, theta_g) < 1e-4
    assert history.last["penalty"] == gamma


def test_vpbgd_with_a_growing_gamma_and_a_fixed_learning_rate_diverges():
    # The θ direction ∇_θ f + γ∇_θ g has curvature ~ γ·L_g: with the learning rate that is
    # stable at γ = 10, γ_k = 10 + k diverges (the objectives overflow and the step says so).
    with pytest.raises(FloatingPointError, match="VPBGD.step: the .* objective .* non-finite"):
        run(bilevel.VPBGD(2, 2 / 3, gamma=10.0, gamma_growth=1.0), steps=300,
            lr_outer=0.02, lr_inner=0.02, momentum=0.8)


def test_vpbgd_with_a_growing_gamma_and_learning_rates_shrinking_like_one_over_gamma():
    # With learning rates 0.2/γ_k (a LambdaLR stepped from fit's callback) it is stable but
    # slow: γ_k = 10 + 0.3k ends 1.3 % from the solution, no closer than γ = 10's bias.
    solver = bilevel.VPBGD(8, 2 / 3, gamma=10.0, gamma_growth=0.3)
    outer = {"a": ALPHA0["a"].clone().requires_grad_()}
    inner = {"theta": torch.zeros(3, dtype=F64, requires_grad=True)}
    opts = [torch.optim.SGD(list(x.values()), lr=1.0, momentum=0.8) for x in (outer, inner)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.2 / (10.0 + 0.3 * (k + 1)))
              for o in opts]
    history = bilevel.fit(PROBLEM, solver, outer, inner, steps=300, progress=False,
                          outer_optimizer=opts[0], inner_optimizer=opts[1],
                          callback=lambda k, r: [s.step() for s in scheds] and None)
    assert history.last["penalty"] == pytest.approx(10.0 + 0.3 * 299)
    assert 0.005 < rel(outer["a"].detach(), ALPHA_STAR) < 0.02


def test_the_penalized_minimizers_approach_the_bilevel_solution_like_one_over_the_penalty():
    errors = [rel(penalized_minimizer(lam)[0], ALPHA_STAR) for lam in (10.0, 100.0, 1000.0)]
    for big, small in zip(errors, errors[1:]):
        assert 8 < big / small < 12


@pytest.mark.slow
def test_bome_converges_to_the_bilevel_solution():
    # BOME's λ only grows as far as the descent condition needs (here to ≈ 20), so like a
    # penalty method it approaches the solution slowly: 0.8 % after 600 steps with the
    # value-gap control φ = 50 q̂ (the grad-norm control η = 0.5 is at 2 % by then).
    solver = bilevel.BOME(8, 0.5, phi="value_gap", c=50.0)
    a, theta, history = run(solver, steps=600, lr_outer=0.05, lr_inner=0.05)
    assert rel(a, ALPHA_STAR) < 1.5e-2 and rel(theta, THETA_STAR) < 1.5e-2
    assert history.last["q"] < 2e-3


def test_fd_converges_to_the_darts_fixed_point():
    beta = 0.5
    M = B.T @ C.T  # ∂/∂θ of f's residual, pulled back through one step: βBᵀCᵀ
    a_fd = -torch.linalg.solve(RHO * torch.eye(2, dtype=F64) + beta * M @ J, beta * M @ R)
    a, theta, _ = run(bilevel.FD(1, beta), steps=400, lr_outer=0.3, lr_inner=0.5)
    assert rel(a, a_fd) < 1e-8
    assert rel(theta, AINV @ (B @ a + c)) < 1e-8
    assert 0.15 < rel(a_fd, ALPHA_STAR) < 0.2  # one differentiated step: 18 % off the solution


def test_fd_converges_to_the_bilevel_solution_when_one_step_solves_the_lower_level():
    # A = 2I and β = 1/2: θ − β∇_θ g = θ*(α) from any θ, so the one-step hypergradient is
    # exact and DARTS' fixed point is the bilevel solution.
    def lower(o, i, batch):
        th = i["theta"]
        return th @ th - th @ (B @ o["a"] + c)

    problem = bilevel.Problem(upper=PROBLEM.upper, lower=lower)
    Jiso = C @ B / 2
    a_star = -torch.linalg.solve(Jiso.T @ Jiso + RHO * torch.eye(2, dtype=F64), Jiso.T @ (C @ c / 2 - p))
    a, theta, _ = run(bilevel.FD(1, 0.5), steps=300, lr_outer=0.3, lr_inner=0.5, problem=problem)
    assert rel(a, a_star) < 1e-8 and rel(theta, (B @ a_star + c) / 2) < 1e-8


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: bilevel.SOBA(v_lr=0.0), "SOBA: v_lr must be a finite number > 0"),
        (lambda: bilevel.F2SA(0, 0.1), "F2SA: inner_steps must be >= 1"),
        (lambda: bilevel.F2SA(2, 0.1, lam=-1.0), "F2SA: lam must be a finite number > 0"),
        (lambda: bilevel.F2SA(2, 0.1, lam_growth=-1.0), "F2SA: lam_growth must be a finite number >= 0"),
        (lambda: bilevel.F2SA(2, 0.1, lam=10.0, lam_max=5.0), "F2SA: lam_max=5.0 is below lam=10.0"),
        (lambda: bilevel.F2SA(2, 0.1, warm_start=1), "F2SA: warm_start must be a bool"),
        (lambda: bilevel.VPBGD(2, 0.1, gamma=0.0), "VPBGD: gamma must be a finite number > 0"),
        (lambda: bilevel.VPBGD(2, 0.1, gamma_max=float("nan")), "VPBGD: gamma_max must be a number"),
        (lambda: bilevel.VPBGD(0, 0.1), "VPBGD: inner_steps must be >= 1"),
    ],
)
def test_new_solver_options_are_checked_at_construction(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


# --- one step against its closed form ---------------------------------------------------------
def _point(seed):
    gen = torch.Generator().manual_seed(seed)
    a = {"a": torch.randn(2, generator=gen, dtype=F64)}
    t = {"theta": torch.randn(3, generator=gen, dtype=F64)}
    return a, t


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**16))
def test_soba_steps_match_their_closed_form_and_warm_start_v(seed):
    # ∇_θ g = Aθ − Bα − c, ∇²_θθ g = A, ∇²_αθ g · v = −Bᵀv, ∇_θ f = Cᵀ(Cθ − p)
    a, t = _point(seed)
    alpha, theta = a["a"], t["theta"]
    solver, rho_v = bilevel.SOBA(v_lr=0.3), 0.3
    f_theta = C.T @ (C @ theta - p)
    v = torch.zeros(3, dtype=F64)
    for _ in range(3):  # v evolves inside the instance; (α, θ) held fixed here
        r = solver.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
        assert torch.allclose(r.outer_grad["a"], RHO * alpha - B.T @ v, rtol=1e-12, atol=1e-14)
        assert torch.allclose(r.inner_grad["theta"], A @ theta - B @ alpha - c, rtol=1e-12)
        assert r.info["v_residual_norm"] == pytest.approx(float((A @ v + f_theta).norm()), rel=1e-12)
        v = v - rho_v * (A @ v + f_theta)
    assert r.inner_solution is None
    solver.reset()
    r = solver.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
    assert torch.allclose(r.outer_grad["a"], RHO * alpha, rtol=1e-12)  # v = 0 again


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**16))
def test_vpbgd_direction_is_grad_f_plus_gamma_grad_q_and_gamma_follows_its_schedule(seed):
    a, t = _point(seed)
    T, beta = 4, 0.3
    solver = bilevel.VPBGD(T, beta, gamma=2.0, gamma_growth=0.5, gamma_max=2.6)
    bome = bilevel.BOME(T, beta)  # same q̂ terms; its info reports ∇f and ∇q̂ norms
    for k, gamma in enumerate([2.0, 2.5, 2.6, 2.6]):
        r = solver.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
        assert r.info["penalty"] == gamma, k
    solver.reset()
    r = solver.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
    assert r.info["penalty"] == 2.0
    # closed form: θ^(T) = θ* + (I − βA)^T (θ − θ*); ∇q̂ = (−Bᵀ(θ − θ^(T)), Aθ − Bα − c)
    alpha, theta = a["a"], t["theta"]
    ts = AINV @ (B @ alpha + c)
    tT = ts + torch.linalg.matrix_power(torch.eye(3, dtype=F64) - beta * A, T) @ (theta - ts)
    dq_a, dq_t = -B.T @ (theta - tT), A @ theta - B @ alpha - c
    df_a, df_t = RHO * alpha, C.T @ (C @ theta - p)
    assert torch.allclose(r.outer_grad["a"], df_a + 2.0 * dq_a, rtol=1e-12)
    assert torch.allclose(r.inner_grad["theta"], df_t + 2.0 * dq_t, rtol=1e-12)
    assert torch.allclose(r.inner_solution["theta"], tT, rtol=1e-12)
    q = bome.step(PROBLEM, a, t, upper_batch=None, lower_batch=None).info["q"]
    assert r.info["q"] == pytest.approx(q, rel=1e-12)
    assert r.info["penalized_loss"] == pytest.approx(r.info["upper_loss_current"] + 2.0 * q, rel=1e-12)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**16))
def test_f2sa_step_matches_its_closed_form_and_keeps_y_between_steps(seed):
    a, t = _point(seed)
    alpha, theta = a["a"], t["theta"]
    T, beta, lam = 3, 0.2, 4.0
    eye = torch.eye(3, dtype=F64)
    ts = AINV @ (B @ alpha + c)
    zT = ts + torch.linalg.matrix_power(eye - beta * A, T) @ (theta - ts)

    def y_steps(y):  # y ← y − β(Cᵀ(Cy − p)/λ + Ay − Bα − c)
        for _ in range(T):
            y = y - beta * (C.T @ (C @ y - p) / lam + A @ y - B @ alpha - c)
        return y

    def direction(y):  # ∇_α f(y) + λ(∇_α g(y) − ∇_α g(z_T)) = ρα − λBᵀ(y − z_T)
        return RHO * alpha - lam * B.T @ (y - zT)

    warm, cold = bilevel.F2SA(T, beta, lam=lam), bilevel.F2SA(T, beta, lam=lam, warm_start=False)
    y1 = y_steps(theta)
    for solver in (warm, cold):
        r = solver.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
        assert torch.allclose(r.outer_grad["a"], direction(y1), rtol=1e-12)
        assert torch.allclose(r.inner_solution["theta"], zT, rtol=1e-12)
        assert torch.allclose(r.inner_grad["theta"], A @ theta - B @ alpha - c, rtol=1e-12)
    # the second step: warm continues y from y_T, cold restarts it at θ
    y2 = y_steps(y1)
    r = warm.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
    assert torch.allclose(r.outer_grad["a"], direction(y2), rtol=1e-12)
    r = cold.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
    assert torch.allclose(r.outer_grad["a"], direction(y1), rtol=1e-12)
    warm.reset()
    r = warm.step(PROBLEM, a, t, upper_batch=None, lower_batch=None)
    assert torch.allclose(r.outer_grad["a"], direction(y1), rtol=1e-12)


@pytest.mark.parametrize(
    "solver, lower_calls, upper_calls",
    [
        # BOME's floor: T steps + g at θ^(T); f, and f's forward at θ^(T) for upper_loss
        (bilevel.VPBGD(4, 0.1), 4 + 1, 1 + 1),
        # z: T; y: T of f + g; then g at y_T, z_T; f at y_T, and at z_T for upper_loss
        (bilevel.F2SA(4, 0.1), 4 + 4 + 2, 4 + 1 + 1),
        (bilevel.SOBA(0.1), 1, 1),  # one g (double backward) and one f per step
        # T steps + the two perturbed gradients + ∇_θ g at θ^(T) for lower_grad_norm
        (bilevel.FD(4, 0.1), 4 + 2 + 1, 1),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, int) else str(x),
)
def test_objective_calls_per_step_are_the_documented_cost(solver, lower_calls, upper_calls):
    calls = {"lower": 0, "upper": 0}

    def lower(o, i, b):
        calls["lower"] += 1
        return PROBLEM.lower(o, i, b)

    def upper(o, i, b):
        calls["upper"] += 1
        return PROBLEM.upper(o, i, b)

    a, t = _point(3)
    solver.step(bilevel.Problem(upper=upper, lower=lower), a, t, upper_batch=None, lower_batch=None)
    assert calls == {"lower": lower_calls, "upper": upper_calls}
