"""bilevel.linalg right or loud (issue 36): MINRES on symmetric indefinite systems, NormalCG
and Dense on rank-deficient ones (against float64 torch.linalg.solve / pinv, hypothesis-drawn),
CG's negative-curvature policy, the convergence contract every iterative solver shares
(converged / residual / iterations, ConvergenceWarning, DivergenceError), the non-convex
5-8-2 MLP hyper-cleaning problem against its dense float64 implicit hypergradient, and fit
leaving everything untouched when a step's linear solve diverges."""

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bilevel
from bench.linalg_nonconvex import hyper_cleaning_mlp, measure
from bilevel import linalg
from bilevel.errors import ConvergenceWarning, DivergenceError, NegativeCurvatureError

F64 = torch.float64
SETTINGS = settings(max_examples=30, deadline=None)


def _orthogonal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=F64))
    return q


def indefinite(n: int, cond: float, seed: int) -> torch.Tensor:
    """Symmetric, nonsingular, |eigenvalues| log-spread in [1, cond], at least one negative."""
    g = torch.Generator().manual_seed(seed + 7)
    mag = torch.logspace(0, math.log10(cond), n, dtype=F64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(F64)
    sign[0] = -1.0
    q = _orthogonal(n, seed)
    return (q * (sign * mag)) @ q.T


def rank_deficient_psd(n: int, rank: int, seed: int) -> torch.Tensor:
    """Symmetric PSD of exactly ``rank`` nonzero eigenvalues in [1, 10]."""
    eig = torch.zeros(n, dtype=F64)
    eig[:rank] = torch.linspace(1.0, 10.0, rank, dtype=F64)
    q = _orthogonal(n, seed)
    return (q * eig) @ q.T


def _rhs(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)


def _solve(solver, a, b):
    x, info = solver.solve(lambda v: [a @ v[0]], [b])
    return x[0], info


def _rel(x, y) -> float:
    return float((x - y).norm() / y.norm())


indefinite_systems = st.tuples(st.integers(2, 14), st.floats(1.0, 100.0), st.integers(0, 2**16))


@SETTINGS
@given(indefinite_systems)
def test_minres_solves_symmetric_indefinite_systems(system):
    n, cond, seed = system
    a, b = indefinite(n, cond, seed), _rhs(n, seed)
    x, info = _solve(linalg.MINRES(maxiter=20 * n, tol=1e-12), a, b)
    assert _rel(x, torch.linalg.solve(a, b)) < 1e-8 * cond
    assert info["converged"] is True
    # residual is ‖b − A x‖ of the returned x (MINRES's recursive φ_k, here up to round-off)
    assert abs(info["residual"] - float((b - a @ x).norm())) <= 1e-10 * float(b.norm())


@SETTINGS
@given(indefinite_systems)
def test_cg_told_to_raise_either_raises_or_agrees(system):
    n, cond, seed = system
    a, b = indefinite(n, cond, seed), _rhs(n, seed)
    try:
        x, info = _solve(linalg.CG(maxiter=20 * n, tol=1e-12, negative_curvature="raise"), a, b)
    except NegativeCurvatureError as e:
        assert "use MINRES" in str(e)
        return
    assert info["converged"] and _rel(x, torch.linalg.solve(a, b)) < 1e-7 * cond


deficient_systems = st.tuples(st.integers(2, 12), st.integers(1, 11), st.integers(0, 2**16),
                              st.booleans())


@SETTINGS
@given(deficient_systems)
def test_normal_cg_and_dense_give_the_minimum_norm_solution(system):
    n, rank, seed, consistent = system
    rank = min(rank, n - 1)
    a = rank_deficient_psd(n, rank, seed)
    b = a @ _rhs(n, seed) if consistent else _rhs(n, seed)  # in the range, or not
    expected = torch.linalg.pinv(a, hermitian=True, rtol=1e-10) @ b
    assert torch.allclose(expected, torch.linalg.lstsq(a, b, driver="gelsd", rcond=1e-10).solution)
    x, info = _solve(linalg.Dense(), a, b)
    assert _rel(x, expected) < 1e-10 and info["rank"] == rank
    assert abs(info["residual"] - float((b - a @ x).norm())) < 1e-10 * float(b.norm())
    x, info = _solve(linalg.NormalCG(maxiter=20 * n, tol=1e-12), a, b)
    assert _rel(x, expected) < 1e-8 and info["converged"] is True
    assert abs(info["residual"] - float((b - a @ x).norm())) < 1e-9 * float(b.norm())


def test_dense_drops_numerically_zero_singular_values():
    # eigenvalues 1, 2, 3, 1e-17: LU "succeeds" on this and returns a 1e17-sized component
    q = _orthogonal(4, 3)
    a = (q * torch.tensor([1.0, 2.0, 3.0, 1e-17], dtype=F64)) @ q.T
    b = _rhs(4, 3)
    x, info = _solve(linalg.Dense(), a, b)
    assert info["rank"] == 3
    assert _rel(x, torch.linalg.pinv(a, rtol=4 * torch.finfo(F64).eps) @ b) < 1e-12
    assert float(x.norm()) < 10 * float(b.norm())
    # an explicit rcond keeps the small direction when asked to
    assert linalg.Dense(rcond=1e-18).solve(lambda v: [a @ v[0]], [b])[1]["rank"] == 4


def test_cg_on_a_singular_system_outside_the_range_stops_instead_of_exploding():
    a = rank_deficient_psd(8, 5, 11)
    b = _rhs(8, 11)  # has a component in the null space: no solution exists
    with pytest.warns(ConvergenceWarning, match="CG: .*not positive definite"):
        x, info = _solve(linalg.CG(maxiter=200, tol=1e-12), a, b)
    assert info["converged"] is False
    assert float(x.norm()) < 1e3 * float((torch.linalg.pinv(a) @ b).norm())


def test_the_zero_curvature_test_leaves_float32_spd_systems_alone():
    # the threshold is 10·ε relative to the largest curvature seen, not n·ε (n·ε in float32
    # would stop CG at legitimate directions of large problems)
    n = 400
    q = _orthogonal(n, 5)
    a = ((q * torch.logspace(0, 3, n, dtype=F64)) @ q.T).float()
    b = _rhs(n, 5).float()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, info = _solve(linalg.CG(maxiter=n, tol=1e-4), a, b)
    assert info["converged"] and float((b - a @ x).norm()) < 1e-3 * float(b.norm())


# -- the convergence contract ------------------------------------------------------------------
def _spd(n=6, seed=2):
    q = _orthogonal(n, seed)
    return (q * torch.logspace(0, 1, n, dtype=F64)) @ q.T  # eigenvalues in [1, 10]


ALL = [
    linalg.CG(maxiter=50, tol=1e-10),
    linalg.MINRES(maxiter=50, tol=1e-10),
    linalg.NormalCG(maxiter=200, tol=1e-10),
    linalg.Neumann(steps=400, lr=0.1, tol=1e-10),
    linalg.FixedPoint(maxiter=400, lr=0.1, tol=1e-10),
    linalg.Dense(),
]


@pytest.mark.parametrize("solver", ALL, ids=lambda s: type(s).__name__)
def test_every_solver_reports_converged_residual_iterations(solver):
    a, b = _spd(), _rhs(6, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converged: nothing said
        x, info = _solve(solver, a, b)
    assert info["converged"] is True and isinstance(info["converged"], bool)
    assert info["iterations"] >= 1 and info["residual"] <= 1e-10 * float(b.norm())
    true = float((b - a @ x).norm())
    # Neumann's residual is the one of the sum without its last term: a bound (docstring)
    assert true <= info["residual"] * (1 + 1e-6) + 1e-14 if type(solver) is linalg.Neumann \
        else abs(true - info["residual"]) <= 1e-12 * float(b.norm())


@pytest.mark.parametrize(
    "solver, iterations",
    [(linalg.CG(maxiter=2), 2), (linalg.MINRES(maxiter=2), 2), (linalg.NormalCG(maxiter=2), 2),
     (linalg.Neumann(steps=2, lr=0.1), 2), (linalg.FixedPoint(maxiter=2, lr=0.1), 2)],
    ids=lambda s: type(s).__name__ if isinstance(s, linalg.LinearSolver) else str(s),
)
def test_stopping_unconverged_warns_with_what_to_change(solver, iterations):
    a, b = _spd(), _rhs(6, 2)
    name = type(solver).__name__
    with pytest.warns(ConvergenceWarning) as caught:
        _, info = _solve(solver, a, b)
    msg = str(caught[0].message)
    assert msg.startswith(f"{name}: stopped unconverged after {iterations} iterations")
    assert "residual ‖b − A x‖ = " in msg and "> tolerance" in msg and "raise" in msg
    assert info["converged"] is False and info["iterations"] == iterations
    quiet = dataclasses.replace(solver, on_unconverged="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _solve(quiet, a, b)[1]["converged"] is False


@pytest.mark.parametrize("make", [
    lambda lr: linalg.FixedPoint(maxiter=500, lr=lr),
    lambda lr: linalg.Neumann(steps=500, lr=lr),
    lambda lr: linalg.Neumann(steps=500, lr=lr, tol=1e-8),
], ids=["FixedPoint", "Neumann", "Neumann-tol"])
def test_a_step_above_two_over_lambda_max_raises_divergence_early(make):
    a, b = _spd(), _rhs(6, 2)  # λ_max = 10: lr = 0.25 > 2/λ_max = 0.2
    with pytest.raises(DivergenceError, match=r"diverged: the residual .* more than divergence_factor=1000"):
        _solve(make(0.25), a, b)
    with pytest.raises(FloatingPointError):  # what callers caught before DivergenceError existed
        _solve(make(0.25), a, b)
    warn = dataclasses.replace(make(0.25), on_divergence="warn")
    with pytest.warns(ConvergenceWarning, match="on_divergence='warn': returning this iterate"):
        x, info = _solve(warn, a, b)
    assert info["converged"] is False and torch.isfinite(x).all()
    # stopped at the first residual past the factor; Neumann without tol checks at the end only
    assert info["residual"] > 1e3 * float(b.norm())
    if not (isinstance(warn, linalg.Neumann) and warn.tol == 0):
        assert info["residual"] < 1e5 * float(b.norm())


def test_cg_on_an_ill_conditioned_spd_system_is_not_called_divergent():
    # CG's residual grows transiently by ~√κ/20 (≈ 480× at κ = 1e8): below CG's 1e6 default
    n = 50
    q = _orthogonal(n, 19)
    a = (q * torch.logspace(0, 8, n, dtype=F64)) @ q.T
    b = _rhs(n, 19)
    x, info = _solve(linalg.CG(maxiter=2000, tol=1e-9, on_unconverged="ignore"), a, b)
    assert torch.isfinite(x).all() and info["residual"] < float(b.norm())
    with pytest.raises(DivergenceError):  # the same solve under a 10× factor: the growth is real
        _solve(linalg.CG(maxiter=2000, tol=1e-9, divergence_factor=10.0), a, b)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: linalg.MINRES(on_divergence="explode"), "on_divergence must be one of 'raise'"),
        (lambda: linalg.NormalCG(on_unconverged="raise"), "on_unconverged must be one of 'warn'"),
        (lambda: linalg.CG(divergence_factor=1.0), "divergence_factor must be > 1"),
        (lambda: linalg.CG(negative_curvature="skip"), "negative_curvature must be one of 'stop'"),
        (lambda: linalg.MINRES(maxiter=0), "MINRES: maxiter must be >= 1"),
        (lambda: linalg.NormalCG(tol=-1.0), "NormalCG: tol must be a finite number >= 0"),
        (lambda: linalg.Dense(rcond=1.0), "Dense: rcond must be < 1"),
        (lambda: linalg.solve_minres(maxiters=3), "solve_minres: unknown option 'maxiters'"),
    ],
)
def test_bad_options_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_factories_and_ridge_for_the_new_solvers():
    a, b = indefinite(7, 10.0, 4), _rhs(7, 4)
    exact = torch.linalg.solve(a + 0.5 * torch.eye(7, dtype=F64), b)
    for solve in (linalg.solve_minres(maxiter=100, tol=1e-12, ridge=0.5),
                  linalg.solve_normal_cg(maxiter=300, tol=1e-12, ridge=0.5)):
        x, info = solve(lambda v: [a @ v[0]], [b])
        assert _rel(x[0], exact) < 1e-8 and info["converged"]
    # a warm start at the solution costs nothing more
    x, info = linalg.MINRES(tol=1e-10).solve(lambda v: [a @ v[0]], [b], [torch.linalg.solve(a, b)])
    assert info["iterations"] == 0 and info["converged"]


# -- the non-convex 5-8-2 MLP hyper-cleaning problem --------------------------------------------
@pytest.fixture(scope="module")
def mlp():
    return hyper_cleaning_mlp()


def test_the_mlp_hessian_is_indefinite_and_nonsingular(mlp):
    eig = torch.linalg.eigvalsh(mlp.hessian)
    assert eig.numel() == 66 and int((eig < 0).sum()) >= 10
    assert float(eig.abs().min()) > 1e-5


def test_minres_normal_cg_and_dense_match_the_dense_implicit_hypergradient(mlp):
    for solver, tol in ((linalg.MINRES(maxiter=500, tol=1e-10), 1e-8),
                        (linalg.NormalCG(maxiter=1000, tol=1e-10), 1e-7),
                        (linalg.Dense(), 1e-10)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            grad, info = mlp.hypergrad(solver)
        assert _rel(grad, mlp.exact) < tol, type(solver).__name__
        assert info["solver_converged"] == 1.0


def test_cg_warns_and_the_richardson_solvers_raise_on_the_mlp(mlp):
    with pytest.warns(ConvergenceWarning, match="CG: the operator is not positive definite"):
        grad, info = mlp.hypergrad(linalg.CG(maxiter=500, tol=1e-10))
    assert info["solver_converged"] == 0.0 and _rel(grad, mlp.exact) > 0.1  # why it warns
    with pytest.raises(NegativeCurvatureError):
        mlp.hypergrad(linalg.CG(maxiter=500, negative_curvature="raise"))
    lr = 1.0 / float(torch.linalg.eigvalsh(mlp.hessian).abs().max())  # < 2/λ_max, yet diverges
    for solver in (linalg.Neumann(steps=500, lr=lr), linalg.FixedPoint(maxiter=500, lr=lr)):
        with pytest.raises(DivergenceError, match=type(solver).__name__):
            mlp.hypergrad(solver)
        warn = dataclasses.replace(solver, on_divergence="warn")
        with pytest.warns(ConvergenceWarning, match="diverged"):
            assert mlp.hypergrad(warn)[1]["solver_converged"] == 0.0


def test_the_bench_rows_report_what_each_solver_did(mlp):
    row = measure(mlp, "MINRES", linalg.MINRES(maxiter=500, tol=1e-10), repeats=1)
    assert row["error"] < 1e-8 and row["converged"] is True and row["said"] == "nothing"
    row = measure(mlp, "FixedPoint", linalg.FixedPoint(maxiter=500, lr=1.0), repeats=1)
    assert row["said"].startswith("raised DivergenceError at iteration")


# -- fit applies nothing from a step whose linear solve diverged ---------------------------------
def test_fit_leaves_variables_and_optimizers_untouched_after_a_divergence():
    def lower(a, t, _):
        return 0.5 * (torch.exp(a["s"]) * (t["w"] - a["m"]) ** 2).sum()

    def upper(a, t, _):
        return ((t["w"] - 1.0) ** 2).sum() + 0.1 * (a["s"] ** 2)

    problem = bilevel.Problem(upper=upper, lower=lower)
    outer = {"s": torch.tensor(0.3, dtype=F64, requires_grad=True),
             "m": torch.zeros(3, dtype=F64, requires_grad=True)}
    inner = {"w": torch.zeros(3, dtype=F64, requires_grad=True)}
    opt_o = torch.optim.Adam(outer.values(), lr=0.1)
    opt_i = torch.optim.SGD(inner.values(), lr=0.1, momentum=0.9)
    good = bilevel.AID(3, 0.1, linear_solver=linalg.CG(maxiter=10, tol=1e-12))
    bilevel.fit(problem, good, outer, inner, steps=2, outer_optimizer=opt_o, inner_optimizer=opt_i,
                progress=False)
    before = ({k: v.detach().clone() for k, v in {**outer, **inner}.items()},
              copy.deepcopy(opt_o.state_dict()), copy.deepcopy(opt_i.state_dict()))
    bad = bilevel.AID(3, 0.1, linear_solver=linalg.Neumann(steps=50, lr=5.0))  # λ = e^0.3...
    with pytest.raises(DivergenceError, match="Neumann"):
        bilevel.fit(problem, bad, outer, inner, steps=2, outer_optimizer=opt_o,
                    inner_optimizer=opt_i, progress=False)
    for k, v in {**outer, **inner}.items():
        assert torch.equal(v.detach(), before[0][k]), k
    for opt, saved in ((opt_o, before[1]), (opt_i, before[2])):
        now = opt.state_dict()
        assert now["param_groups"] == saved["param_groups"]
        for key, state in saved["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(now["state"][key][name]), torch.as_tensor(value))
