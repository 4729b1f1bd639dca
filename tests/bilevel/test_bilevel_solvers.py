"""The solvers BOME, ITD and AID: closed-form directions, convergence on the official toy
problems, and BOME's cost floor counted call by call."""

import math

import pytest
import torch

import bilevel
from bilevel import linalg

F64 = torch.float64


# --- the lower-level-singleton toy of the BOME paper -------------------------------------
# f = ½(α − θ₁)² + ½(θ₀ − 1)²,  g = ½θ₀² − αθ₀.  θ₀*(α) = α, so F(α) = min_θ₁ ½(α − θ₁)² +
# ½(α − 1)², minimized at α = 1 with θ = (1, 1).
def toy_upper(o, i, batch):
    return 0.5 * (o["a"] - i["t"][1]) ** 2 + 0.5 * (i["t"][0] - 1) ** 2


def toy_lower(o, i, batch):
    return 0.5 * i["t"][0] ** 2 - o["a"] * i["t"][0]


TOY = bilevel.Problem(upper=toy_upper, lower=toy_lower)


def leaves(a, t):
    return (
        {"a": torch.tensor(a, dtype=F64, requires_grad=True)},
        {"t": torch.tensor(t, dtype=F64, requires_grad=True)},
    )


@pytest.mark.parametrize("phi", ["grad_norm", "value_gap"])
def test_bome_direction_matches_closed_form_on_the_toy(phi):
    a, t0, t1, T, beta, eta, c, eps = 2.0, -0.7, 0.4, 7, 0.3, 0.5, 0.9, 1e-8
    outer, inner = leaves(a, [t0, t1])
    solver = bilevel.BOME(T, beta, eta=eta, phi=phi, c=c, eps=eps)
    r = solver.step(TOY, outer, inner, upper_batch=None, lower_batch=None)
    # Closed form: GD on θ₀ contracts towards α by (1 − β) per step; θ₁ is untouched.
    tT0 = a + (1 - beta) ** T * (t0 - a)
    q = (0.5 * t0**2 - a * t0) - (0.5 * tT0**2 - a * tT0)
    dq = [-t0 + tT0, t0 - a, 0.0]  # (∂_α, ∂_θ₀, ∂_θ₁)
    df = [a - t1, t0 - 1, t1 - a]
    dq_sq = sum(x * x for x in dq)
    phi_val = eta * dq_sq if phi == "grad_norm" else c * q
    lam = max((phi_val - sum(x * y for x, y in zip(df, dq))) / (dq_sq + eps), 0.0)
    assert r.info["q"] == pytest.approx(q, rel=1e-12)
    assert r.info["lambda"] == pytest.approx(lam, rel=1e-12)
    assert r.info["phi"] == pytest.approx(phi_val, rel=1e-12)
    assert r.info["upper_loss_current"] == pytest.approx(0.5 * (a - t1) ** 2 + 0.5 * (t0 - 1) ** 2)
    assert r.info["upper_loss"] == pytest.approx(0.5 * (a - t1) ** 2 + 0.5 * (tT0 - 1) ** 2)  # θ^(T)
    assert r.info["lower_loss"] == pytest.approx(0.5 * t0**2 - a * t0)
    assert r.outer_grad["a"].item() == pytest.approx(df[0] + lam * dq[0], rel=1e-12)
    expected_inner = torch.tensor([df[1] + lam * dq[1], df[2] + lam * dq[2]], dtype=F64)
    assert torch.allclose(r.inner_grad["t"], expected_inner, rtol=1e-12)
    assert torch.allclose(r.inner_solution["t"], torch.tensor([tT0, t1], dtype=F64), rtol=1e-12)
    assert not r.outer_grad["a"].requires_grad and not r.inner_grad["t"].requires_grad
    # the products split into the α block and the θ block
    assert r.info["upper_q_dot_outer"] == pytest.approx(df[0] * dq[0], rel=1e-12)
    assert r.info["upper_q_dot_inner"] == pytest.approx(df[1] * dq[1] + df[2] * dq[2], rel=1e-12)
    assert r.info["q_grad_norm_outer"] == pytest.approx(abs(dq[0]), rel=1e-12)
    assert r.info["upper_grad_norm_inner"] == pytest.approx((df[1] ** 2 + df[2] ** 2) ** 0.5, rel=1e-12)
    cos = sum(x * y for x, y in zip(df, dq)) / (dq_sq**0.5 * sum(x * x for x in df) ** 0.5)
    assert r.info["cos"] == pytest.approx(cos, rel=1e-10)
    assert r.info["cos_outer"] == pytest.approx(1.0 if df[0] * dq[0] > 0 else -1.0, rel=1e-10)


def _run(problem, solver, outer, inner, steps, lr):
    opt_o = torch.optim.SGD(list(outer.values()), lr=lr)
    opt_i = torch.optim.SGD(list(inner.values()), lr=lr)
    return bilevel.fit(
        problem,
        solver,
        outer,
        inner,
        steps=steps,
        outer_optimizer=opt_o,
        inner_optimizer=opt_i,
        progress=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("phi", ["grad_norm", "value_gap"])
def test_bome_solves_the_singleton_toy(phi):
    outer, inner = leaves(3.0, [-2.0, 0.5])
    _run(TOY, bilevel.BOME(10, 0.5, eta=0.5, phi=phi), outer, inner, steps=500, lr=0.1)
    assert outer["a"].item() == pytest.approx(1.0, abs=1e-3)
    assert torch.allclose(inner["t"].detach(), torch.ones(2, dtype=F64), atol=1e-3)


@pytest.mark.slow
def test_bome_solves_a_lower_level_with_many_minimizers():
    # g = ½(θ₀ + θ₁ − α)² is minimized by the whole line θ₀ + θ₁ = α: its Hessian
    # [[1, 1], [1, 1]] is singular, so θ*(α) and implicit differentiation are undefined.
    # f = ½(θ₀ − 1)² + ½(θ₁ − 2)² + ½α². The bilevel problem (optimistic: min over α and
    # over the lower-level minimizers) is min ½(θ₀ − 1)² + ½(θ₁ − 2)² + ½(θ₀ + θ₁)²;
    # stationarity gives θ₀ = 1 − s, θ₁ = 2 − s with s = θ₀ + θ₁ = 3 − 2s, so s = 1:
    # the unique answer is θ = (0, 1), α = 1, with f = 3/2.
    def upper(o, i, batch):
        t = i["t"]
        return 0.5 * (t[0] - 1) ** 2 + 0.5 * (t[1] - 2) ** 2 + 0.5 * o["a"] ** 2

    def lower(o, i, batch):
        t = i["t"]
        return 0.5 * (t[0] + t[1] - o["a"]) ** 2

    problem = bilevel.Problem(upper=upper, lower=lower)
    outer, inner = leaves(3.0, [-2.0, 0.5])
    history = _run(problem, bilevel.BOME(10, 0.3), outer, inner, steps=1000, lr=0.1)
    assert outer["a"].item() == pytest.approx(1.0, abs=3e-3)
    assert torch.allclose(inner["t"].detach(), torch.tensor([0.0, 1.0], dtype=F64), atol=3e-3)
    assert history.last["upper_loss"] == pytest.approx(1.5, abs=3e-3)
    assert history.last["q"] < 1e-4  # θ is (nearly) a lower-level minimizer


class CountNetworkBackward(torch.autograd.Function):
    """Identity whose backward counts passes through "the network"."""

    count = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CountNetworkBackward.count += 1
        return grad


@pytest.mark.parametrize("T", [1, 4])
def test_bome_cost_floor_is_T_lower_passes_plus_one_upper_pass_plus_one_forward(T):
    # α acts on the logits only, as in CALM. "frozen" stands for the model's own weights,
    # which keep requires_grad=True: BOME must neither back-propagate through the network
    # for ∇_α g(α, θ^(T)) nor write .grad into them.
    gen = torch.Generator().manual_seed(0)
    frozen = torch.randn(5, 3, generator=gen, dtype=F64, requires_grad=True)
    x, y = torch.randn(8, 5, generator=gen, dtype=F64), torch.randint(0, 3, (8,), generator=gen)
    calls = {"lower": 0, "upper": 0}

    def logits(o, i):
        h = CountNetworkBackward.apply(x @ frozen + x @ i["lora"])  # the network
        return h / o["log_tau"].exp() + o["shift"]  # α on the logits

    def lower(o, i, batch):
        calls["lower"] += 1
        return torch.nn.functional.cross_entropy(logits(o, i), y)

    def upper(o, i, batch):
        calls["upper"] += 1
        p = torch.softmax(logits(o, i), -1)
        return (p * p.log()).sum(-1).mean()

    outer = {"log_tau": torch.zeros(3, dtype=F64), "shift": torch.zeros(3, dtype=F64)}
    inner = {"lora": 0.1 * torch.randn(5, 3, generator=gen, dtype=F64)}
    CountNetworkBackward.count = 0
    bilevel.BOME(T, 0.1).step(
        bilevel.Problem(upper=upper, lower=lower), outer, inner, upper_batch=None, lower_batch=None
    )
    # T forward-backward + 1 forward on lower; f's forward-backward + its forward at θ^(T)
    # (info's upper_loss, no backward)
    assert calls == {"lower": T + 1, "upper": 2}
    assert CountNetworkBackward.count == T + 1  # T lower backward passes + 1 upper
    assert frozen.grad is None


def quadratic(seed=0, d=4, m=2):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=F64))
    A = (q * torch.linspace(1.0, 4.0, d, dtype=F64)) @ q.T
    B = torch.randn(d, m, generator=gen, dtype=F64)
    p = torch.randn(d, generator=gen, dtype=F64)

    def lower(o, i, batch):
        return 0.5 * i @ A @ i - i @ (B @ o)

    def upper(o, i, batch):
        return 0.5 * ((i - p) ** 2).sum()

    alpha = torch.randn(m, generator=gen, dtype=F64)
    exact = B.T @ torch.linalg.solve(A, torch.linalg.solve(A, B @ alpha) - p)
    return bilevel.Problem(upper=upper, lower=lower), alpha, A, B, exact


def test_itd_step_is_the_unrolled_hypergradient_and_a_warm_started_inner_step():
    problem, alpha, A, B, _ = quadratic()
    theta0 = torch.ones(4, dtype=F64)
    T, beta = 6, 0.2
    r = bilevel.ITD(T, beta).step(problem, alpha, theta0, upper_batch=None, lower_batch=None)
    h = bilevel.hypergrad(
        problem, alpha, theta0, upper_batch=None, lower_batch=None, method=bilevel.Unrolled(T, beta)
    )
    assert torch.equal(r.outer_grad, h)
    assert torch.allclose(r.inner_grad, A @ theta0 - B @ alpha, rtol=1e-13)
    M = torch.eye(4, dtype=F64) - beta * A
    star = torch.linalg.solve(A, B @ alpha)
    MT = torch.linalg.matrix_power(M, T)
    assert torch.allclose(r.inner_solution, MT @ theta0 + (torch.eye(4, dtype=F64) - MT) @ star)
    assert set(r.info) >= {"upper_loss", "lower_loss"}


@pytest.mark.parametrize("solver", [linalg.CG(maxiter=20, tol=1e-14), linalg.Dense()])
def test_aid_converges_to_the_exact_hypergradient(solver):
    problem, alpha, A, B, exact = quadratic()
    theta0 = torch.zeros(4, dtype=F64)
    errs = []
    for T in (5, 20, 120):
        r = bilevel.AID(T, 0.4, linear_solver=solver).step(
            problem, alpha, theta0, upper_batch=None, lower_batch=None
        )
        errs.append(float((r.outer_grad - exact).norm()))
        assert torch.allclose(r.inner_grad, A @ theta0 - B @ alpha)
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-10
    # AID with inner_steps = 0 takes θ as given; at θ* it is exact.
    star = torch.linalg.solve(A, B @ alpha)
    r = bilevel.AID(0, 0.4, linear_solver=solver).step(
        problem, alpha, star, upper_batch=None, lower_batch=None
    )
    assert torch.allclose(r.outer_grad, exact, rtol=1e-10)
    assert torch.allclose(r.inner_solution, star) and r.inner_solution.data_ptr() != star.data_ptr()
    assert math.isfinite(r.info["solver_iterations"])


def test_bome_keeps_each_leaf_dtype():
    # bf16 inner (as LoRA adapters often are), float32 outer.
    def lower(o, i, b):
        return 0.5 * (i["t"].float() ** 2).sum() - o["a"] * i["t"].float().sum()

    def upper(o, i, b):
        return ((i["t"].float() - 1) ** 2).sum() + o["a"] ** 2

    outer = {"a": torch.tensor(0.5)}
    inner = {"t": torch.zeros(8, dtype=torch.bfloat16)}
    r = bilevel.BOME(3, 0.5).step(
        bilevel.Problem(upper=upper, lower=lower), outer, inner, upper_batch=None, lower_batch=None
    )
    assert r.outer_grad["a"].dtype == torch.float32
    assert r.inner_grad["t"].dtype == torch.bfloat16
    assert r.inner_solution["t"].dtype == torch.bfloat16
    assert math.isfinite(r.info["lambda"])


def test_bome_direction_is_finite_at_a_lower_level_solution():
    # θ = θ* of g and ∇_α g ≡ 0: ∇q̂ = 0, so λ = max(0 / ε, 0) = 0 and the direction is ∇f.
    problem = bilevel.Problem(
        upper=lambda o, i, b: ((i["t"] - 1) ** 2).sum() + o["a"] ** 2,
        lower=lambda o, i, b: 0.5 * (i["t"] ** 2).sum(),
    )
    outer, inner = {"a": torch.tensor(1.0, dtype=F64)}, {"t": torch.zeros(2, dtype=F64)}
    r = bilevel.BOME(3, 0.5).step(problem, outer, inner, upper_batch=None, lower_batch=None)
    assert r.info["lambda"] == 0.0 and r.info["q"] == 0.0
    assert r.outer_grad["a"].item() == 2.0
    assert torch.equal(r.inner_grad["t"], torch.full((2,), -2.0, dtype=F64))


# -- AID warm-starts the linear solve with the previous step's v --------------------------------
def _aid_run(warm_start, steps=8):
    problem, alpha, A, B, _ = quadratic(seed=3, d=40, m=2)
    outer = alpha.clone().requires_grad_()
    inner = torch.zeros(40, dtype=F64, requires_grad=True)
    aid = bilevel.AID(10, 0.3, linear_solver=linalg.CG(maxiter=50, tol=1e-10), warm_start=warm_start)
    grads = []
    history = bilevel.fit(
        problem, aid, outer, inner, steps=steps, progress=False, inner_update="solution",
        outer_optimizer=torch.optim.SGD([outer], lr=0.05),
        callback=lambda k, r: grads.append(r.outer_grad.clone()),
    )
    return aid, grads, history.column("solver_iterations")


def test_aid_warm_start_saves_cg_iterations_and_keeps_the_hypergradient():
    _, cold_grads, cold_iters = _aid_run(False)
    aid, warm_grads, warm_iters = _aid_run(True)
    assert warm_iters[0] == cold_iters[0]  # nothing to start from at the first step
    assert sum(warm_iters[1:]) < sum(cold_iters[1:])
    for c, w in zip(cold_grads, warm_grads):
        assert torch.allclose(w, c, rtol=1e-8, atol=1e-10)
    # reset: the next solve starts from zero again, as a fresh solver's does
    problem, alpha, _, _, _ = quadratic(seed=3, d=40, m=2)
    aid.reset()
    r = aid.step(problem, alpha, torch.zeros(40, dtype=F64), upper_batch=None, lower_batch=None)
    assert r.info["solver_iterations"] == cold_iters[0]


def test_aid_warm_start_is_off_by_default_and_checked():
    assert bilevel.AID(3, 0.1).warm_start is False
    with pytest.raises(TypeError, match="AID: warm_start must be a bool"):
        bilevel.AID(3, 0.1, warm_start="yes")
