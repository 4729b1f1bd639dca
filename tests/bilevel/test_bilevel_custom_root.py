"""``bilevel.custom_root``: implicit differentiation of an inner solution computed by any
solver, against closed forms (ridge), finite differences of an exact NNLS solve
(scipy.optimize.nnls, test-only oracle), ``bilevel.hypergrad`` with Implicit(Dense), and an
L-BFGS inner solve; plus has_aux, rmatvec, the errors and the unused-leaf warning."""

import warnings

import numpy as np
import pytest
import scipy.optimize
import torch

import bilevel
from bilevel import linalg

D = torch.float64  # every tensor below is float64 (no global default-dtype change)
gen = torch.Generator().manual_seed(0)
X, Y = torch.randn(12, 4, dtype=D, generator=gen), torch.randn(12, dtype=D, generator=gen)
XV, YV = torch.randn(7, 4, dtype=D, generator=gen), torch.randn(7, dtype=D, generator=gen)


def lower(outer, w, batch=None):
    """g = ½‖Xw − y‖² + ½ e^{log_lam} ‖w − shift‖²."""
    lam = outer["log_lam"].exp()
    return 0.5 * (X @ w["w"] - Y).pow(2).sum() + 0.5 * lam * (w["w"] - outer["shift"]).pow(2).sum()


def upper(outer, w, batch=None):
    return 0.5 * (XV @ w["w"] - YV).pow(2).sum()


def ridge_optimality(outer, w):
    """∇_w g, written out: zero exactly at the ridge solution."""
    lam = outer["log_lam"].exp()
    return {"w": X.T @ (X @ w["w"] - Y) + lam * (w["w"] - outer["shift"])}


def closed_form(outer):
    lam = outer["log_lam"].exp()
    h = X.T @ X + lam * torch.eye(4, dtype=D)
    return {"w": torch.linalg.solve(h, X.T @ Y + lam * outer["shift"])}


def analytic_hypergrad(outer):
    """dF/dlog_lam = λ uᵀ(shift − w*), dF/dshift = λ u with H u = ∇_w f, H = XᵀX + λI."""
    lam = outer["log_lam"].exp()
    w = closed_form(outer)["w"]
    u = torch.linalg.solve(X.T @ X + lam * torch.eye(4, dtype=D), XV.T @ (XV @ w - YV))
    return {"log_lam": lam * u @ (outer["shift"] - w), "shift": lam * u}


def make_outer():
    return {"log_lam": torch.tensor(0.3, dtype=D, requires_grad=True),
            "shift": torch.tensor([0.5, -1.0, 0.2, 0.0], dtype=D, requires_grad=True)}


def test_closed_form_ridge_equals_the_analytic_hypergradient_and_hypergrad_dense():
    solve = bilevel.custom_root(ridge_optimality)(closed_form)
    outer = make_outer()
    upper(outer, solve(outer)).backward()
    expected = analytic_hypergrad({k: v.detach() for k, v in outer.items()})
    # float64 round-off on a 4 × 4 system: 1e-12 relative
    for k in outer:
        torch.testing.assert_close(outer[k].grad, expected[k], rtol=1e-12, atol=1e-12)
    problem = bilevel.Problem(upper=upper, lower=lower)
    at = {k: v.detach() for k, v in outer.items()}
    via = bilevel.hypergrad(problem, at, closed_form(at), upper_batch=None, lower_batch=None,
                            method=bilevel.Implicit(linalg.Dense()))
    for k in outer:
        torch.testing.assert_close(outer[k].grad, via[k], rtol=1e-12, atol=1e-12)


def test_autograd_grad_and_an_iterative_linear_solver_agree():
    solve = bilevel.custom_root(ridge_optimality, linalg.CG(maxiter=50, tol=1e-14))(closed_form)
    outer = make_outer()
    grads = torch.autograd.grad(upper(outer, solve(outer)), [outer["log_lam"], outer["shift"]])
    expected = analytic_hypergrad({k: v.detach() for k, v in outer.items()})
    torch.testing.assert_close(grads[0], expected["log_lam"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1], expected["shift"], rtol=1e-10, atol=1e-12)


# --- non-negative least squares through its projected-gradient fixed point ---------------
A = torch.randn(8, 5, dtype=D, generator=torch.Generator().manual_seed(3))
B0 = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(4))
BMAP = torch.randn(8, 2, dtype=D, generator=torch.Generator().manual_seed(5))
ETA = 1.0 / float(torch.linalg.matrix_norm(A, 2) ** 2)  # 1/L of ∇g


def nnls_grad(a, x):
    """∇_x g for g(a, x) = ½‖A x − (b₀ + B a)‖²."""
    return A.T @ (A @ x - (B0 + BMAP @ a))


def nnls_optimality(a, x):
    """F(a, x) = x − max(x − η ∇_x g(a, x), 0): zero exactly at the NNLS solution."""
    return x - torch.relu(x - ETA * nnls_grad(a, x))


@bilevel.custom_root(nnls_optimality)
def nnls_projected_gradient(a):
    """A projected solver under no_grad: 20000 projected gradient steps (float64)."""
    x = torch.zeros(5, dtype=D)
    with torch.no_grad():
        for _ in range(20000):
            x = torch.relu(x - ETA * nnls_grad(a, x))
    return x


def scipy_nnls(a):
    x, _ = scipy.optimize.nnls(A.numpy(), (B0 + BMAP @ torch.as_tensor(a)).numpy())
    return x


def test_nnls_with_an_active_constraint_matches_finite_differences_of_scipy_nnls():
    a0 = np.array([0.4, -0.7])
    x_star = scipy_nnls(a0)
    grad_at = nnls_grad(torch.as_tensor(a0), torch.as_tensor(x_star)).numpy()
    active = x_star == 0.0
    # the test's premise: some constraint is active, strictly (positive multiplier), so that
    # the solution is differentiable and central differences stay on the same active set
    assert active.any() and (~active).any() and (grad_at[active] > 1e-2).all()
    c = torch.linspace(1.0, 2.0, 5, dtype=D)

    a = torch.tensor(a0, requires_grad=True)
    x = nnls_projected_gradient(a)
    np.testing.assert_allclose(x.detach().numpy(), x_star, atol=1e-12)
    (c @ x).backward()
    h = 1e-6
    fd = [(c.numpy() @ (scipy_nnls(a0 + h * e) - scipy_nnls(a0 - h * e))) / (2 * h)
          for e in np.eye(2)]
    # central differences of an exact active-set solve: O(h²) + round-off/h ≈ 1e-9
    np.testing.assert_allclose(a.grad.numpy(), fd, rtol=1e-6, atol=1e-8)


# --- an L-BFGS inner solve --------------------------------------------------------------
@bilevel.custom_root(ridge_optimality)
def lbfgs_solve(outer):
    """torch.optim.LBFGS on g from w = 0 (grad enabled inside: L-BFGS needs it)."""
    w = torch.zeros(4, dtype=D, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=200, tolerance_grad=1e-13,
                            tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = lower(outer, {"w": w})
        loss.backward()
        return loss

    opt.step(closure)
    return {"w": w.detach()}


def test_lbfgs_inner_solve_matches_the_closed_form_hypergradient():
    outer = make_outer()
    w = lbfgs_solve(outer)
    torch.testing.assert_close(w["w"], closed_form({k: v.detach() for k, v in outer.items()})["w"],
                               rtol=1e-7, atol=1e-8)  # L-BFGS stops at ~1e-8 relative
    upper(outer, w).backward()
    expected = analytic_hypergrad({k: v.detach() for k, v in outer.items()})
    # the derivative is taken at L-BFGS's point, ~1e-8 from the root: error of that order
    for k in outer:
        torch.testing.assert_close(outer[k].grad, expected[k], rtol=1e-6, atol=1e-8)
        assert outer[k].grad.abs().max() > 1e-3  # a real gradient, not a zero


def test_has_aux_passes_aux_through_and_differentiates_the_inner_only():
    @bilevel.custom_root(ridge_optimality, has_aux=True)
    def solve(outer):
        return closed_form(outer), {"iterations": 1, "note": "closed form"}

    outer = make_outer()
    w, aux = solve(outer)
    assert aux == {"iterations": 1, "note": "closed form"}
    upper(outer, w).backward()
    expected = analytic_hypergrad({k: v.detach() for k, v in outer.items()})
    torch.testing.assert_close(outer["shift"].grad, expected["shift"], rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="must return \\(inner, aux\\)"):
        bilevel.custom_root(ridge_optimality, has_aux=True)(closed_form)(make_outer())


def test_a_solver_taking_rmatvec_gets_the_untransposed_jacobian():
    """NNLS's Jacobian is not symmetric: the solver checks rmatvec = transpose of matvec."""
    seen = {}

    def normal_equations(matvec, b, init=None, rmatvec=None):
        n = b[0].numel()
        eye = torch.eye(n, dtype=D)
        m = torch.stack([matvec([eye[i]])[0] for i in range(n)], dim=1)
        mt = torch.stack([rmatvec([eye[i]])[0] for i in range(n)], dim=1)
        seen["transpose_error"] = float((mt - m.T).abs().max())
        seen["asymmetry"] = float((m - m.T).abs().max())
        return [torch.linalg.solve(mt @ m, mt @ b[0])], {"converged": True}

    solve = bilevel.custom_root(nnls_optimality, normal_equations)(nnls_projected_gradient.__wrapped__)
    a = torch.tensor([0.4, -0.7], dtype=D, requires_grad=True)
    (torch.linspace(1.0, 2.0, 5, dtype=D) @ solve(a)).backward()
    b = torch.tensor([0.4, -0.7], dtype=D, requires_grad=True)
    (torch.linspace(1.0, 2.0, 5, dtype=D) @ nnls_projected_gradient(b)).backward()
    assert seen["asymmetry"] > 1e-3 and seen["transpose_error"] < 1e-14
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_an_unconverged_linear_solve_warns_and_a_missing_converged_key_is_silent():
    def stopped(matvec, b, init=None):
        return linalg.Dense().solve(matvec, b)[0], {"converged": False, "residual": 0.5,
                                                    "iterations": 3.0}

    outer = make_outer()
    with pytest.warns(bilevel.ConvergenceWarning, match="did not converge.*residual 0.5"):
        upper(outer, bilevel.custom_root(ridge_optimality, stopped)(closed_form)(outer)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        upper(outer, bilevel.custom_root(ridge_optimality, linalg.CG())(closed_form)(outer)).backward()


def test_optimality_of_the_wrong_structure_or_shape_is_refused_naming_both():
    outer = make_outer()
    wrong_structure = bilevel.custom_root(lambda o, w: [w["w"]])(closed_form)
    with pytest.raises(ValueError, match=r"shaped like inner, got \[\*\] for inner \{'w': \*\}"):
        upper(outer, wrong_structure(outer)).backward()
    wrong_shape = bilevel.custom_root(lambda o, w: {"w": w["w"][:3]})(closed_form)
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(3,\) but inner\['w'\] has shape \(4,\)"):
        upper(outer, wrong_shape(outer)).backward()


def test_a_non_finite_solution_is_refused_naming_the_leaf():
    def diverged(outer):
        return {"w": torch.full((4,), float("nan"), dtype=D)}

    with pytest.raises(FloatingPointError, match=r"non-finite inner\['w'\]"):
        bilevel.custom_root(ridge_optimality)(diverged)(make_outer())
    with pytest.raises(TypeError, match="optimality must be callable"):
        bilevel.custom_root(None)
    with pytest.raises(TypeError, match="linear_solver must be"):
        bilevel.custom_root(ridge_optimality, linear_solver="cg")


def test_an_outer_leaf_optimality_ignores_gets_zero_with_one_unused_leaf_warning():
    def optimality(outer, w):
        return ridge_optimality(outer, w)

    def solve(outer):
        return closed_form(outer)

    wrapped = bilevel.custom_root(optimality)(solve)
    outer = {**make_outer(), "unused": torch.ones(3, dtype=D, requires_grad=True),
             "index": torch.tensor([1, 2])}  # an integer leaf is passed through, not differentiated
    with pytest.warns(bilevel.UnusedLeafWarning, match=r"outer\['unused'\]") as record:
        upper(outer, wrapped(outer)).backward()
    assert len(record) == 1 and "log_lam" not in str(record[0].message)
    assert torch.equal(outer["unused"].grad, torch.zeros(3, dtype=D))
    assert outer["log_lam"].grad.abs() > 0 and outer["shift"].grad.abs().max() > 0
    with warnings.catch_warnings():  # once per decorated function and outer structure
        warnings.simplefilter("error")
        upper(outer, wrapped(outer)).backward()


def test_the_returned_solution_is_a_copy_the_backward_uses_the_saved_root():
    outer = make_outer()
    w = bilevel.custom_root(ridge_optimality)(closed_form)(outer)
    loss = upper(outer, w)
    w["w"].add_(1.0)  # e.g. reused as storage after the forward: allowed, changes nothing
    loss.backward()
    expected = analytic_hypergrad({k: v.detach() for k, v in outer.items()})
    torch.testing.assert_close(outer["shift"].grad, expected["shift"], rtol=1e-12, atol=1e-12)
