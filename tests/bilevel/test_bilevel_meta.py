"""The meta-learning solvers MAML, FOMAML, Reptile and iMAML against their closed forms on
quadratic tasks, a dense float64 solve and float64 finite differences; the problem helper
and the errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bilevel
from bilevel import linalg

F64 = torch.float64
SETTINGS = settings(max_examples=12, deadline=None)


# --- quadratic tasks: L_b(θ; (A, c)) = ½ (θ − c)ᵀ A (θ − c), A symmetric positive definite ---
def quad_loss(params, batch):
    r = params["w"] - batch["c"]
    return 0.5 * torch.einsum("...i,...ij,...j->...", r, batch["A"], r)


def spd(tasks, d, gen):
    m = torch.randn(tasks, d, d, generator=gen, dtype=F64)
    return m @ m.transpose(1, 2) / d + 0.5 * torch.eye(d, dtype=F64)


def quad_tasks(tasks, d, seed):
    """α, θ buffer, support batch (A, c) and query batch (Q, e) for ``tasks`` tasks."""
    gen = torch.Generator().manual_seed(seed)
    support = {"A": spd(tasks, d, gen), "c": torch.randn(tasks, d, generator=gen, dtype=F64)}
    query = {"A": spd(tasks, d, gen), "c": torch.randn(tasks, d, generator=gen, dtype=F64)}
    alpha = {"w": torch.randn(d, generator=gen, dtype=F64, requires_grad=True)}
    return alpha, bilevel.task_copies(alpha, tasks), support, query


def inner_closed_form(alpha, support, T, beta, lam):
    """θ_T and J = dθ_T/dα per task for GD on ½(θ−c)ᵀA(θ−c) + (λ/2)‖θ−α‖² from θ_0 = α:
    θ ← (I − β(A + λI)) θ + β(Ac + λα), so J ← (I − β(A + λI)) J + βλ I, J_0 = I."""
    A, c = support["A"], support["c"]
    eye = torch.eye(A.shape[-1], dtype=F64)
    step = eye - beta * (A + lam * eye)
    theta = alpha.expand_as(c).clone()
    J = eye.expand_as(A).clone()
    for _ in range(T):
        theta = torch.einsum("bij,bj->bi", step, theta) + beta * (
            torch.einsum("bij,bj->bi", A, c) + lam * alpha
        )
        J = step @ J + beta * lam * eye
    return theta, J


def query_grads(theta, query):
    """∇L_b(θ_b; query) = Q_b (θ_b − e_b)."""
    return torch.einsum("bij,bj->bi", query["A"], theta - query["c"])


def run(solver, prox, alpha, inner, support, query):
    problem = bilevel.meta_problem(quad_loss, prox=prox)
    return solver.step(problem, alpha, inner, upper_batch=query, lower_batch=support)


@SETTINGS
@given(
    d=st.integers(1, 5),
    tasks=st.integers(1, 4),
    T=st.integers(1, 6),
    lam=st.sampled_from([0.0, 0.7]),
    seed=st.integers(0, 10**6),
)
def test_maml_meta_gradient_is_the_closed_form_on_quadratic_tasks(d, tasks, T, lam, seed):
    alpha, inner, support, query = quad_tasks(tasks, d, seed)
    beta = 0.3
    r = run(bilevel.MAML(T, beta), lam, alpha, inner, support, query)
    theta, J = inner_closed_form(alpha["w"].detach(), support, T, beta, lam)
    # dF/dα = (1/B) Σ_b J_bᵀ Q_b (θ_{b,T} − e_b)
    expected = torch.einsum("bji,bj->i", J, query_grads(theta, query)) / tasks
    torch.testing.assert_close(r.outer_grad["w"], expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r.inner_solution["w"], theta, rtol=1e-10, atol=1e-12)
    assert r.info["upper_loss"] == pytest.approx(
        float(quad_loss({"w": theta}, query).mean()), rel=1e-10
    )


@SETTINGS
@given(d=st.integers(1, 5), tasks=st.integers(1, 4), T=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_fomaml_and_reptile_follow_their_definitions(d, tasks, T, seed):
    alpha, inner, support, query = quad_tasks(tasks, d, seed)
    beta = 0.3
    theta, _ = inner_closed_form(alpha["w"].detach(), support, T, beta, 0.0)
    fo = run(bilevel.FOMAML(T, beta), 0.0, alpha, inner, support, query)
    # FOMAML: the mean over tasks of the query gradient at the adapted parameters.
    torch.testing.assert_close(fo.outer_grad["w"], query_grads(theta, query).mean(0))
    rep = run(bilevel.Reptile(T, beta), 0.0, alpha, inner, support, query)
    # Reptile: α − mean_b θ_{b,T}, so SGD with step ε moves α by ε(mean θ_T − α).
    torch.testing.assert_close(rep.outer_grad["w"], alpha["w"].detach() - theta.mean(0))
    for r in (fo, rep):
        torch.testing.assert_close(r.inner_solution["w"], theta)
        # inner_grad is ∇_θ g at θ_0 = α for every task
        grad0 = torch.einsum("bij,bj->bi", support["A"], alpha["w"].detach() - support["c"])
        torch.testing.assert_close(r.inner_grad["w"], grad0)


@SETTINGS
@given(
    d=st.integers(1, 5),
    tasks=st.integers(1, 4),
    T=st.integers(1, 8),
    lam=st.floats(0.2, 3.0),
    seed=st.integers(0, 10**6),
)
def test_imaml_meta_gradient_is_the_dense_float64_solve_at_theta_T(d, tasks, T, lam, seed):
    alpha, inner, support, query = quad_tasks(tasks, d, seed)
    beta = 0.1
    solver = bilevel.IMAML(T, beta, linalg.CG(maxiter=50, tol=1e-13))
    r = run(solver, lam, alpha, inner, support, query)
    theta, _ = inner_closed_form(alpha["w"].detach(), support, T, beta, lam)
    # The paper's (1/B) Σ_b (I + A_b/λ)⁻¹ ∇L_b(θ_{b,T}; query), by a dense LU solve.
    eye = torch.eye(d, dtype=F64)
    per_task = torch.linalg.solve(eye + support["A"] / lam, query_grads(theta, query))
    torch.testing.assert_close(r.outer_grad["w"], per_task.mean(0), rtol=1e-8, atol=1e-10)
    dense = run(bilevel.IMAML(T, beta, linalg.Dense()), lam, alpha, inner, support, query)
    torch.testing.assert_close(dense.outer_grad["w"], per_task.mean(0), rtol=1e-10, atol=1e-12)


def test_imaml_with_a_solved_inner_problem_is_the_exact_hypergradient():
    """θ*(α) = (A + λI)⁻¹(Ac + λα), so dF/dα = (1/B) Σ_b λ (A_b + λI)⁻¹ Q_b (θ*_b − e_b);
    MAML with many steps converges to the same number (the finite-T derivative tends to the
    implicit one as θ_T → θ*)."""
    alpha, inner, support, query = quad_tasks(3, 4, seed=0)
    lam, eye = 1.5, torch.eye(4, dtype=F64)
    A, c, a = support["A"], support["c"], alpha["w"].detach()
    theta_star = torch.linalg.solve(A + lam * eye, torch.einsum("bij,bj->bi", A, c) + lam * a)
    exact = (lam * torch.linalg.solve(A + lam * eye, query_grads(theta_star, query))).mean(0)
    imaml = run(bilevel.IMAML(400, 0.2, linalg.CG(tol=1e-14)), lam, alpha, inner, support, query)
    torch.testing.assert_close(imaml.outer_grad["w"], exact, rtol=1e-9, atol=1e-11)
    maml = run(bilevel.MAML(400, 0.2), lam, alpha, inner, support, query)
    torch.testing.assert_close(maml.outer_grad["w"], exact, rtol=1e-8, atol=1e-10)


# --- a nonlinear task (a tanh regression), against float64 finite differences -----------
def tanh_loss(params, batch):
    pred = torch.tanh(batch["x"] @ params["w"].unsqueeze(-1)).squeeze(-1) + params["b"].unsqueeze(-1)
    return 0.5 * ((pred - batch["y"]) ** 2).mean(-1)


def tanh_tasks(tasks, n, d, seed):
    gen = torch.Generator().manual_seed(seed)

    def batch():
        return {
            "x": torch.randn(tasks, n, d, generator=gen, dtype=F64),
            "y": torch.randn(tasks, n, generator=gen, dtype=F64),
        }

    alpha = {
        "w": torch.randn(d, generator=gen, dtype=F64, requires_grad=True),
        "b": torch.randn((), generator=gen, dtype=F64, requires_grad=True),
    }
    return alpha, batch(), batch()


def meta_objective(alpha, support, query, T, beta, lam):
    """F(α) by a plain loop: T steps of GD on the proximal support loss from θ_0 = α."""
    problem = bilevel.meta_problem(tanh_loss, prox=lam)
    tasks = support["y"].shape[0]
    theta = {k: v.expand(tasks, *v.shape).clone().requires_grad_(True) for k, v in alpha.items()}
    for _ in range(T):
        g = problem.lower(alpha, theta, support)
        grads = torch.autograd.grad(g, list(theta.values()))
        theta = {
            k: (v - beta * gr).detach().requires_grad_(True)
            for (k, v), gr in zip(theta.items(), grads)
        }
    return float(problem.upper(alpha, theta, query).detach())


@settings(max_examples=6, deadline=None)
@given(T=st.integers(1, 4), lam=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 10**6))
def test_maml_matches_central_finite_differences_on_a_nonlinear_task(T, lam, seed):
    alpha, support, query = tanh_tasks(tasks=3, n=6, d=3, seed=seed)
    beta, h = 0.4, 1e-6
    problem = bilevel.meta_problem(tanh_loss, prox=lam)
    r = bilevel.MAML(T, beta).step(
        problem, alpha, bilevel.task_copies(alpha, 3), upper_batch=query, lower_batch=support
    )
    base = {k: v.detach() for k, v in alpha.items()}
    for key in ("w", "b"):
        flat = base[key].reshape(-1)
        fd = torch.zeros_like(flat)
        for i in range(flat.numel()):
            e = torch.zeros_like(flat)
            e[i] = h
            plus = {**base, key: (flat + e).reshape(base[key].shape)}
            minus = {**base, key: (flat - e).reshape(base[key].shape)}
            diff = meta_objective(plus, support, query, T, beta, lam)
            diff -= meta_objective(minus, support, query, T, beta, lam)
            fd[i] = diff / (2 * h)
        torch.testing.assert_close(r.outer_grad[key].reshape(-1), fd, rtol=1e-6, atol=1e-8)


def test_one_task_without_a_task_dimension_equals_a_batch_of_one():
    alpha, inner, support, query = quad_tasks(1, 3, seed=4)
    single = {k: v[0] for k, v in support.items()}, {k: v[0] for k, v in query.items()}
    for solver in (bilevel.MAML(3, 0.2), bilevel.FOMAML(3, 0.2), bilevel.Reptile(3, 0.2)):
        batched = run(solver, 0.0, alpha, inner, support, query)
        alone = run(solver, 0.0, alpha, bilevel.task_copies(alpha, None), *single)
        torch.testing.assert_close(alone.outer_grad["w"], batched.outer_grad["w"])
        assert alone.inner_solution["w"].shape == (3,)


def test_fit_trains_an_initialization_that_adapts_better():
    """MAML and iMAML in bilevel.fit, the same loop as every solver: the post-adaptation
    query loss on the (fixed) tasks falls."""
    alpha, inner, support, query = quad_tasks(4, 3, seed=1)
    for solver, lam in ((bilevel.MAML(2, 0.2), 0.0), (bilevel.IMAML(20, 0.2), 1.0)):
        a = {"w": alpha["w"].detach().clone().requires_grad_(True)}
        history = bilevel.fit(
            bilevel.meta_problem(quad_loss, prox=lam),
            solver,
            a,
            bilevel.task_copies(a, 4),
            steps=40,
            outer_optimizer=torch.optim.SGD([a["w"]], lr=0.2),
            upper_batch=query,
            lower_batch=support,
            inner_update="solution",
            progress=False,
        )
        losses = history.column("upper_loss")
        assert losses[-1] < 0.8 * losses[0], (type(solver).__name__, losses[0], losses[-1])


def test_meta_problem_terms():
    alpha, inner, support, query = quad_tasks(2, 3, seed=2)
    problem = bilevel.meta_problem(quad_loss, prox=2.0)
    inner["w"] += 1.0
    per_task = quad_loss(inner, support)
    expected = per_task.sum() + 0.5 * 2.0 * ((inner["w"] - alpha["w"]) ** 2).sum()
    torch.testing.assert_close(problem.lower(alpha, inner, support), expected)
    torch.testing.assert_close(problem.upper(alpha, inner, query), quad_loss(inner, query).mean())
    assert isinstance(problem, bilevel.Problem) and problem.prox == 2.0


def test_errors_name_the_value_and_the_fix():
    alpha, inner, support, query = quad_tasks(2, 3, seed=3)
    with pytest.raises(ValueError, match=r"prox=0.0.*prox=λ"):
        run(bilevel.IMAML(2, 0.1), 0.0, alpha, inner, support, query)
    with pytest.raises(ValueError, match=r"inner leaf 0 has shape \(2, 4\).*task_copies"):
        run(bilevel.MAML(2, 0.1), 0.0, alpha, {"w": torch.zeros(2, 4, dtype=F64)}, support, query)
    mixed_alpha = {"w": alpha["w"], "b": torch.zeros((), dtype=F64)}
    mixed_inner = {"w": inner["w"], "b": torch.zeros((), dtype=F64)}  # b lacks the task dim
    message = r"inner leaf 1 has shape \(\).*like inner leaf 0, .* \(\(2, 3\) for outer \(3,\)\)"
    with pytest.raises(ValueError, match=message):
        bilevel.FOMAML(1, 0.1).step(
            bilevel.meta_problem(quad_loss), mixed_alpha, mixed_inner,
            upper_batch=query, lower_batch=support,
        )
    with pytest.raises(ValueError, match="prox must be a finite number >= 0, got -1"):
        bilevel.meta_problem(quad_loss, prox=-1)
    with pytest.raises(TypeError, match="task_loss must be a callable"):
        bilevel.meta_problem(3)
    bad = bilevel.meta_problem(lambda p, b: quad_loss(p, b)[:, None])
    with pytest.raises(ValueError, match=r"shape \(B,\).*got \(2, 1\)"):
        bilevel.MAML(1, 0.1).step(bad, alpha, inner, upper_batch=query, lower_batch=support)
    for cls in (bilevel.MAML, bilevel.FOMAML, bilevel.Reptile, bilevel.IMAML):
        with pytest.raises(ValueError, match=f"{cls.__name__}: inner_steps must be >= 1, got 0"):
            cls(0, 0.1)
        with pytest.raises(ValueError, match=f"{cls.__name__}: inner_lr must be a finite"):
            cls(1, -0.1)
    with pytest.raises(ValueError, match="task_copies: tasks must be >= 1"):
        bilevel.task_copies(alpha, 0)


def test_imaml_is_aid_started_from_the_initialization():
    """Same machinery, not a separate framework: iMAML's step is AID's on the proximal problem
    with θ = α for every task; FOMAML's adapted parameters are AID's θ^(T) too."""
    alpha, inner, support, query = quad_tasks(3, 4, seed=5)
    problem = bilevel.meta_problem(quad_loss, prox=0.8)
    args = {"upper_batch": query, "lower_batch": support}
    solve = linalg.Dense()
    imaml = bilevel.IMAML(7, 0.1, solve).step(problem, alpha, inner, **args)
    aid = bilevel.AID(7, 0.1, solve).step(problem, alpha, bilevel.task_copies(alpha, 3), **args)
    torch.testing.assert_close(imaml.outer_grad["w"], aid.outer_grad["w"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(imaml.inner_solution["w"], aid.inner_solution["w"])
    # MAML ignores the values in inner; AID and ITD start from them
    moved = {"w": inner["w"] + 1.0}
    maml = bilevel.MAML(2, 0.1)
    torch.testing.assert_close(
        maml.step(problem, alpha, moved, **args).outer_grad["w"],
        maml.step(problem, alpha, inner, **args).outer_grad["w"],
    )
