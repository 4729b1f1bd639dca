"""bilevel.linalg: every solver against torch.linalg.solve in float64 (hypothesis-drawn
symmetric positive-definite systems), convergence with iterations, and the edge cases
from the peers' trackers (scalar unknowns, zero right-hand side, maxiter=0)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bilevel import linalg, tree
from bilevel.errors import ConvergenceWarning

SETTINGS = settings(max_examples=25, deadline=None)


def spd(n: int, cond: float, seed: int) -> torch.Tensor:
    """A random SPD matrix with eigenvalues spread log-uniformly in [1, cond]."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    eig = torch.logspace(0, math.log10(cond), n, dtype=torch.float64)
    return (q * eig) @ q.T


def as_tree(v: torch.Tensor, n1: int):
    """Split a vector into a dict pytree with a matrix leaf and a vector leaf."""
    return {"m": v[:n1].reshape(n1, 1), "v": [v[n1:]]}


def from_tree(t) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in tree.leaves(t)])


systems = st.tuples(st.integers(1, 12), st.floats(1.0, 50.0), st.integers(0, 2**16))


@pytest.mark.slow
@SETTINGS
@given(systems)
def test_solvers_match_dense_solve_over_pytrees(system):
    n, cond, seed = system
    a = spd(n, cond, seed)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    exact = torch.linalg.solve(a, b)
    n1 = n // 2

    def matvec(t):
        return as_tree(a @ from_tree(t), n1)

    lr = 1.0 / cond  # largest eigenvalue is cond: 0 < lr < 2/λ_max
    solvers = {
        linalg.CG(maxiter=10 * n, tol=1e-13): 1e-9,
        linalg.Dense(): 1e-10,
        linalg.Neumann(steps=3000, lr=lr): 1e-6,
        linalg.FixedPoint(maxiter=3000, lr=lr, tol=1e-12): 1e-6,
    }
    for solver, tol in solvers.items():
        x = from_tree(solver(matvec, as_tree(b, n1)))
        err = (x - exact).norm() / exact.norm()
        assert err < tol, f"{solver}: relative error {err:.2e}"


@SETTINGS
@given(systems)
def test_error_shrinks_with_iterations(system):
    n, cond, seed = system
    a = spd(n, cond, seed)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    exact = torch.linalg.solve(a, b)

    def err(solver):
        return float((solver(lambda v: a @ v, b) - exact).norm())

    # Neumann: the error is ‖(I − lr A)^{k+1} A⁻¹ b‖, monotone non-increasing in k.
    neumann = [err(linalg.Neumann(steps=k, lr=1.0 / cond)) for k in (0, 5, 20, 80)]
    assert all(x2 <= x1 * (1 + 1e-9) + 1e-14 for x1, x2 in zip(neumann, neumann[1:]))
    assert neumann[-1] < neumann[0] or neumann[0] < 1e-12
    # CG reaches the exact answer in at most n steps (up to round-off); the A-norm error
    # is monotone, so the final error must be far below the one-step error.
    one, full = err(linalg.CG(maxiter=1, tol=0.0)), err(linalg.CG(maxiter=n, tol=0.0))
    assert full <= 1e-7 * max(1.0, float(exact.norm()))
    assert full <= one + 1e-12


def test_neumann_equals_fixed_point_without_early_stop():
    a = spd(6, 10.0, 3)
    b = torch.arange(6, dtype=torch.float64)
    x1 = linalg.Neumann(steps=7, lr=0.05)(lambda v: a @ v, b)
    x2 = linalg.FixedPoint(maxiter=8, lr=0.05, tol=0.0)(lambda v: a @ v, b)
    assert torch.allclose(x1, x2, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_cg_on_a_single_unknown(shape):
    # torchopt #222: CG on a scalar variable returned zeros. One CG step is exact for n = 1.
    b = torch.full(shape, 3.0, dtype=torch.float64)
    x = linalg.CG(maxiter=1, tol=0.0)(lambda v: 4.0 * v, b)
    assert x.shape == b.shape
    assert torch.allclose(x, torch.full(shape, 0.75, dtype=torch.float64))
    x = linalg.CG()(lambda t: {"s": 4.0 * t["s"]}, {"s": b})["s"]
    assert torch.allclose(x, torch.full(shape, 0.75, dtype=torch.float64))


def test_zero_rhs_gives_zero_without_matvec():
    calls = []

    def matvec(v):
        calls.append(1)
        return 2.0 * v

    for solver in (linalg.CG(), linalg.FixedPoint(), linalg.Dense()):
        x = solver(matvec, torch.zeros(3, dtype=torch.float64))
        assert torch.equal(x, torch.zeros(3, dtype=torch.float64))
    assert len(calls) == 3  # only Dense, which materializes A column by column


def test_maxiter_zero_is_rejected_rather_than_returning_zeros():
    with pytest.raises(ValueError, match="CG: maxiter must be >= 1"):
        linalg.CG(maxiter=0)
    with pytest.raises(ValueError, match="FixedPoint: maxiter must be >= 1"):
        linalg.FixedPoint(maxiter=0)
    # Neumann with zero extra terms is lr·b, a non-zero first-order answer.
    x = linalg.Neumann(steps=0, lr=0.5)(lambda v: v, torch.ones(2))
    assert torch.equal(x, torch.full((2,), 0.5))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: linalg.CG(maxiter=-3), "maxiter must be >= 1"),
        (lambda: linalg.CG(maxiter=2.5), "maxiter must be an int"),
        (lambda: linalg.CG(maxiter=True), "maxiter must be an int"),
        (lambda: linalg.CG(tol=-1.0), "tol must be a finite number >= 0"),
        (lambda: linalg.Neumann(steps=-1, lr=0.1), "steps must be >= 0"),
        (lambda: linalg.Neumann(steps=3, lr=0.0), "lr must be a finite number > 0"),
        (lambda: linalg.FixedPoint(lr=float("nan")), "lr must be a finite number > 0"),
        (lambda: linalg.Dense(max_size=0), "max_size must be >= 1"),
    ],
)
def test_bad_config_is_rejected(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_cg_stops_on_negative_curvature_with_a_warning():
    a = torch.diag(torch.tensor([1.0, -1.0], dtype=torch.float64))
    with pytest.warns(ConvergenceWarning, match="not positive definite.*use MINRES"):
        x, info = linalg.CG(maxiter=10).solve(
            lambda v: [a @ v[0]], [torch.tensor([1.0, 1.0], dtype=torch.float64)])
    assert torch.isfinite(x[0]).all() and info["converged"] is False


def test_singular_systems_get_the_minimum_norm_solution():
    # A variable the lower level ignores gives a zero row/column in the Hessian.
    a = torch.diag(torch.tensor([2.0, 0.0, 4.0], dtype=torch.float64))
    b = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    expected = torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64)
    for solver in (linalg.Dense(), linalg.CG(maxiter=5, tol=1e-14)):
        assert torch.allclose(solver(lambda v: a @ v, b), expected)


def test_non_finite_matvec_and_oversized_dense_raise():
    with pytest.raises(FloatingPointError, match="CG: pᵀAp is nan at iteration 1"):
        linalg.CG()(lambda v: v * float("nan"), torch.ones(2))
    with pytest.raises(ValueError, match="more than max_size=3"):
        linalg.Dense(max_size=3)(lambda v: v, torch.ones(4))
    with pytest.raises(ValueError, match="matvec must return a pytree with the structure"):
        linalg.CG()(lambda t: {"other": t["a"]}, {"a": torch.ones(2)})


# -- the solve(matvec, b, init=None) -> (x, info) protocol: warm start, ridge, options ----------
def _system(n=8, cond=20.0, seed=5):
    a = spd(n, cond, seed)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return a, b, torch.linalg.solve(a, b)


@pytest.mark.parametrize(
    "solver",
    [
        linalg.CG(maxiter=50, tol=1e-10),
        linalg.Neumann(steps=500, lr=0.05, tol=1e-10),
        linalg.FixedPoint(maxiter=500, lr=0.05, tol=1e-10),
    ],
    ids=lambda s: type(s).__name__,
)
def test_init_at_the_solution_is_returned_in_at_most_one_iteration(solver):
    a, b, exact = _system()
    x, info = solver.solve(lambda v: [a @ v[0]], [b], [exact])
    assert info["iterations"] <= 1
    assert torch.allclose(x[0], exact, rtol=1e-10, atol=1e-12)
    _, cold = solver.solve(lambda v: [a @ v[0]], [b])
    assert cold["iterations"] > 5  # the warm start is what saved the iterations


def test_a_nearby_init_saves_cg_iterations_and_reaches_the_same_solution():
    a, b, exact = _system(n=30, cond=100.0)
    near = exact + 1e-4 * torch.randn(30, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    cg = linalg.CG(maxiter=200, tol=1e-12)
    x_cold, cold = cg.solve(lambda v: [a @ v[0]], [b])
    x_warm, warm = cg.solve(lambda v: [a @ v[0]], [b], [near])
    assert warm["iterations"] < cold["iterations"]
    assert torch.allclose(x_warm[0], exact, rtol=1e-9) and torch.allclose(x_cold[0], exact, rtol=1e-9)
    # an arbitrary init converges to the same solution, and the pytree call takes init too
    x = cg(lambda t: {"m": a @ t["m"]}, {"m": b}, init={"m": torch.ones(30, dtype=torch.float64)})
    assert torch.allclose(x["m"], exact, rtol=1e-9)


def test_neumann_from_an_init_continues_the_richardson_iteration():
    a, b, exact = _system()
    x0 = torch.ones(8, dtype=torch.float64)
    # x0 + Neumann(b − A x0) with k terms = Richardson from x0 with k + 1 updates
    x, info = linalg.Neumann(steps=6, lr=0.05).solve(lambda v: [a @ v[0]], [b], [x0])
    y = x0.clone()
    for _ in range(7):
        y = y + 0.05 * (b - a @ y)
    assert info["iterations"] == 6.0
    assert torch.allclose(x[0], y, rtol=1e-12)


@pytest.mark.parametrize("ridge", [0.5, 3.0])
def test_ridge_matches_a_dense_solve_of_the_damped_system(ridge):
    a, b, _ = _system(n=10, cond=30.0)
    damped = torch.linalg.solve(a + ridge * torch.eye(10, dtype=torch.float64), b)
    x_cg, _ = linalg.CG(maxiter=100, tol=1e-13, ridge=ridge).solve(lambda v: [a @ v[0]], [b])
    lr = 1.0 / (30.0 + ridge)  # λ_max(A + ridge·I)
    x_ne, _ = linalg.Neumann(steps=3000, lr=lr, ridge=ridge).solve(lambda v: [a @ v[0]], [b])
    assert torch.allclose(x_cg[0], damped, rtol=1e-10)
    assert torch.allclose(x_ne[0], damped, rtol=1e-8)
    # ridge = 0 is the undamped solve, bit for bit
    plain, _ = linalg.CG(maxiter=40, tol=0.0).solve(lambda v: [a @ v[0]], [b])
    zero, _ = linalg.CG(maxiter=40, tol=0.0, ridge=0.0).solve(lambda v: [a @ v[0]], [b])
    assert torch.equal(plain[0], zero[0])


def test_factories_return_the_protocol_callable_and_name_bad_options():
    a, b, _ = _system()
    x1, i1 = linalg.solve_cg(maxiter=5, tol=0.0)(lambda v: [a @ v[0]], [b])
    x2, i2 = linalg.CG(maxiter=5, tol=0.0).solve(lambda v: [a @ v[0]], [b])
    assert torch.equal(x1[0], x2[0]) and i1 == i2
    x3, _ = linalg.solve_neumann(steps=4, lr=0.05)(lambda v: [a @ v[0]], [b])
    x4, _ = linalg.solve_fixed_point(maxiter=5, lr=0.05, tol=0.0)(lambda v: [a @ v[0]], [b])
    assert torch.allclose(x3[0], x4[0], rtol=1e-13)
    keys = {"iterations", "residual", "converged"}
    assert set(linalg.solve_dense()(lambda v: [a @ v[0]], [b])[1]) == keys | {"rank"}
    with pytest.raises(ValueError, match="solve_cg: unknown option 'maxiters'; the options of CG are maxiter, tol, atol, ridge"):
        linalg.solve_cg(maxiters=5)
    with pytest.raises(ValueError, match="solve_neumann: unknown option 'ridg'"):
        linalg.solve_neumann(steps=3, lr=0.1, ridg=1.0)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: linalg.CG(ridge=-1.0), "CG: ridge must be a finite number >= 0"),
        (lambda: linalg.Neumann(steps=3, lr=0.1, ridge=float("inf")), "Neumann: ridge must be a finite number >= 0"),
        (lambda: linalg.Neumann(steps=3, lr=0.1, tol=-1e-3), "Neumann: tol must be a finite number >= 0"),
        (lambda: linalg.solve_cg(tol="small"), "CG: tol must be a number"),
    ],
)
def test_bad_protocol_options_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_an_init_of_the_wrong_shape_is_rejected():
    a, b, _ = _system()
    for solver in (linalg.CG(), linalg.Neumann(steps=3, lr=0.1), linalg.FixedPoint()):
        with pytest.raises(ValueError, match=f"{type(solver).__name__}: init must be shaped like b"):
            solver.solve(lambda v: [a @ v[0]], [b], [torch.zeros(7, dtype=torch.float64)])
